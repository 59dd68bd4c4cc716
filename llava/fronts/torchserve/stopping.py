"""Stop a TorchServe instance without losing a finished turn: drain its worker, then the frontend.

TorchServe's frontend ends its workers with `destroyForcibly` (SIGKILL) when it is stopped, so
a worker left to it would never flush what it holds. The order here:
1. the worker gets SIGTERM: it drains (no new sessions, answers in flight finish within the
   grace, every session's latest state is flushed to the shared store), says so with a marker
   file (`drained_marker`) and stays, refusing everything, so the frontend does not start a
   fresh worker in its place; it exits by itself only if nobody stops it within `LINGER_S`
   (a SIGTERM sent to the worker alone: a fresh worker then serves again);
2. then the frontend is stopped.

`python -m llava.fronts.torchserve.stopping -- torchserve --start --foreground ...` runs a
TorchServe under a supervisor that does this on SIGTERM (the container's entry point: SageMaker
sends SIGTERM on scale-in and updates, then SIGKILL after its grace); the launcher's
`TorchServe.stop(drain=True)` does the same for a TorchServe it started.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

WORKER_MARK = "model_service_worker"
FRONTEND_MARK = "org.pytorch.serve.ModelServer"
LINGER_S = 120.0


def drained_marker(pid: int, directory: str | Path | None = None) -> Path:
    """Return the file a drained worker writes (in the temp dir it shares with its frontend)."""
    return Path(directory or tempfile.gettempdir()) / f"llava-drained-{pid}"


def on_sigterm(drain: Callable[[], Any]) -> bool:
    """In a worker: on SIGTERM run `drain` on a thread of its own, mark the worker drained,
    and exit if the frontend has not stopped it `LINGER_S` later.

    Returns False where no handler can be installed (not the main thread)."""

    def handler(signum: int, frame: Any) -> None:
        def run() -> None:
            try:
                drain()
            except Exception:
                log.exception("draining failed; the worker stops with what was flushed")
            try:
                drained_marker(os.getpid()).touch()
            except OSError:
                log.warning("could not mark the worker drained", exc_info=True)
            time.sleep(LINGER_S)  # the frontend stops the worker before this, normally
            logging.shutdown()
            os._exit(0)

        threading.Thread(target=run, name="llava-drain", daemon=True).start()

    try:
        signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: TorchServe's SIGKILL is all there is
        return False
    return True


def descendants(pid: int) -> list[tuple[int, str]]:
    """Return the processes below `pid` with their command lines (Linux's /proc)."""
    parents: dict[int, int] = {}
    commands: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
            commands[int(entry.name)] = (
                (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            )
        except (OSError, ValueError, IndexError):
            continue  # it exited meanwhile
    found: list[tuple[int, str]] = []
    frontier = [pid]
    while frontier:
        parent = frontier.pop()
        for child, ppid in parents.items():
            if ppid == parent:
                found.append((child, commands.get(child, "")))
                frontier.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie has exited: it only waits for its parent
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def drain_workers(
    frontend_pid: int, timeout_s: float, marker_dir: str | Path | None = None
) -> list[int]:
    """SIGTERM every TorchServe worker below `frontend_pid`; wait until each has drained (its
    marker is written) or exited, at most `timeout_s`; return those that had not."""
    workers = [pid for pid, command in descendants(frontend_pid) if WORKER_MARK in command]

    def done(pid: int) -> bool:
        return not alive(pid) or drained_marker(pid, marker_dir).exists()

    for pid in workers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    log.info("draining %d worker(s): %s", len(workers), workers)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not all(done(pid) for pid in workers):
        time.sleep(0.1)
    left = [pid for pid in workers if not done(pid)]
    for pid in workers:
        drained_marker(pid, marker_dir).unlink(missing_ok=True)
    return left


def supervise(command: list[str], timeout_s: float) -> int:
    """Run TorchServe in the foreground; on SIGTERM drain its workers, then stop it.

    Returns TorchServe's exit status if it ended by itself; after a requested stop, 0 once every
    worker drained (what `docker stop` should see), 1 if one did not."""
    stopping = threading.Event()

    def stop(signum: int, frame: Any) -> None:
        stopping.set()

    signal.signal(signal.SIGTERM, stop)  # before the child starts: no SIGTERM goes unheard
    signal.signal(signal.SIGINT, stop)
    child = subprocess.Popen(command)
    while child.poll() is None and not stopping.wait(0.5):
        pass
    if child.poll() is not None:
        return child.returncode
    left = drain_workers(child.pid, timeout_s)
    if left:
        log.warning("workers %s did not drain in %.0f s", left, timeout_s)
    for pid, command_line in descendants(child.pid):
        if FRONTEND_MARK in command_line:
            os.kill(pid, signal.SIGTERM)
    child.terminate()  # TorchServe's launcher then ends by the signal: that is the stop asked for
    try:
        child.wait(timeout=30)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
    return 1 if left else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--timeout",
        type=float,
        default=float(os.environ.get("LLAVA_DRAIN_TIMEOUT_S", "90")),
        help="seconds the workers may take to drain (the grace plus the store's flush)",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- torchserve ... --foreground")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the TorchServe command after --")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    return supervise(command, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
