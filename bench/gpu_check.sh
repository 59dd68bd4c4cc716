#!/usr/bin/env bash
# The GPU machine's check in one timed script: the fronts' figures over the paced engine
# (bench/front.py: the machine's own cores in front of a GPU-paced engine), then the
# transformers engine's GPU suite (tests/gpu), each inside its own time limit so a short lease
# still returns both logs. Needs CUDA, Java 17+ and TorchServe 0.12.0 importable by GPU_PY.
#
#   RESULTS=dir FRONT_S=240 SUITE_S=300 bash bench/gpu_check.sh
#
# On a machine with torch but no Java or TorchServe, carry .whl/ (bench/gpu_carry.sh) and first:
#   S=/tmp/site; python3 -m pip install -q --no-index --no-deps --target $S .whl/*.whl
#   mkdir -p $S/ts/frontend /tmp/jre && python3 -c "import lzma, shutil, sys;
#   shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], 'wb'))" \
#   .whl/model-server.jar.xz $S/ts/frontend/model-server.jar
#   python3 -m tarfile -e .whl/jre-min.tar.xz /tmp/jre
#   export JAVA_HOME=/tmp/jre/jre-min PATH=/tmp/jre/jre-min/bin:$S/bin:$PATH PYTHONPATH=$S:$PWD
# The GPU suite builds two 7B checkpoints (14 GB each) and copies one into an archive: give it
# 50 GB of /tmp and more than the 340 s it had on an H200; the front's figures take about 150 s.
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

fronts=torchserve  # and Ray Serve's where its wheel came along
"$PY" -c "import ray.serve" 2>/dev/null && fronts="torchserve ray"
echo "== bench/front.py, $fronts (at most ${FRONT_S} s)"
# shellcheck disable=SC2086  # one word per front
timeout "$FRONT_S" "$PY" bench/front.py --fronts $fronts --step-ms 7 --streams 1 8 32 64 128 \
    --tokens 32 1024 --out "$RESULTS/front.json" 2>&1 | tee "$RESULTS/front.log"
echo "front: exit ${PIPESTATUS[0]}"

echo "== tests/gpu (at most ${SUITE_S} s)"
timeout "$SUITE_S" "$PY" -m pytest -q -s -p no:cacheprovider -rfEs --durations=0 tests/gpu \
    2>&1 | tee "$RESULTS/gpu-suite.log"
echo "suite: exit ${PIPESTATUS[0]}"
