"""`engine: vllm` behind a real TorchServe: sessions over HTTP, the OpenAI endpoint with the
official SDK, and a killed engine core (kill -9) that costs no finished turn.

The worker runs vLLM as it runs in production: its engine core in a process of its own. Answers
are compared with vLLM's own offline `generate` on the whole conversation (in this process).
"""

from __future__ import annotations

import json
import os
import random
import signal
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM runs in its own environment: make test-vllm")

import httpx  # noqa: E402
import psutil  # noqa: E402
from conftest import KIT_ENV, Oracle, expected_text, kill_under_stream, until_engine_back  # noqa: E402
from helpers import ask, data_uri, open_session, post  # noqa: E402

from llava.core.paths import CHECKOUT  # noqa: E402
from llava.fronts.torchserve.launcher import TorchServe  # noqa: E402
from llava.tools.archive import build_archive  # noqa: E402
from llava.tools.tiny.scenes import draw_scene  # noqa: E402

SHAPES = CHECKOUT / "models" / "shapes"
TOKENS = 8
STEP_TIMEOUT_S = 8  # a step of the tiny model takes milliseconds here
QUESTIONS = ["What colour is the circle?", "And the other one?", "How many shapes are there?"]


@pytest.fixture(scope="module")
def oracle() -> Oracle:
    return Oracle(SHAPES)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TorchServe]:
    store = tmp_path_factory.mktemp("store")
    build_archive(SHAPES, store, name="llava")
    env = {
        **KIT_ENV,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1",  # the core in its own process
        "LLAVA_ENGINE_STEP_TIMEOUT_S": str(STEP_TIMEOUT_S),
    }
    with TorchServe(store, "llava", workdir=tmp_path_factory.mktemp("ts"), env=env) as ts:
        yield ts


def picture(seed: int) -> Any:
    return draw_scene(random.Random(seed), count=2).draw()


def expected(oracle: Oracle, history: list[tuple[str, str]], question: str, pic: Any) -> str:
    return expected_text(oracle, history, question, pic, TOKENS)


def engine_core(server: TorchServe) -> psutil.Process:
    """Find vLLM's engine core: a child of the TorchServe worker."""
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if "model_service_worker" in cmdline and str(server.worker_port) in cmdline:
            children = proc.children(recursive=True)
            cores = [c for c in children if "EngineCore" in c.name() or "spawn" in c.cmdline()[-1]]
            assert cores, [c.cmdline() for c in children]
            return cores[0]
    raise AssertionError("no TorchServe worker found")


def test_a_killed_engine_core_costs_no_finished_turn(server: TorchServe, oracle: Oracle) -> None:
    url = server.url("/predictions/llava")
    pic = picture(13)
    with httpx.Client(timeout=120) as client:
        sid = open_session(client, url, data_uri(pic))
        first = ask(client, url, sid, QUESTIONS[0], max_new_tokens=TOKENS)["text"]
        core = engine_core(server)
        lines = kill_under_stream(client, url, sid, core.pid)  # the core dies mid-answer
        assert lines and "error" in lines[-1], lines[-3:]
        assert lines[-1]["error"]["code"] == "engine_restarting"
        # Requests are refused with 503 and a Retry-After while the engine starts again.
        body = {"type": "query", "prompt": QUESTIONS[1], "max_new_tokens": TOKENS}
        r = until_engine_back(client, url, sid, body)
        assert r.status_code == 200, r.text
        # The session carried on from its last finished turn: the cut answer left no trace.
        assert r.json()["text"] == expected(oracle, [(QUESTIONS[0], first)], QUESTIONS[1], pic)
        assert not core.is_running()


def test_a_hung_engine_core_is_killed_and_costs_no_finished_turn(
    server: TorchServe, oracle: Oracle
) -> None:
    """SIGSTOP of vLLM's engine core mid-answer: the step waiting on it would wait for ever;
    the kit's watchdog kills the core after `engine_step_timeout_s`, and it starts again."""
    url = server.url("/predictions/llava")
    pic = picture(16)
    with httpx.Client(timeout=120) as client:
        sid = open_session(client, url, data_uri(pic))
        first = ask(client, url, sid, QUESTIONS[0], max_new_tokens=TOKENS)["text"]
        core = engine_core(server)
        lines = kill_under_stream(client, url, sid, core.pid, signal.SIGSTOP)
        assert lines and lines[-1].get("error", {}).get("code") == "engine_restarting", lines[-3:]
        body = {"type": "query", "prompt": QUESTIONS[1], "max_new_tokens": TOKENS}
        r = until_engine_back(client, url, sid, body)
        assert r.status_code == 200, r.text
        assert r.json()["text"] == expected(oracle, [(QUESTIONS[0], first)], QUESTIONS[1], pic)
        assert not core.is_running()


def test_boto3_through_the_local_runtime(server: TorchServe, oracle: Oracle, monkeypatch) -> None:
    """An unmodified boto3 `sagemaker-runtime` client, sticky sessions, on the vLLM engine."""
    import boto3

    from llava.fronts.local_runtime.server import LocalRuntime

    pic = picture(14)
    with LocalRuntime([server.url()], name="llava") as runtime:
        monkeypatch.setenv("AWS_ENDPOINT_URL_SAGEMAKER_RUNTIME", runtime.url)
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
        smr = boto3.client("sagemaker-runtime", region_name="us-east-1")

        def invoke(body: dict[str, Any], session: str) -> Any:
            return smr.invoke_endpoint(
                EndpointName="llava",
                Body=json.dumps(body),
                ContentType="application/json",
                SessionId=session,
            )

        opened = invoke({"type": "open_session", "image": data_uri(pic)}, "NEW_SESSION")
        sid = opened["NewSessionId"].split(";")[0]
        out = invoke({"type": "query", "prompt": QUESTIONS[0], "max_new_tokens": TOKENS}, sid)
        assert json.loads(out["Body"].read())["text"] == expected(oracle, [], QUESTIONS[0], pic)
        closed = invoke({"type": "close_session"}, sid)
        assert closed["ClosedSessionId"] == sid


def test_a_killed_worker_restores_its_sessions_from_snapshots(
    server: TorchServe, oracle: Oracle
) -> None:
    """kill -9 of the TorchServe worker (and so its engine): TorchServe starts a new one, which
    restores every session from its snapshot (conversation and pictures) onto a new engine."""
    url = server.url("/predictions/llava")
    pic = picture(15)
    with httpx.Client(timeout=120) as client:
        sid = open_session(client, url, data_uri(pic))
        first = ask(client, url, sid, QUESTIONS[0], max_new_tokens=TOKENS)["text"]
        before = server.worker()
        core = engine_core(server)
        left = [core, *core.children(recursive=True)]  # vLLM's core and its workers
        os.kill(before["pid"], signal.SIGKILL)
        server.wait_for_new_worker(before["pid"])
        _, alive = psutil.wait_procs(left, timeout=60)  # the kit's reaper kills them
        assert alive == [], "the dead worker's vLLM processes were left running"
        body = {"type": "query", "prompt": QUESTIONS[1], "max_new_tokens": TOKENS}
        r = post(client, url, body, sid)
        assert r.status_code == 200, r.text
        assert r.json()["text"] == expected(oracle, [(QUESTIONS[0], first)], QUESTIONS[1], pic)
