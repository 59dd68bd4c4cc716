#!/usr/bin/env bash
# The GPU machine's check in one timed script: the fronts' figures over the paced engine
# (bench/front.py: the machine's own cores in front of a GPU-paced engine), then the
# transformers engine's GPU suite (tests/gpu), each inside its own time limit so a short lease
# still returns both logs. Needs CUDA, Java 17+ and TorchServe 0.12.0 importable by GPU_PY.
#
#   RESULTS=dir FRONT_S=240 SUITE_S=300 bash bench/gpu_check.sh
set -u
cd "$(dirname "$0")/.." || exit
RESULTS=${RESULTS:-bench/results/gpu-check}
PY=${GPU_PY:-python3}
FRONT_S=${FRONT_S:-240}
SUITE_S=${SUITE_S:-300}
export PYTHONUNBUFFERED=1
mkdir -p "$RESULTS"

{
    date -u
    nproc
    "$PY" -c "import sys, torch, transformers; print(sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name(0))"
    java -version 2>&1 | head -1
} | tee "$RESULTS/device.txt"

echo "== bench/front.py (at most ${FRONT_S} s)"
timeout "$FRONT_S" "$PY" bench/front.py --step-ms 7 --streams 1 8 32 64 128 --tokens 32 1024 \
    --out "$RESULTS/front.json" 2>&1 | tee "$RESULTS/front.log"
echo "front: exit ${PIPESTATUS[0]}"

echo "== tests/gpu (at most ${SUITE_S} s)"
timeout "$SUITE_S" "$PY" -m pytest -q -s -p no:cacheprovider -rfEs --durations=0 tests/gpu \
    2>&1 | tee "$RESULTS/gpu-suite.log"
echo "suite: exit ${PIPESTATUS[0]}"
