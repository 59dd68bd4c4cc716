"""`engine: vllm` behind a real TorchServe: boto3 through the local runtime, and the fault plan:
the engine core killed or hung mid-stream and mid-open at 1 and 8 chats, a killed worker, and
none of them costs a finished turn.

The worker runs vLLM as it runs in production: its engine core in a process of its own. Answers
are compared with vLLM's own offline `generate` on the whole conversation (in this process).
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM runs in its own environment: make test-vllm")

import httpx  # noqa: E402
import psutil  # noqa: E402
from conftest import KIT_ENV, Oracle, expected_text, until_engine_back  # noqa: E402
from helpers import ask, data_uri, open_session, post  # noqa: E402

from llava.api.headers import SESSION_HEADER  # noqa: E402
from llava.fronts.torchserve.launcher import TorchServe  # noqa: E402
from llava.tools.archive import build_archive  # noqa: E402
from llava.tools.tiny.scenes import draw_scene  # noqa: E402

TOKENS = 8
STEP_TIMEOUT_S = 8  # a step of the tiny model takes milliseconds here
QUESTIONS = ["What colour is the circle?", "And the other one?", "How many shapes are there?"]


@pytest.fixture(scope="module")
def checkpoint(built: Any) -> Path:
    """A random model: its answers run to their length limit, so a fault finds them streaming."""
    return Path(built("tiny-vllm"))


@pytest.fixture(scope="module")
def oracle(checkpoint: Path) -> Oracle:
    return Oracle(checkpoint)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory, checkpoint: Path) -> Path:
    """TorchServe's model store: the model's folder (no archive), read by every worker start."""
    store = tmp_path_factory.mktemp("store")
    build_archive(checkpoint, store, name="llava")
    return store


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, store: Path) -> Iterator[TorchServe]:
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


FAULTS = {"killed": signal.SIGKILL, "hung": signal.SIGSTOP}  # hung: the watchdog kills it


@pytest.mark.parametrize("chats", [1, 8])
@pytest.mark.parametrize("fault", list(FAULTS))
def test_the_engine_core_killed_or_hung_costs_no_finished_turn(
    server: TorchServe, oracle: Oracle, fault: str, chats: int
) -> None:
    """vLLM's engine core killed (SIGKILL) or hung (SIGSTOP) while `chats` answers stream and as
    many sessions open with new pictures: each answer in flight ends with `engine_restarting`,
    each open is opened or refused (never half-open), requests get 503 with a Retry-After until
    the engine is back, and then every session answers as vLLM's own generate does at its last
    finished turn, as does every session that opened."""
    url = server.url("/predictions/llava")
    seed = 1000 * chats + (0 if fault == "killed" else 500)
    pics = [picture(seed + i) for i in range(chats)]
    new_pics = [picture(seed + 100 + i).resize((1024, 768)) for i in range(chats)]
    limits = httpx.Limits(max_connections=4 * chats + 4)
    with httpx.Client(timeout=180, limits=limits) as client:
        sids = [open_session(client, url, data_uri(pic)) for pic in pics]
        firsts = [
            ask(client, url, sid, QUESTIONS[0], max_new_tokens=TOKENS)["text"] for sid in sids
        ]
        core = engine_core(server)
        streams = [Streaming(client, url, sid) for sid in sids]
        for stream in streams:
            assert stream.begun.wait(60), "an answer did not begin"
        with ThreadPoolExecutor(chats) as pool:
            sent = threading.Semaphore(0)

            def opening(pic: Any) -> httpx.Response:
                body = {"type": "open_session", "image": data_uri(pic)}
                hooks = {"request": [lambda request: sent.release()]}
                with httpx.Client(timeout=180, event_hooks=hooks) as own:
                    return own.post(url, json=body)

            opens = [pool.submit(opening, pic) for pic in new_pics]
            for _ in new_pics:
                assert sent.acquire(timeout=60)
            os.kill(core.pid, FAULTS[fault])  # mid-stream, and mid-open
            for stream in streams:
                stream.thread.join(180)
            opened = [future.result() for future in opens]
        body = {"type": "query", "prompt": QUESTIONS[1], "max_new_tokens": TOKENS}
        r = until_engine_back(client, url, sids[0], body)
        assert r.status_code == 200, r.text
        assert not core.is_running()
        answers = [r.json()["text"]] + [
            ask(client, url, sid, QUESTIONS[1], max_new_tokens=TOKENS)["text"] for sid in sids[1:]
        ]
        cut = 0
        for pic, first, stream, answer in zip(pics, firsts, streams, answers, strict=True):
            history = [(QUESTIONS[0], first), *stream.finished()]
            cut += not stream.finished()
            assert answer == expected(oracle, history, QUESTIONS[1], pic)
        assert cut, "every answer finished before the fault: nothing was cut"
        for pic, reply in zip(new_pics, opened, strict=True):
            if reply.status_code != 200:  # refused while the engine was down: nothing opened
                assert reply.status_code == 503, reply.text
                assert reply.json()["error"]["code"] == "engine_restarting"
                continue
            sid = reply.json()["session_id"]
            text = ask(client, url, sid, QUESTIONS[0], max_new_tokens=TOKENS)["text"]
            assert text == expected(oracle, [], QUESTIONS[0], pic)


class Streaming:
    """A long answer streaming on a thread: its JSON lines, and when the first came."""

    QUESTION = "Tell me more."

    def __init__(self, client: httpx.Client, url: str, sid: str) -> None:
        self.lines: list[dict[str, Any]] = []
        self.begun = threading.Event()
        body = {"type": "query", "prompt": self.QUESTION, "max_new_tokens": 900, "stream": True}
        self.thread = threading.Thread(target=self._read, args=(client, url, sid, body))
        self.thread.start()

    def _read(self, client: httpx.Client, url: str, sid: str, body: dict[str, Any]) -> None:
        with client.stream("POST", url, json=body, headers={SESSION_HEADER: sid}) as r:
            for line in r.iter_lines():
                if line:
                    self.lines.append(json.loads(line))
                    self.begun.set()
        self.begun.set()

    def finished(self) -> list[tuple[str, str]]:
        """The exchange this answer added to its session: none if the fault cut it (it ended
        with `engine_restarting`), else its question and text."""
        last = self.lines[-1] if self.lines else {}
        if "error" in last:
            assert last["error"]["code"] == "engine_restarting", self.lines[-3:]
            return []
        assert last.get("finish_reason"), self.lines[-3:]
        return [(self.QUESTION, "".join(line.get("text", "") for line in self.lines))]


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
