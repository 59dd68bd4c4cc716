"""Start and stop a real TorchServe on loopback with its own ports, logs and temp directory.

Used by the tests, the benchmark and the local SageMaker runtime; `make serve` runs TorchServe
in the foreground instead.

    with TorchServe(model_store="model-store", model="llava") as ts:
        httpx.post(ts.url("/predictions/llava"), json={...})
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from llava.core.paths import CHECKOUT
from llava.fronts.torchserve.stopping import drain_workers

ROOT = CHECKOUT


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that is free now and not handed out before here."""
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """Return `count` distinct free ports, none handed out before by this process.

    The sockets stay bound until all ports are picked, so the OS cannot give the same port
    twice; several TorchServes started side by side each need six.
    """
    socks: list[socket.socket] = []
    ports: list[int] = []
    try:
        while len(ports) < count:
            sock = socket.socket()
            socks.append(sock)
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
            if port not in _HANDED_OUT:
                _HANDED_OUT.add(port)
                ports.append(port)
    finally:
        for sock in socks:
            sock.close()
    return ports


def _socket_taken(worker_port: int, span: int = 8) -> bool:
    """Tell whether a worker port's Unix sockets (/tmp/.ts.sock.<port>, whatever TMPDIR says,
    and the next few, which restarted workers take) are another TorchServe's: ports are per
    network namespace, these paths are the machine's."""
    return any(Path(f"/tmp/.ts.sock.{worker_port + i}").exists() for i in range(span))


class TorchServe:
    """One TorchServe process serving one model from a model store, bound to 127.0.0.1."""

    def __init__(
        self,
        model_store: str | Path,
        model: str = "llava",
        *,
        workdir: str | Path | None = None,
        env: dict[str, str] | None = None,
        port: int | None = None,
    ) -> None:
        self.model_store = Path(model_store).resolve()
        self.model = model
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="torchserve-"))
        self.extra_env = env or {}
        ports = free_ports(6)
        while _socket_taken(ports[3]):  # another network namespace's TorchServe holds it
            ports[3] = free_port()
        self.port = port or ports[0]
        self.management_port, self.metrics_port, self.worker_port = ports[1:4]
        self._grpc_ports = ports[4:6]
        self.log_dir = self.workdir / "logs"
        self._bin = Path(sys.executable).parent

    def url(self, path: str = "") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            PATH=f"{self._bin}{os.pathsep}{env.get('PATH', '')}",
            LOG_LOCATION=str(self.log_dir),
            METRICS_LOCATION=str(self.log_dir),
            TMPDIR=str(self.workdir),  # the pid file lives here: start and stop must agree
            TS_CONFIG_FILE=str(self._write_config()),
        )
        env.update(self.extra_env)
        return env

    def _write_config(self) -> Path:
        text = (ROOT / "config.properties").read_text()
        text = text.replace("127.0.0.1:8080", f"127.0.0.1:{self.port}")
        text = text.replace("127.0.0.1:8081", f"127.0.0.1:{self.management_port}")
        text = text.replace("127.0.0.1:8082", f"127.0.0.1:{self.metrics_port}")
        text += f"\nmodel_store={self.model_store}\nload_models={self.model}={self.model}\n"
        text += f"metrics_config={ROOT / 'handler' / 'metrics.yaml'}\n"
        # Worker sockets are /tmp/.ts.sock.<port> whatever TMPDIR says: give each instance its
        # own range so several TorchServes can run side by side.
        text += f"\ninitial_worker_port={self.worker_port}\n"
        # gRPC cannot be switched off in TorchServe 0.12: give it free ports too.
        text += "grpc_inference_port={}\ngrpc_management_port={}\n".format(*self._grpc_ports)
        path = self.workdir / "config.properties"
        path.write_text(text)
        return path

    def start(self, timeout_s: float = 180.0) -> TorchServe:
        """Start TorchServe and wait until its model's worker is ready."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        torchserve = shutil.which("torchserve", path=str(self._bin)) or "torchserve"
        with open(self.workdir / "torchserve.out", "ab") as out:
            subprocess.run(
                [
                    torchserve,
                    "--start",
                    "--ncs",
                    "--disable-token-auth",
                    "--model-store",
                    str(self.model_store),
                ],
                cwd=self.workdir,
                env=self._env(),
                stdout=out,
                stderr=subprocess.STDOUT,
                check=True,
            )
        self.wait_ready(timeout_s)
        return self

    def wait_ready(self, timeout_s: float) -> None:
        """Poll until /ping is 200 and the model's worker is READY, or fail with the logs' tail.
        TorchServe's own /ping is 200 while its worker still loads the model (a minute for
        vLLM's engine here); the image's /ping (docker/torchserve/ready-ping) waits for it."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if "Torchserve stopped" in self.log_tail(20):
                break  # it gave up (a port taken, a bad config): do not wait for nothing
            try:
                pinged = httpx.get(self.url("/ping"), timeout=2).status_code == 200
                if pinged and self.worker()["status"] == "READY":
                    return
            except (httpx.HTTPError, ValueError, KeyError):
                pass  # not up yet, or no worker registered yet
            time.sleep(0.5)
        raise RuntimeError(
            f"TorchServe on port {self.port} not healthy after {timeout_s} s; last log lines:\n"
            + self.log_tail()
        )

    def frontend_pid(self) -> int | None:
        """Return the frontend's pid from its pid file, None when it is not running."""
        try:
            return int((self.workdir / ".model_server.pid").read_text().strip())
        except (OSError, ValueError):
            return None

    def stop(self, *, drain_s: float = 0.0) -> None:
        """Stop TorchServe (same TMPDIR as start, so it finds its pid file); with `drain_s`,
        its worker first drains and flushes its sessions (as on SIGTERM in the image)."""
        pid = self.frontend_pid()
        if drain_s and pid is not None:
            drain_workers(pid, drain_s, self.workdir)
        torchserve = shutil.which("torchserve", path=str(self._bin)) or "torchserve"
        subprocess.run(
            [torchserve, "--stop"],
            cwd=self.workdir,
            env=self._env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            check=False,
        )

    def worker(self) -> dict[str, Any]:
        """Return the model's one worker as the management API describes it (pid, status)."""
        r = httpx.get(f"http://127.0.0.1:{self.management_port}/models/{self.model}", timeout=10)
        r.raise_for_status()
        [model] = r.json()
        [only] = model["workers"]
        return dict(only)

    def wait_for_new_worker(self, old_pid: int, timeout_s: float = 300) -> dict[str, Any]:
        """Poll until a worker other than `old_pid` is READY (TorchServe restarts a dead one)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                now = self.worker()
                if now["pid"] != old_pid and now["status"] == "READY":
                    return now
            except (httpx.HTTPError, ValueError):
                pass  # the frontend answers oddly while the worker restarts
            time.sleep(0.2)
        raise RuntimeError("TorchServe did not restart the worker:\n" + self.log_tail(60))

    def logs(self) -> str:
        """Return the frontend and worker logs."""
        parts = []
        for name in ("ts_log.log", "model_log.log"):
            path = self.log_dir / name
            if path.exists():
                parts.append(path.read_text(errors="replace"))
        return "\n".join(parts)

    def wait_for_log(self, text: str, timeout_s: float = 60, *, seen: int = 0) -> None:
        """Wait until the logs say `text` more than `seen` times (written as things happen)."""
        deadline = time.monotonic() + timeout_s
        while self.logs().count(text) <= seen:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the logs never said {text!r}:\n" + self.log_tail(40))
            time.sleep(0.05)

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.logs().splitlines()[-lines:])

    def __enter__(self) -> TorchServe:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
