"""Build the images `make test` tests while the other suites run: a cold build waits on PyPI and
Debian's mirrors as much as on the CPU (about 15 minutes here, against 8 for the image tests
themselves), so `make test` starts it first and the image tests find the images in Docker's
cache.

    prebuild.py start PID FRONT-ENGINE...  # in the background: dockerd if none runs, then builds
    prebuild.py wait                       # until they are built; the log's tail if one failed

The builder watches process PID (make): once that ends, however it ends, it stops the dockerd
it started, as the image tests' own fixture stops the one it starts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from containers import REPO, build_image, daemon_up, standin, start_daemon

STATE = REPO / "build" / "prebuild"
STATUS = STATE / "status.json"
LOG = STATE / "build.log"
PID = STATE / "builder.pid"


def start(images: list[str], watched: int) -> None:
    """Fork the builder into the background and return at once."""
    STATE.mkdir(parents=True, exist_ok=True)
    STATUS.unlink(missing_ok=True)
    with open(LOG, "wb") as log:
        builder = subprocess.Popen(
            [sys.executable, __file__, "build", str(watched), *images],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=Path(__file__).parent,
        )
    PID.write_text(str(builder.pid))
    print(f"building {', '.join(images)} in the background: {LOG}")


def build(watched: int, images: list[str]) -> None:
    """Build each image, write the status, then keep dockerd (if started here) until the
    watched process ends."""
    daemon = None
    built: dict[str, int] = {}
    status: dict[str, object] = {"built": built}
    try:
        if not daemon_up():  # no Docker at all: the image tests say so themselves
            daemon = start_daemon(STATE / "dockerd.log")
        base = standin()
        for name in images:
            front, engine = name.split("-", 1)
            tag, seconds = build_image(front, engine, base)
            built[tag] = round(seconds)
    except Exception as error:  # the image tests build it again and fail with Docker's words
        status["error"] = f"{type(error).__name__}: {error}"
    STATUS.write_text(json.dumps(status))
    if daemon is None:
        return
    while _alive(watched):
        time.sleep(2)  # polling a process that is not ours: nothing to wait on
    daemon.terminate()
    daemon.wait(120)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait(timeout_s: float = 3600) -> int:
    """Wait for the background build; print what it built, or why it did not."""
    deadline = time.monotonic() + timeout_s
    builder = int(PID.read_text()) if PID.exists() else None
    while not STATUS.exists():
        if builder is None or not _alive(builder):  # it ended without a word: see its log
            print("the background build ended without finishing:", _tail(), sep="\n")
            return 0
        if time.monotonic() > deadline:
            print(f"the image build did not finish in {timeout_s:.0f} s: {LOG}")
            return 1
        time.sleep(2)  # the builder writes the file once; a poll, not a synchronisation
    status = json.loads(STATUS.read_text())
    for tag, seconds in status["built"].items():
        print(f"prebuilt {tag} in {seconds} s")
    if "error" in status:
        print("the background build failed:", status["error"], _tail(), sep="\n")
    return 0  # the image tests report a failed build themselves


def _tail(lines: int = 40) -> str:
    if not LOG.exists():
        return f"(no log at {LOG})"
    return "\n".join(LOG.read_text(errors="replace").splitlines()[-lines:])


if __name__ == "__main__":
    command, *rest = sys.argv[1:]
    if command == "start":
        start(rest[1:], int(rest[0]))
    elif command == "build":
        build(int(rest[0]), rest[1:])
    else:
        sys.exit(wait())
