#!/usr/bin/env bash
# Run the TorchServe image's stack where no Docker engine is: TorchServe 0.12.0, its Java
# frontend and the kit on the Ray Serve container's Python (3.13) with the old DLC's torch
# (2.6.0), in a Debian 13 root (debootstrap), with Java 21 (Debian's) or the host's Java 17.
# Runs the image's own `serve` and the TorchServe suites there (not test_shipping.py: it lints
# the repository's scripts with tools this root does not install). Root only; about 30 minutes.
#
#   sudo docker/torchserve/check_base_python.sh [ROOT] [JAVA_HOME on the host, to bind-mount]
set -euo pipefail
root="${1:-/opt/trixie}"
host_java="${2:-}"
repo="$(cd "$(dirname "$0")/../.." && pwd)"
log() { printf '[check-base-python] %s\n' "$*" >&2; }

if [[ ! -x "$root/usr/bin/python3.13" ]]; then
  command -v debootstrap >/dev/null || apt-get install -y -q debootstrap
  log "debootstrap trixie into $root (a few minutes)"
  debootstrap --variant=minbase --include=python3.13,python3.13-venv,ca-certificates \
    trixie "$root" http://deb.debian.org/debian
fi
mounted=()
bind() { # bind-mount $1 at $root$2 unless something is there already; undone on exit
  mkdir -p "$root$2"
  if ! mountpoint -q "$root$2"; then
    mount --bind "$1" "$root$2"
    mounted=("$root$2" "${mounted[@]}")
  fi
}
unbind() {
  for path in "${mounted[@]}"; do umount "$path" || true; done
}
trap unbind EXIT
for fs in /proc /dev /dev/shm; do bind "$fs" "$fs"; done
# The host's CA bundle: package registries may sit behind a proxy with its own certificate.
cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"
log "Debian's torch 2.6.0 and Java 21"
chroot "$root" bash -c "apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive \
  apt-get install -y -q --no-install-recommends python3-torch openjdk-21-jre-headless python3-venv"
java_env=""
if [[ -n "$host_java" ]]; then # e.g. /usr/lib/jvm/java-17-openjdk-amd64, with its /etc files
  bind "$host_java" /opt/host-java
  if [[ -d /etc/java-17-openjdk ]]; then bind /etc/java-17-openjdk /etc/java-17-openjdk; fi
  java_env="export JAVA_HOME=/opt/host-java PATH=/opt/host-java/bin:\$PATH;"
fi
rm -rf "$root/root/kit" && git clone -q "$repo" "$root/root/kit"
log "the kit, as the Dockerfile installs it: base_constraints.py, then the lock"
chroot "$root" env -u PIP_FIND_LINKS -u PIP_CONSTRAINT bash -c "cd /root/kit \
  && python3 -m venv --system-site-packages .venv \
  && .venv/bin/python docker/base_constraints.py > /tmp/constraints.txt \
  && .venv/bin/pip install -q -c /tmp/constraints.txt -c docker/image.lock \
       -e '.[engine,serve,aws]' pytest hypothesis openai 'moto[s3,sagemaker]>=5'"
log "the suites"
chroot "$root" bash -c "$java_env cd /root/kit && java -version 2>&1 | head -1 \
  && .venv/bin/python -c 'import sys, torch; print(sys.version.split()[0], torch.__version__)' \
  && .venv/bin/python -m pytest -q -p no:cacheprovider -k 'not ray' tests/unit \
       --ignore tests/unit/test_shipping.py \
       tests/integration/test_image_entrypoint.py tests/integration/test_sessions_api.py \
       tests/integration/test_openai_api.py tests/integration/test_exact_answers.py \
       tests/integration/test_sees.py tests/integration/test_local_runtime.py"
