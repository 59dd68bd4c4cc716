"""The Ray Serve front with two CPU replicas: sessions spread and stay pinned, answers are
transformers' own, a killed replica loses no other replica's sessions and its own come back."""

from __future__ import annotations

import os
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from conftest import two_node_front
from engine_under_test import ON_VLLM, assert_reused, oracle
from helpers import (
    Reference,
    ask,
    data_uri,
    in_private_network,
    make_image,
    open_session,
    post,
    wait_for,
)
from prometheus_client.parser import text_string_to_metric_families

from llava.fronts.ray.launcher import RayServe
from llava.fronts.ray.package import write_package

pytestmark = pytest.mark.integration
DIMENSIONS = {"Tier", "Reason", "Store", "Stat"}
PROMPTS = ["What is in the picture?", "And what else?"]
TOKENS = 6


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    return oracle(tiny_checkpoint)


def rank(name: str) -> str:
    """A replica's rank from its name (`r1xab12cd34`): a replacement keeps it."""
    return name.split("x")[0]


def converse(url: str, seed: int, prompts: list[str]) -> tuple[str, list[dict[str, Any]]]:
    """Open a session on image `seed` and ask each prompt; return its id and the answers."""
    with httpx.Client(timeout=120) as client:
        sid = open_session(client, url, data_uri(make_image(seed)))
        return sid, [ask(client, url, sid, p, max_new_tokens=TOKENS) for p in prompts]


def test_sessions_spread_over_the_replicas_and_stay_on_theirs(
    ray_front: RayServe, reference: Reference
) -> None:
    url = ray_front.url("/invocations")
    # Opens go where the fewest bytes are, which depends on what earlier tests left open on
    # either replica: open six at once until both hold some of this test's sessions.
    runs: list[tuple[str, list[dict[str, Any]]]] = []
    with ThreadPoolExecutor(6) as pool:
        while {rank(sid) for sid, _ in runs} != {"r0", "r1"}:
            assert len(runs) < 24, f"24 opens all went to {rank(runs[0][0])}"
            seeds = range(len(runs), len(runs) + 6)
            runs += pool.map(lambda seed: converse(url, seed, PROMPTS), seeds)
    placed = {}
    for seed, (sid, answers) in enumerate(runs):
        replicas = {a["usage"]["replica"] for a in answers}
        assert replicas == {sid.split("-")[0]}, (sid, replicas)  # pinned where it was opened
        placed[sid] = rank(replicas.pop())
        expected = reference.answers(make_image(seed), PROMPTS, TOKENS)
        assert [a["text"] for a in answers] == expected
        assert_reused(answers[0]["usage"], answers[1]["usage"])
    assert set(placed.values()) == {"r0", "r1"}, placed


def test_a_burst_of_opens_and_questions_from_16_clients_gives_no_error(
    ray_front: RayServe,
) -> None:
    url = ray_front.url("/predictions/llava")

    def client(seed: int) -> list[int]:
        with httpx.Client(timeout=180) as http:
            sid = open_session(http, url, data_uri(make_image(100 + seed)))
            statuses = [
                post(http, url, {"type": "query", "prompt": p, "max_new_tokens": 4}, sid)
                for p in PROMPTS
            ]
            statuses.append(post(http, url, {"type": "close_session"}, sid))
            return [r.status_code for r in statuses]

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(client, range(16)))
    assert results == [[200, 200, 200]] * 16


