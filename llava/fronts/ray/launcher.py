"""Start and stop a real Ray Serve front on loopback, as `make serve FRONT=ray` runs it.

Used by the tests and the benchmarks, beside the TorchServe launcher: the same `url()`, `logs()`
and context manager, so one set of API tests drives either front.

    with RayServe(model_dir, replicas=2) as rs:
        httpx.post(rs.url("/invocations"), json={...})
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from llava.fronts.torchserve.launcher import free_port

REPLICA_TITLE = "ServeReplica:llava:LlavaReplica"  # Ray names each replica's process so
BIND_FAILED = "Failed to bind to address "  # Ray Serve's proxy, when its port is taken


class RayServe:
    """A `python -m llava serve-ray` process with its own port, Ray session and log."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        replicas: int = 1,
        workdir: str | Path | None = None,
        env: dict[str, str] | None = None,
        address: str | None = None,
        proxy_location: str = "EveryNode",
        config: Path | None = None,
        metrics_port: int | None = None,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.config = config  # a model package's config.yaml: served instead of model_dir
        self.replicas = replicas
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="llava-ray-"))
        self.port = free_port()
        self.address = address
        self.proxy_location = proxy_location
        self.env = env or {}
        self.metrics_port = metrics_port  # its cluster's Prometheus metrics (a new one's)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def log_path(self) -> Path:
        return self.workdir / "serve-ray.log"

    def url(self, path: str = "") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def start(self, timeout_s: float = 300.0, tries: int = 3) -> RayServe:
        """Start the front and wait until every replica is up (the command prints ready).

        Ray's own processes take ports at random as they start, so one may take the port picked
        for the proxy before the proxy binds it: then the front starts again on another port."""
        attempt = 1
        while True:
            try:
                return self._start(timeout_s)
            except RuntimeError as error:
                if attempt >= tries or f"{BIND_FAILED}'127.0.0.1:{self.port}'" not in str(error):
                    raise
            attempt += 1
            self.port = free_port()

    def _start(self, timeout_s: float) -> RayServe:
        """Start the front once on `self.port`; raise with the log's tail if it does not come up."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "llava", "serve-ray", "--model", str(self.model_dir)]
        if self.config is not None:
            command += ["--config", str(self.config)]
        command += ["--replicas", str(self.replicas), "--port", str(self.port)]
        command += ["--proxy-location", self.proxy_location]
        if self.address:
            command += ["--address", self.address]
        if self.metrics_port:
            command += ["--metrics-port", str(self.metrics_port)]
        env = {**os.environ, **state_env(self.workdir), **self.env}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                command, cwd=self.workdir, env=env, stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + timeout_s
        while not ("(ready)" in self.logs() and self._pings()):  # the proxy may start after
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"Ray Serve did not start; last lines:\n{self.log_tail()}")
            time.sleep(0.5)
        return self

    def _pings(self) -> bool:
        """Tell whether the front answers /ping."""
        try:
            return httpx.get(self.url("/ping"), timeout=30).status_code == 200
        except httpx.TransportError:
            return False

    def replica_pids(self) -> list[int]:
        """Return the process ids of this front's replicas (on a cluster: `RayCluster`'s)."""
        return replica_pids(self.workdir)

    def stop(self, timeout_s: float = 60.0) -> None:
        """Stop gracefully (replicas flush their snapshots); kill what is left after."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.logs().splitlines()[-lines:])

    def __enter__(self) -> RayServe:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def replica_pids(workdir: Path) -> list[int]:
    """Return the process ids of the replicas started under `workdir` (a front's, or a
    cluster's nodes'): Ray titles each replica's process, and its environment names the
    workdir (`state_env`), which tells them from another front's on the same machine."""
    found = subprocess.run(
        ["pgrep", "-f", REPLICA_TITLE], capture_output=True, text=True, check=False
    )
    marker = f"\0LLAVA_SNAPSHOT_DIR={workdir / 'snapshots'}\0".encode()
    mine = []
    for pid in map(int, found.stdout.split()):
        try:
            environ = b"\0" + Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue  # gone meanwhile
        if marker in environ:
            mine.append(pid)
    return sorted(mine)


def state_env(workdir: Path) -> dict[str, str]:
    """The environment that puts a front's session registry and snapshots under workdir (a
    replica inherits it from the process that started its node)."""
    return {
        "LLAVA_SESSION_REGISTRY_DIR": str(workdir / "registry"),
        "LLAVA_SNAPSHOT_DIR": str(workdir / "snapshots"),
    }


class RayCluster:
    """A Ray cluster of `ray start` nodes on this machine, each with its own CPUs: a head, then
    workers joining it, as on separate machines (`ray start --block`, stopped by SIGTERM)."""

    def __init__(self, nodes: int = 2, cpus_per_node: int = 1, workdir: str | Path | None = None):
        self.nodes = nodes
        self.cpus = cpus_per_node
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="llava-raycluster-"))
        self.port = free_port()
        self.procs: list[subprocess.Popen[bytes]] = []

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 120.0) -> RayCluster:
        """Start the head and the workers; return once Ray counts every node alive."""
        ray = str(Path(sys.executable).with_name("ray"))
        common = ["--block", "--num-cpus", str(self.cpus), "--num-gpus", "0"]
        common += ["--node-ip-address", "127.0.0.1", "--disable-usage-stats"]
        head = [ray, "start", "--head", "--port", str(self.port), "--include-dashboard=false"]
        env = {**os.environ, **state_env(self.workdir)}
        self.workdir.mkdir(parents=True, exist_ok=True)
        for node in range(self.nodes):
            command = head if node == 0 else [ray, "start", "--address", self.address]
            with open(self.workdir / f"node{node}.log", "ab") as log:
                self.procs.append(
                    subprocess.Popen(
                        command + common, env=env, stdout=log, stderr=subprocess.STDOUT
                    )
                )
            self._wait_for(node + 1, time.monotonic() + timeout_s)
        return self

    def _wait_for(self, nodes: int, deadline: float) -> None:
        """Wait until the cluster has `nodes` active nodes (as `ray status` lists them)."""
        ray = str(Path(sys.executable).with_name("ray"))
        while True:
            status = subprocess.run(
                [ray, "status", "--address", self.address],
                capture_output=True,
                text=True,
                check=False,
            )
            active = status.stdout.partition("Active:")[2].partition("Pending:")[0]
            if active.count(" node_") >= nodes:
                return
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                self.stop()
                raise RuntimeError(f"Ray node {nodes} did not start: see {self.workdir}")
            time.sleep(1)

    def replica_pids(self) -> list[int]:
        """Return the process ids of the replicas on this cluster's nodes."""
        return replica_pids(self.workdir)

    def stop_node(self, index: int) -> None:
        """Take one node out, as a drained or lost machine: `ray stop` of what it started."""
        _stop_node(self.procs[index])

    def stop(self) -> None:
        """Stop the workers, then the head (each `ray start --block` stops what it started)."""
        for proc in reversed(self.procs):
            _stop_node(proc)
        self.procs = []

    def __enter__(self) -> RayCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _stop_node(proc: subprocess.Popen[bytes]) -> None:
    """Stop one `ray start --block` node with SIGTERM; kill it if it is still there a minute on."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
