"""The session affinity router's decisions, with Ray's own request and replica types.

Ray runs here only inside a private network namespace, but the router is plain logic over
`PendingRequest` and replicas' routing stats: these tests call it as Ray does, with stand-in
replicas that report stats (the end-to-end routing is in tests/integration/test_ray_front.py).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

pytest.importorskip("ray.serve", reason="the Ray front needs the ray extra")

from ray.serve._private.common import RequestMetadata  # noqa: E402
from ray.serve.request_router import PendingRequest  # noqa: E402

from llava.fronts.ray.ingress import route_of  # noqa: E402
from llava.fronts.ray.replica import holder_of, replica_name  # noqa: E402
from llava.fronts.ray.router import ORPHAN_WAIT_S, SessionAffinityRouter  # noqa: E402


@dataclass(frozen=True)
class Id:
    """What the router reads of a replica's id."""

    unique_id: str


@dataclass
class Replica:
    """What the router reads of a running replica."""

    replica_id: Id
    routing_stats: dict[str, Any] = field(default_factory=dict)


IDS = itertools.count()


def router(replicas: list[Replica]) -> SessionAffinityRouter:
    made = SessionAffinityRouter.__new__(SessionAffinityRouter)
    made._replicas = {r.replica_id: r for r in replicas}  # what Ray's update_replicas keeps
    made.initialize_state()
    return made


def request(route: str | None, age_s: float = 0.0) -> PendingRequest:
    async def make() -> PendingRequest:  # its future needs a running event loop
        return PendingRequest(
            args=[b"{}", {}],
            kwargs={"route": route},
            metadata=RequestMetadata(request_id="r", internal_request_id=str(next(IDS))),
            created_at=time.time() - age_s,
        )

    return asyncio.run(make())


def choose(chosen: SessionAffinityRouter, pending: PendingRequest) -> list[list[str]]:
    ranked = asyncio.run(chosen.choose_replicas(list(chosen.curr_replicas.values()), pending))
    return [[r.replica_id.unique_id for r in rank] for rank in ranked]


def replicas(*loads: tuple[int, int]) -> list[Replica]:
    return [
        Replica(Id(f"id{rank}"), {"rank": rank, "device_bytes": used, "sessions": count})
        for rank, (used, count) in enumerate(loads)
    ]


def sid(rank: int, unique: str) -> str:
    return replica_name(rank, unique) + "-" + "a" * 40


def test_a_session_goes_to_the_replica_its_id_names_with_or_without_stats() -> None:
    chosen = router(replicas((10, 1), (0, 0)))
    assert choose(chosen, request(sid(0, "id0"))) == [["id0"]]
    assert choose(chosen, request(sid(1, "id1"))) == [["id1"]]
    for replica in chosen.curr_replicas.values():
        replica.routing_stats = {}  # Ray hands a router its replicas' stats late
    assert choose(chosen, request(sid(1, "id1"))) == [["id1"]]


def test_new_sessions_go_where_the_fewest_bytes_are_not_the_fewest_sessions() -> None:
    chosen = router(replicas((900, 1), (100, 5)))  # one long conversation against five short
    assert choose(chosen, request(None))[0] == ["id1"]


def test_a_burst_of_opens_spreads_before_the_stats_catch_up() -> None:
    chosen = router(replicas((0, 0), (0, 0)))
    firsts = []
    for _ in range(4):
        pending = request(None)
        first = choose(chosen, pending)[0][0]
        chosen.on_request_routed(pending, Id(first), None)  # type: ignore[arg-type]
        firsts.append(first)
    assert sorted(firsts) == ["id0", "id0", "id1", "id1"]


def test_opens_chosen_at_once_spread_before_any_is_sent() -> None:
    # Ray's routing tasks choose concurrently: each waits on a probe before sending.
    chosen = router(replicas((0, 0), (0, 0)))
    pending = [request(None) for _ in range(4)]
    firsts = [choose(chosen, p)[0][0] for p in pending]
    assert sorted(firsts) == ["id0", "id0", "id1", "id1"]
    again = choose(chosen, pending[0])[0][0]  # a retry of one is not counted twice
    assert again == firsts[0]
    chosen.on_request_routed(pending[0], Id("id1"), None)  # type: ignore[arg-type]
    assert choose(chosen, request(None))[0][0] == "id0"  # it went to id1 after all


def test_new_stats_replace_the_opens_counted_before_them() -> None:
    chosen = router(replicas((0, 0), (0, 0)))
    for _ in range(3):
        choose(chosen, request(None))
    reported = Replica(Id("id0"), {"rank": 0, "device_bytes": 400, "sessions": 2})
    chosen._replicas[reported.replica_id] = reported  # id0 reports its two sessions
    assert chosen._load(reported) == (400, 2)


