"""`engine: vllm` behind the Ray Serve front: its engine core killed under a stream costs no
finished turn. (Sessions on two vLLM replicas, through both APIs: the integration suite's vLLM
pass, tests/integration/test_sessions_api.py and test_openai_api.py.)

Ray binds the machine's own address: `make test` runs this in a private network namespace."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator

import pytest

pytest.importorskip("vllm", reason="vLLM runs in its own environment: make test-vllm")

import httpx  # noqa: E402
import psutil  # noqa: E402
from conftest import KIT_ENV, Oracle, expected_text, kill_under_stream, until_engine_back  # noqa: E402
from helpers import ask, data_uri, in_private_network, open_session  # noqa: E402

from llava.core.paths import CHECKOUT  # noqa: E402
from llava.fronts.ray.launcher import RayServe  # noqa: E402
from llava.tools.tiny.scenes import draw_scene  # noqa: E402

SHAPES = CHECKOUT / "models" / "shapes"
TOKENS = 8
QUESTIONS = ["What colour is the circle?", "And the other one?"]


@pytest.fixture(scope="module")
def own_process_front(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayServe]:
    """One replica whose vLLM engine core runs in a process of its own, as in production."""
    if not in_private_network():
        pytest.skip("Ray runs only in a private network namespace: run `make test` as root")
    env = {**KIT_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    with RayServe(SHAPES, replicas=1, workdir=tmp_path_factory.mktemp("ray1"), env=env) as ray:
        yield ray


def engine_core_of(ray: RayServe) -> psutil.Process:
    """vLLM's engine core: the live process under the replica that vLLM titled EngineCore."""
    seen, cores = [], []
    for pid in ray.replica_pids():
        for child in psutil.Process(pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):  # one that ended while listed
                title = f"{child.name()} {' '.join(child.cmdline())[:80]}"
                seen.append(f"{child.pid} {child.status()} {title}")
                if "EngineCore" in title and child.status() != psutil.STATUS_ZOMBIE:
                    cores.append(child)
    assert len(cores) == 1, f"not one engine core under the replica: {seen}"
    return cores[0]


def test_a_killed_engine_core_under_ray_costs_no_finished_turn(own_process_front: RayServe) -> None:
    oracle = Oracle(SHAPES)
    url = own_process_front.url("/predictions/llava")
    pic = draw_scene(random.Random(30), count=2).draw()
    with httpx.Client(timeout=120) as client:
        sid = open_session(client, url, data_uri(pic))
        first = ask(client, url, sid, QUESTIONS[0], max_new_tokens=TOKENS)["text"]
        core = engine_core_of(own_process_front)
        lines = kill_under_stream(client, url, sid, core.pid)  # the core dies mid-answer
        assert lines[-1].get("error", {}).get("code") == "engine_restarting", lines[-3:]
        body = {"type": "query", "prompt": QUESTIONS[1], "max_new_tokens": TOKENS}
        r = until_engine_back(client, url, sid, body)
        assert r.status_code == 200, r.text
        want = expected_text(oracle, [(QUESTIONS[0], first)], QUESTIONS[1], pic, TOKENS)
        assert r.json()["text"] == want
