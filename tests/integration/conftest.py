"""A real TorchServe on loopback serving the tiny checkpoint, shared by the integration tests."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import engine_under_test
import httpx
import pytest
from engine_under_test import ENGINE, oracle
from helpers import Reference, in_private_network

from llava.fronts.ray.launcher import RayCluster, RayServe
from llava.fronts.torchserve.launcher import TorchServe, free_port
from llava.tools.archive import build_archive
from llava.tools.tiny import build_checkpoint

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
    engine_under_test.skip_unservable(profile)
    served_profile = engine_under_test.profile(profile)  # on vLLM, its 32-wide-heads twin
    checkpoint = build_checkpoint(tmp_path_factory.mktemp("ckpt") / profile, served_profile)
    store = tmp_path_factory.mktemp(f"store-{profile}")
    build_archive(checkpoint, store, name="llava")
    server = start_server(store, tmp_path_factory.mktemp(f"ts-{profile}"), **env)
    try:
        yield server, oracle(Path(checkpoint))
    finally:
        server.stop()


# Every family's answers (exact answers, added pictures, pictures in several chat messages) are
# tested on one server per tiny family for the whole run: prefills in chunks cut inside image
# runs, and room on the device for a few sessions' caches only, so sessions move between tiers.
FAMILY_ENV = {"LLAVA_DEVICE_BUDGET_MB": "0.04", "LLAVA_STEP_TOKEN_BUDGET": "7"}


# How many family servers the run keeps at once: every one on the transformers engine (a few
# hundred MB each); one on vLLM, whose servers hold an engine core and its worker (about 2 GB).
FAMILY_SERVERS_KEPT = 1 if engine_under_test.ON_VLLM else None


@pytest.fixture(scope="session")
def family_server(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Callable[[str], tuple[TorchServe, Any]]]:
    """`family_server(profile)`: a server of that tiny family and its oracle, started on first
    use and shared by every test after (while FAMILY_SERVERS_KEPT allows); no server's logs may
    show a worker death once it stops."""
    servers: dict[str, tuple[ExitStack, tuple[TorchServe, Any]]] = {}

    def stop(profile: str) -> None:
        stack, (server, _) = servers.pop(profile)
        with stack:
            assert_no_worker_death(server)

    def serve(profile: str) -> tuple[TorchServe, Any]:
        if profile not in servers:
            engine_under_test.skip_unservable(profile)  # before stopping one that serves
            while FAMILY_SERVERS_KEPT is not None and len(servers) >= FAMILY_SERVERS_KEPT:
                stop(next(iter(servers)))
            stack = ExitStack()
            served = stack.enter_context(serving_profile(profile, tmp_path_factory, **FAMILY_ENV))
            servers[profile] = stack, served
        servers[profile] = servers.pop(profile)  # the most recently used goes last
        return servers[profile][1]

    yield serve
    deaths = []
    for profile in list(servers):  # each stops, whichever of them shows a death
        try:
            stop(profile)
        except AssertionError as death:
            deaths.append(str(death))
    assert not deaths, "\n".join(deaths)


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


@contextmanager
def served(store: Path, workdir: Path, **env: str) -> Iterator[TorchServe]:
    """A TorchServe of its own for a test module (its settings in `env`), stopped after."""
    with TorchServe(store, "llava", workdir=workdir, env=env) as ts:
        yield ts


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


@pytest.fixture(scope="session")
def ray_front(
    tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RayServe]:
    """One Ray Serve front with two CPU replicas for the whole run, on the same checkpoint."""
    if not in_private_network():
        pytest.skip("Ray runs only in a private network namespace: run `make test-ray` as root")
    front = RayServe(
        tiny_checkpoint,
        replicas=2,
        workdir=tmp_path_factory.mktemp("ray"),
        metrics_port=free_port(),
    )
    front.start()
    try:
        yield front
    finally:
        front.stop()


@contextmanager
def two_node_front(checkpoint: Path, workdir: Path) -> Iterator[tuple[RayCluster, RayServe]]:
    """Two `ray start` nodes of one CPU each, as two machines, with a replica on each; the
    head's proxy serves (both nodes share this machine's one loopback)."""
    if not in_private_network():
        pytest.skip("Ray runs only in a private network namespace: run `make test-ray` as root")
    with RayCluster(nodes=2, cpus_per_node=1, workdir=workdir / "cluster") as cluster:
        front = RayServe(
            checkpoint,
            replicas=2,
            workdir=workdir / "front",
            address=cluster.address,
            proxy_location="HeadOnly",
        )
        with front:
            yield cluster, front


@dataclass(frozen=True)
class FrontUnderTest:
    """A front the behaviour tests run against: the fixture that gives one instance of it (for
    the whole run), the fixture that gives the instances the local SageMaker runtime routes
    between (None: the one instance, which routes each session to its replica itself), and
    whether it serves SageMaker's WebSocket sessions."""

    fixture: str
    pair: str | None
    sockets: bool


# The fronts: every test that takes `front`, `socket_front` or the local runtime's instances
# runs against each of these, as every integration test runs on the engine under test; a new
# front joins them all by being added here.
FRONTS = {
    "torchserve": FrontUnderTest("server", pair="server_pair", sockets=False),
    "ray": FrontUnderTest("ray_front", pair=None, sockets=True),
}


@pytest.fixture(scope="module", params=list(FRONTS))
def front(request: pytest.FixtureRequest) -> Any:
    """Each front in turn, one instance of it."""
    return request.getfixturevalue(FRONTS[request.param].fixture)


@pytest.fixture(scope="module", params=[name for name, f in FRONTS.items() if f.sockets])
def socket_front(request: pytest.FixtureRequest) -> Any:
    """Each front that serves sessions over SageMaker's WebSocket, in turn."""
    return request.getfixturevalue(FRONTS[request.param].fixture)


@pytest.fixture(scope="module", params=list(FRONTS))
def instances(request: pytest.FixtureRequest) -> list[Any]:
    """Each front in turn, as the instances of an endpoint behind the local SageMaker runtime:
    two of a front the runtime's sticky routing must route between, or one that routes its
    sessions to its replicas itself."""
    front = FRONTS[request.param]
    if front.pair is None:
        return [request.getfixturevalue(front.fixture)]
    return list(request.getfixturevalue(front.pair))


@pytest.fixture(scope="session")
def server_pair(
    server: TorchServe, model_store: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[TorchServe]]:
    """The run's TorchServe and a second one beside it, as two instances of an endpoint (the
    local runtime's tests, the notebook's, prefix-aware routing's)."""
    with running_servers(model_store, tmp_path_factory, 1, "second") as [second]:
        yield [server, second]


@pytest.fixture()
def client() -> Iterator[httpx.Client]:
    """A plain HTTP client for a test's requests to its server."""
    with httpx.Client(timeout=120) as c:
        yield c


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Print what this pass proved on its engine: how many integration tests passed, failed
    and were skipped, and the skips grouped by reason (each says why that engine cannot run it)."""
    stats = terminalreporter.stats
    counts = {k: len(stats.get(k, [])) for k in ("passed", "failed", "error", "skipped")}
    terminalreporter.write_sep("=", f"integration tests on the {ENGINE} engine")
    terminalreporter.write_line(", ".join(f"{n} {k}" for k, n in counts.items()))
    reasons = Counter(
        str(r.longrepr[2] if isinstance(r.longrepr, tuple) else "skipped").removeprefix("Skipped: ")
        for r in stats.get("skipped", [])
    )
    for reason, n in reasons.most_common():
        terminalreporter.write_line(f"  skipped {n:3d}: {reason}")
