"""A real TorchServe on loopback serving the tiny checkpoint, shared by the integration tests."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from helpers import Reference

from llava.archive import build_archive
from llava.launcher import TorchServe
from llava.tiny import build_checkpoint

WORKER_DIED = ("Backend worker process died", "worker died", "IllegalStateException")


@pytest.fixture(scope="session")
def model_store(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    store = tmp_path_factory.mktemp("model-store")
    build_archive(tiny_checkpoint, store, name="llava")
    return store


def start_server(store: Path, workdir: Path, **env: str) -> TorchServe:
    return TorchServe(store, "llava", workdir=workdir, env=env).start()


@contextmanager
def serving_profile(
    profile: str, tmp_path_factory: pytest.TempPathFactory, **env: str
) -> Iterator[tuple[TorchServe, Reference]]:
    """Build a tiny profile's checkpoint, serve it, and give the oracle on the same weights."""
    checkpoint = build_checkpoint(tmp_path_factory.mktemp("ckpt") / profile, profile)
    store = tmp_path_factory.mktemp(f"store-{profile}")
    build_archive(checkpoint, store, name="llava")
    server = start_server(store, tmp_path_factory.mktemp(f"ts-{profile}"), **env)
    try:
        yield server, Reference(Path(checkpoint))
    finally:
        server.stop()


@contextmanager
def running_servers(
    store: Path, tmp_path_factory: pytest.TempPathFactory, count: int, prefix: str
) -> Iterator[list[TorchServe]]:
    """Start `count` TorchServes side by side; at the end none may show a worker death."""
    with ThreadPoolExecutor(count) as pool:
        futures = [
            pool.submit(start_server, store, tmp_path_factory.mktemp(f"{prefix}-{i}"))
            for i in range(count)
        ]
        servers = [f.result() for f in futures]
    try:
        yield servers
        for ts in servers:
            assert_no_worker_death(ts)
    finally:
        for ts in servers:
            ts.stop()


def worker(ts: TorchServe) -> dict:
    """Return the model's one worker as the management API describes it (pid, status)."""
    r = httpx.get(f"http://127.0.0.1:{ts.management_port}/models/{ts.model}", timeout=10)
    r.raise_for_status()
    [model] = r.json()
    [only] = model["workers"]
    return only


def wait_for_new_worker(ts: TorchServe, old_pid: int, timeout_s: float = 120) -> dict:
    """Poll the management API until a worker other than `old_pid` is READY."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            now = worker(ts)
            if now["pid"] != old_pid and now["status"] == "READY":
                return now
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.2)
    raise AssertionError("TorchServe did not restart the worker:\n" + ts.log_tail(60))


def assert_no_worker_death(server: TorchServe) -> None:
    logs = server.logs()
    for marker in WORKER_DIED:
        assert marker not in logs, f"{marker!r} in TorchServe logs:\n{server.log_tail(60)}"


@pytest.fixture(scope="session")
def server(model_store: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TorchServe]:
    """One TorchServe for the whole run; at the end, its logs must show no worker death."""
    ts = start_server(model_store, tmp_path_factory.mktemp("ts"))
    try:
        yield ts
        assert_no_worker_death(ts)
    finally:
        ts.stop()