def gauges(front: RayServe) -> dict[tuple[str, str], dict[tuple[str, str], float]]:
    """The kit's gauges on the cluster's Prometheus endpoint (`ray_llava_*`): by (name,
    replica), each dimension's value."""
    text = httpx.get(f"http://127.0.0.1:{front.metrics_port}/metrics", timeout=10).text
    out: dict[tuple[str, str], dict[tuple[str, str], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("ray_llava_") and "Replica" in sample.labels:
                key, value = next((k, v) for k, v in sample.labels.items() if k in DIMENSIONS)
                by = out.setdefault((sample.name[4:], sample.labels["Replica"]), {})
                by[(key, value)] = sample.value
    return out


def test_each_replica_publishes_the_kits_gauges_as_ray_metrics(ray_front: RayServe) -> None:
    """What the TorchServe worker publishes as its metrics, each replica publishes through
    Ray's (each node's Prometheus endpoint), tagged with its rank: an open session counts in
    its replica's sessions, with its bytes on the device."""
    sid, _ = converse(ray_front.url("/invocations"), 400, PROMPTS[:1])
    replica = rank(sid)
    deadline = time.monotonic() + 90  # Ray's agent exports what replicas set every few seconds
    while True:
        seen = gauges(ray_front)
        sessions = seen.get(("llava_sessions", replica), {})
        if sum(sessions.values()) >= 1:
            break
        assert time.monotonic() < deadline, f"no sessions published for {replica}: {seen}"
        time.sleep(1)
    assert set(sessions) == {("Tier", t) for t in ("device", "host", "features")}
    assert ("llava_snapshots", replica) in seen
    if ON_VLLM:  # vLLM's KV cache is its own: its figures instead of the session's bytes
        engine = seen[("llava_engine", replica)]
        assert ("Stat", "restarts") in engine and engine[("Stat", "restarts")] == 0
        assert len(engine) > 1, engine  # vLLM's own figures too
        return
    assert seen[("llava_session_device_bytes", replica)][("Tier", "device")] > 0
    alone = seen[("llava_decoded_alone", replica)]
    assert set(alone) == {("Reason", "room"), ("Reason", "failure")}


def test_a_killed_replica_loses_no_other_replicas_sessions_and_its_own_come_back(
    ray_front: RayServe, reference: Reference
) -> None:
    url = ray_front.url("/invocations")
    # Opens go where the fewest bytes are, which depends on what earlier tests left open (a
    # replica holding their larger pictures took 12 opens once before the other's turn came):
    # open until each replica holds one of this test's sessions.
    runs: list[tuple[str, list[dict[str, Any]]]] = []
    while {rank(sid) for sid, _ in runs} != {"r0", "r1"}:
        assert len(runs) < 40, f"40 opens all went to {runs[0][0]}'s replica"
        runs.append(converse(url, 200 + len(runs), PROMPTS[:1]))
    # Ray rewrites a worker's title with each call it runs, and a read of it midway can miss
    # it: poll (a CI run once found neither replica while both were serving).
    pids: list[int] = []

    def both_found() -> bool:
        pids[:] = ray_front.replica_pids()
        return len(pids) == 2

    wait_for(both_found, "both replicas' processes", 30)
    os.kill(pids[0], signal.SIGKILL)
    with httpx.Client(timeout=180) as client:
        after = [ask(client, url, sid, PROMPTS[1], max_new_tokens=TOKENS) for sid, _ in runs]
    # Every session answers its second question exactly as transformers does: those of the
    # surviving replica from their cache, those of the killed one restored from snapshots.
    for i, (sid, first) in enumerate(runs):
        history = [PROMPTS[0]]
        expected = reference.answers(make_image(200 + i), [*history, PROMPTS[1]], TOKENS)
        assert [first[0]["text"], after[i]["text"]] == expected
        assert rank(after[i]["usage"]["replica"]) == rank(sid)
    tiers: dict[str, set[str]] = {rank(sid): set() for sid, _ in runs}
    for (sid, _), answer in zip(runs, after, strict=True):
        tiers[rank(sid)].add(answer["usage"]["session_tier"])
    # One replica's sessions were rebuilt from their snapshots' features, the other's were kept.
    assert sorted(map(sorted, tiers.values())) == [["device"], ["features"]], tiers


def test_two_nodes_each_hold_a_replica_and_answer_their_own_sessions(
    tiny_checkpoint: Any, reference: Reference, tmp_path: Any
) -> None:
    with two_node_front(tiny_checkpoint, tmp_path) as (_, front):
        url = front.url("/invocations")
        with ThreadPoolExecutor(4) as pool:
            runs = list(pool.map(lambda seed: converse(url, 300 + seed, PROMPTS), range(4)))
    nodes = {}
    for seed, (sid, answers) in enumerate(runs):
        assert len({a["usage"]["node"] for a in answers}) == 1, answers  # never moved
        nodes[sid] = answers[0]["usage"]["node"]
        assert [a["text"] for a in answers] == reference.answers(
            make_image(300 + seed), PROMPTS, TOKENS
        )
    assert len(set(nodes.values())) == 2, nodes  # sessions on both nodes


def test_a_sagemaker_model_package_serves_as_the_ray_image_runs_it(
    tiny_checkpoint: Any, reference: Reference, tmp_path: Any
) -> None:
    # What docker/ray/serve runs: `serve-ray --config /opt/ml/model/config.yaml`.
    if not in_private_network():
        pytest.skip("Ray runs only in a private network namespace: run `make test-ray` as root")
    settings = {"default_max_new_tokens": 3}  # the package's settings reach the replicas
    package = write_package(tiny_checkpoint, tmp_path / "model", replicas=1, settings=settings)
    front = RayServe("unused", workdir=tmp_path / "front", config=package / "config.yaml")
    with front:
        url = front.url("/invocations")
        sid, answers = converse(url, 7, PROMPTS)
        with httpx.Client(timeout=120) as client:
            unbounded = ask(client, url, sid, "Tell me everything.")  # no max_new_tokens
    assert [a["text"] for a in answers] == reference.answers(make_image(7), PROMPTS, TOKENS)
    assert sid.startswith("r0x")
    assert unbounded["usage"]["generated_tokens"] <= 3


def test_a_port_taken_before_the_proxy_binds_it_is_picked_again(
    tiny_checkpoint: Any, tmp_path: Any
) -> None:
    """Ray's own processes take ports at random while it starts; one that takes the port picked
    for the proxy must not fail the start (a CI run lost a whole Ray pass to it)."""
    if not in_private_network():
        pytest.skip("Ray runs only in a private network namespace: run `make test-ray` as root")
    front = RayServe(tiny_checkpoint, workdir=tmp_path / "front")
    picked = front.port
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", picked))
        taken.listen()
        with front:
            assert front.port != picked
            assert httpx.get(front.url("/ping"), timeout=30).status_code == 200
    assert f"Failed to bind to address '127.0.0.1:{picked}'" in front.logs()
