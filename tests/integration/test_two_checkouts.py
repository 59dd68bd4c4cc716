"""Two checkouts' `make serve` at once on one machine, each stopped by its own `make stop`.

TorchServe keeps its pid file in the temp dir and its worker sockets by port: two servers left
to the defaults refused each other ("TorchServe is already running"), and `make stop` stopped
whichever had written the pid file last. Each checkout now keeps its own (`.torchserve/`, PORT).
The checkouts here are copies of this one's Makefile and TorchServe config, sharing its venv.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from engine_under_test import reference_only

from llava.core.paths import CHECKOUT

pytestmark = [
    pytest.mark.integration,
    reference_only(
        "two checkouts' own TorchServe files and `make serve`/`make stop`, whatever the engine "
        "(and `make` installs from PyPI, out of reach in the vLLM pass's private network)"
    ),
]

VENV = Path(sys.executable).parent.parent


def checkout(root: Path) -> Path:
    """A checkout's files `make serve` reads, with their times kept (the venv stays current)."""
    root.mkdir()
    for name in ("Makefile", "config.properties", "pyproject.toml"):
        shutil.copy2(CHECKOUT / name, root / name)
    for folder in ("handler", "docker"):
        shutil.copytree(CHECKOUT / folder, root / folder, copy_function=shutil.copy2)
    return root


def make(root: Path, *args: str, port: int) -> list[str]:
    """`make` in a copy, never reinstalling the shared venv (`-o` its stamp): where the stamp is
    older than pyproject.toml, make would install the kit editable from the copy, deleted after."""
    return [
        "make", "-C", str(root), "-o", f"{VENV}/bin/.installed", *args, f"VENV={VENV}",
        f"PORT={port}",
        f"MODEL={CHECKOUT / 'models' / 'shapes'}", f"STORE={root / 'model-store'}",
    ]  # fmt: skip


def free_block(start: int) -> int:
    """A port from `start` up whose next four, and the one 1000 above, are free too."""
    for base in range(start, start + 5000, 10):
        wanted = [*range(base, base + 5), base + 1000]
        socks = []
        try:
            for port in wanted:
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError(f"no free block of ports from {start}")


def answers(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/ping", timeout=10).status_code == 200
    except httpx.HTTPError:
        return False


def wait_until(condition, what: str, timeout_s: float = 180) -> None:  # type: ignore[no-untyped-def]
    """Poll what another process makes true (a server starting or stopping)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.25)


def test_two_checkouts_serve_side_by_side_and_each_stops_its_own(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TS_", "MAKE"))}
    env.pop("TMPDIR", None)
    roots = [checkout(tmp_path / f"checkout{i}") for i in (0, 1)]
    ports = [free_block(20000), free_block(30000)]
    logs = [open(root / "serve.log", "wb") for root in roots]  # noqa: SIM115
    servers = [
        subprocess.Popen(
            make(root, "serve", port=port), env=env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        for root, port, log in zip(roots, ports, logs, strict=True)
    ]  # fmt: skip
    try:
        for root, port, server in zip(roots, ports, servers, strict=True):
            wait_until(
                lambda port=port, server=server: answers(port) or server.poll() is not None,
                f"make serve on {port}",
            )
            assert answers(port), (root / "serve.log").read_text()[-3000:]
        subprocess.run(
            make(roots[0], "stop", port=ports[0]), env=env, check=True, capture_output=True
        )
        wait_until(lambda: not answers(ports[0]), "the first checkout's server to stop", 60)
        assert answers(ports[1])  # the other checkout's server is untouched
        body = {"type": "open_session"}  # a text-only session: served as usual
        assert (
            httpx.post(
                f"http://127.0.0.1:{ports[1]}/invocations", json=body, timeout=180
            ).status_code
            == 200
        )
        subprocess.run(
            make(roots[1], "stop", port=ports[1]), env=env, check=True, capture_output=True
        )
        wait_until(lambda: not answers(ports[1]), "the second checkout's server to stop", 60)
    finally:
        for server in servers:
            if server.poll() is None:
                os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        for log in logs:
            log.close()
