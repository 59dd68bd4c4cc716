"""Stop vLLM's engine core when the worker that started it dies.

vLLM's engine core (and its workers) outlive a frontend killed with SIGKILL: the core waits on its
input socket for ever, holding its memory (on a GPU, the memory the next worker needs). Measured
here: every TorchServe stop left a core and a worker of 2-3 GB behind. The worker starts this
process beside each engine: it waits for the end of a pipe only the worker holds open, which
ends when the worker does (however it dies) or when the worker lets that engine go, then kills
the engine's processes it was given (those still running that it was given, checked by their
start times, so a reused pid is never hit).

    python -m llava.engines.vllm.reaper FD PID:START [PID:START ...]
"""

from __future__ import annotations

import os
import signal
import sys

import psutil


def reap(targets: list[tuple[int, float]]) -> list[int]:
    """Kill each target (and what it started) that is still the process it was; return the
    pids killed."""
    killed = []
    for pid, started in targets:
        try:
            process = psutil.Process(pid)
            if abs(process.create_time() - started) > 0.01:
                continue  # that pid is another process now
            for child in process.children(recursive=True):
                child.send_signal(signal.SIGKILL)
                killed.append(child.pid)
            process.send_signal(signal.SIGKILL)
            killed.append(pid)
        except psutil.Error:
            continue  # gone already
    return killed


def main(argv: list[str]) -> None:
    fd = int(argv[0])
    targets = [(int(p), float(t)) for p, t in (arg.split(":") for arg in argv[1:])]
    while os.read(fd, 1):  # returns b"" once no one holds the write end
        pass
    reap(targets)


if __name__ == "__main__":
    main(sys.argv[1:])
