"""The images' supervisor (`python -m llava.fronts.torchserve.stopping -- torchserve ...`): the
exit status `docker stop` and SageMaker see."""

from __future__ import annotations

import signal
import subprocess
import sys

SUPERVISOR = [sys.executable, "-m", "llava.fronts.torchserve.stopping", "--timeout", "5", "--"]


def test_a_requested_stop_exits_0_though_the_signal_ended_the_child() -> None:
    child = "import time; print('up', flush=True); time.sleep(120)"
    process = subprocess.Popen([*SUPERVISOR, sys.executable, "-c", child], stdout=subprocess.PIPE)
    try:
        assert process.stdout is not None and process.stdout.readline() == b"up\n"
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0  # was 241: the child's -15, as sys.exit saw it
    finally:
        process.kill()
        process.wait()


def test_a_child_that_ends_by_itself_passes_its_status_on() -> None:
    run = subprocess.run(
        [*SUPERVISOR, sys.executable, "-c", "raise SystemExit(3)"], timeout=60, check=False
    )
    assert run.returncode == 3