def test_on_vllm_with_no_device_bytes_new_sessions_go_where_the_fewest_sessions_are() -> None:
    # vLLM's sessions hold no device bytes of their own: every replica reports 0
    chosen = router(replicas((0, 5), (0, 1), (0, 3)))
    assert choose(chosen, request(None))[0] == ["id1"]
    chosen = router(replicas((0, 3), (0, 3)))
    firsts = [choose(chosen, request(None))[0][0] for _ in range(4)]
    assert sorted(firsts) == ["id0", "id0", "id1", "id1"]


def test_a_dead_replicas_session_waits_for_its_replacement_then_goes_anywhere() -> None:
    chosen = router(replicas((0, 0)))  # rank 1 is gone
    orphan = sid(1, "gone")
    waiting = request(orphan)
    assert choose(chosen, waiting) == []  # Ray backs off and asks again
    assert waiting.routing_context.should_backoff
    assert choose(chosen, request(orphan, age_s=ORPHAN_WAIT_S + 1)) == [["id0"]]
    replacement = Replica(Id("id9"), {"rank": 1, "device_bytes": 0, "sessions": 0})
    chosen._replicas[replacement.replica_id] = replacement
    assert choose(chosen, request(orphan)) == [["id9"]]  # the replacement took rank 1


def test_ids_without_a_rank_and_unparsable_bodies_route_as_new() -> None:
    chosen = router(replicas((5, 1), (1, 1)))
    assert choose(chosen, request("0" * 40))[0] == ["id1"]  # an id issued by TorchServe
    assert holder_of("r12xab3") == (12, "ab3") and holder_of("r1") is None
    assert holder_of("x1") is None and holder_of(None) is None
    assert route_of(b"not json", {"Content-Type": "application/json"}) is None
    assert route_of(b'{"session_id": "r1-x"}', {"Content-Type": "application/json"}) == "r1-x"
    header = {"X-Amzn-SageMaker-Session-Id": "r0-y"}
    assert route_of(b"", header) == "r0-y"
    assert route_of(b"{}", {"x-amzn-sagemaker-session-id": "NEW_SESSION"}) is None


def test_the_model_package_is_a_serve_config_ray_accepts(tmp_path: Any) -> None:
    import yaml
    from ray.serve.schema import ServeDeploySchema

    from llava.fronts.ray.package import read_package, write_package

    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    package = write_package(checkpoint, tmp_path / "model", replicas=2)
    config = yaml.safe_load((package / "config.yaml").read_text())
    app = ServeDeploySchema.model_validate(config).applications[0]  # Ray's own schema
    assert app.import_path == "deployment:build" and app.route_prefix == "/"
    assert "from llava.fronts.ray.app import build" in (package / "deployment.py").read_text()
    assert (package / "weights" / "config.json").is_file()
    assert (package / "code" / "requirements.txt").is_file()
    args = read_package(package / "config.yaml")
    assert args["model_dir"] == str(package / "weights") and args["replicas"] == 2


@pytest.mark.parametrize(
    ("gpus", "per_replica", "replicas"),
    [(0, 1, 1), (1, 1, 1), (8, 1, 8), (8, 2, 4), (8, 4, 2), (2, 4, 1)],
)
def test_one_replica_per_model_copy(gpus: float, per_replica: int, replicas: int) -> None:
    """With vLLM's tensor parallelism a replica's model spans `per_replica` GPUs."""
    from llava.fronts.ray.app import default_replicas

    assert default_replicas(gpus, per_replica) == replicas


def test_a_replica_fails_rays_health_check_once_its_engine_failed_for_good() -> None:
    """Ray then replaces it (on vLLM: an engine core that did not start again)."""
    from types import SimpleNamespace

    from llava.fronts.ray.replica import LlavaReplica

    replica = LlavaReplica.__new__(LlavaReplica)
    engine = SimpleNamespace(failure=None)
    replica.name, replica.loop = "r0xabc", SimpleNamespace(alive=True)
    replica.instance = SimpleNamespace(service=SimpleNamespace(engine=engine))  # type: ignore[assignment]
    replica.check_health()  # healthy
    engine.failure = "vLLM's engine did not start again in 5 tries (RuntimeError: no device)"
    with pytest.raises(RuntimeError, match="r0xabc: vLLM's engine did not start again"):
        replica.check_health()
    engine.failure, replica.loop.alive = None, False
    with pytest.raises(RuntimeError, match="step loop is not running"):
        replica.check_health()
