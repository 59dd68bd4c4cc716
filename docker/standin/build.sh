#!/usr/bin/env bash
# Build the stand-in for AWS's Ray Serve SageMaker container that the image tests build FROM:
#   docker/standin/build.sh            # prints the stand-in's tag on stdout
#   docker build --build-arg BASE_IMAGE="$(docker/standin/build.sh)" --build-arg ENGINE=... .
# AWS's base images live in AWS's registry; where it cannot be reached (CI, this project's
# machines) the images are built on this instead. Two steps, each skipped when its image exists:
# 1. llava-standin/debian:bookworm: Debian 12 from Debian's own packages (debootstrap
#    --variant=minbase), imported into Docker: no registry needed.
# 2. llava-standin/ray-serve-ml:<hash of its Dockerfile>: Python, torch's CPU build, Ray Serve and
#    transformers on it (docker/standin/Dockerfile says what differs from AWS's image).
# Needs Docker, debootstrap (apt-get install debootstrap) and PyPI; pip in the build trusts the
# bundle named by PIP_CERT (default: the system's), as pip on this machine does. A CPU torch
# wheel found in PIP_FIND_LINKS is used; otherwise PyTorch's CPU index.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
log() { printf '==> %s\n' "$*" >&2; }
die() {
  printf 'error: %s\n' "$*" >&2
  exit 1
}
debian="llava-standin/debian:bookworm"
tag="llava-standin/ray-serve-ml:$(sha256sum "$here/Dockerfile" | cut -c1-12)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

if ! docker image inspect "$debian" >/dev/null 2>&1; then
  command -v debootstrap >/dev/null || die "debootstrap is missing: apt-get install debootstrap"
  log "building $debian with debootstrap (a minute or two)"
  debootstrap --variant=minbase bookworm "$work/rootfs" "${DEBIAN_MIRROR:-http://deb.debian.org/debian}" >&2
  tar -C "$work/rootfs" -c . | docker import --change 'CMD ["/bin/bash"]' - "$debian" >&2
  rm -rf "$work/rootfs"
fi

if ! docker image inspect "$tag" >/dev/null 2>&1; then
  log "building $tag: Python, torch (CPU), Ray Serve 2.55.1, transformers 5.8.0 (minutes)"
  cp "$here/Dockerfile" "$work/"
  cp "${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}" "$work/build-machine-ca.crt"
  mkdir "$work/wheels"
  for dir in ${PIP_FIND_LINKS:-}; do
    find "$dir" -maxdepth 1 -name 'torch-2.13.0+cpu-cp311-*.whl' -exec cp {} "$work/wheels/" \; 2>/dev/null || true
  done
  docker build --network host --build-arg DEBIAN_IMAGE="$debian" -t "$tag" "$work" >&2
fi
echo "$tag"
