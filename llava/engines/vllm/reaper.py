"""Stop vLLM's engine core when the worker that started it dies, or when it lets that engine go.

vLLM's engine core (and its workers) outlive a frontend killed with SIGKILL: the core waits on its
input socket for ever, holding its memory (on a GPU, the memory the next worker needs). Measured
here: every TorchServe stop left a core and a worker of 2-3 GB behind, and so did a worker
killed while its engine was starting. The worker starts this process before each engine. While
the engine starts, it records every process the worker starts (vLLM's core and its workers,
however far they got); SIGUSR1 (the engine is up) ends the recording. When the worker dies
(however: this process is then no longer its child) or sends SIGTERM (it lets the engine go, or
the start failed), it kills those it recorded that vLLM has named its own and that still run,
checked by start times, so a reused pid is never hit. No pipe: a forked engine core would hold
its write end open.

    python -m llava.engines.vllm.reaper WORKER_PID
"""

from __future__ import annotations

import os
import signal
import sys
import threading

import psutil

LOOK_S = 0.1  # how often the worker's new processes (and the worker) are looked at
VLLM = "VLLM::"  # how vLLM names its engine core and workers once they run
SIGNALS = {signal.SIGUSR1, signal.SIGTERM}  # blocked by the worker until the handlers are set


def reap(targets: dict[int, float]) -> list[int]:
    """Kill each target (and what it started) that is still the process it was; return the
    pids killed."""
    killed = []
    for pid, started in targets.items():
        try:
            process = psutil.Process(pid)
            if abs(process.create_time() - started) > 0.01:
                continue  # that pid is another process now
            if not process.name().startswith(VLLM):
                continue  # not vLLM's: an image process replaced meanwhile, a tracker
            for child in process.children(recursive=True):
                child.send_signal(signal.SIGKILL)
                killed.append(child.pid)
            process.send_signal(signal.SIGKILL)
            killed.append(pid)
        except psutil.Error:
            continue  # gone already
    return killed


def record(worker: int, since: float, seen: dict[int, float]) -> None:
    """Add to `seen` the worker's processes started at or after `since` (not this one)."""
    try:
        children = psutil.Process(worker).children(recursive=True)
    except psutil.Error:
        return
    for child in children:
        try:
            created = child.create_time()
        except psutil.Error:
            continue
        if created >= since and child.pid != os.getpid():
            seen[child.pid] = created


def watch(worker: int, up: threading.Event, let_go: threading.Event) -> dict[int, float]:
    """Record the engine's processes until it is up; return them once it is to be reaped."""
    since = psutil.Process().create_time() - 1.0  # the engine starts after this process
    seen: dict[int, float] = {}
    while not let_go.is_set() and os.getppid() == worker:
        if not up.is_set():
            record(worker, since, seen)
        let_go.wait(LOOK_S)
    return seen


def main(argv: list[str]) -> None:
    worker = int(argv[0])
    up, let_go = threading.Event(), threading.Event()
    signal.signal(signal.SIGUSR1, lambda *_: up.set())
    signal.signal(signal.SIGTERM, lambda *_: let_go.set())
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)  # those sent meanwhile arrive now
    reap(watch(worker, up, let_go))


if __name__ == "__main__":
    main(sys.argv[1:])
