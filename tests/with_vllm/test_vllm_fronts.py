"""`engine: vllm` behind a real TorchServe: boto3 through the local runtime, and the fault plan:
the engine core killed or hung mid-stream and mid-open at 1 and 8 chats, a killed worker, and
none of them costs a finished turn.

The worker runs vLLM as it runs in production: its engine core in a process of its own. Answers
are compared with vLLM's own offline `generate` on the whole conversation (in this process).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM runs in its own environment: make test-vllm")

import httpx  # noqa: E402
import psutil  # noqa: E402
from conftest import KIT_ENV, Oracle, expected_text, until_engine_back  # noqa: E402
from helpers import ask, data_uri, open_session, post, wait_for  # noqa: E402

from llava.api.headers import SESSION_HEADER  # noqa: E402
from llava.fronts.torchserve.launcher import TorchServe  # noqa: E402
from llava.tools.archive import MODEL_CONFIG, build_archive  # noqa: E402
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


def engine_cores(server: TorchServe) -> list[psutil.Process]:
    """vLLM's engine cores running under the server's TorchServe workers."""
    cores = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if "model_service_worker" in cmdline and str(server.worker_port) in cmdline:
            children: list[psutil.Process] = []
            with contextlib.suppress(psutil.NoSuchProcess):
                children = proc.children(recursive=True)
            for child in children:
                with contextlib.suppress(psutil.NoSuchProcess):  # a killed core not reaped yet
                    if child.status() != psutil.STATUS_ZOMBIE and is_core(child):
                        cores.append(child)
    return cores


def tree(server: TorchServe) -> list[str]:
    """What runs under the server's workers (for a failure's message)."""
    out = []
    for proc in psutil.process_iter(["cmdline"]):
        if "model_service_worker" in " ".join(proc.info["cmdline"] or []):
            with contextlib.suppress(psutil.Error):
                out += [f"{c.pid} {c.name()} {c.status()}" for c in proc.children(recursive=True)]
    return out


def is_core(proc: psutil.Process) -> bool:
    """vLLM's engine core or its executor's worker (named so as they start)."""
    return proc.name().startswith("VLLM::")


def engine_core(server: TorchServe) -> psutil.Process:
    """Find vLLM's engine core: a child of the TorchServe worker."""
    cores = [core for core in engine_cores(server) if "EngineCore" in core.name()]
    assert cores, f"no engine core under a TorchServe worker: {tree(server)}"
    return cores[0]


FAULTS = {"killed": signal.SIGKILL, "hung": signal.SIGSTOP}  # hung: the watchdog kills it


@dataclass
class Chats:
    """Sessions with a finished first turn and an answer streaming each, and as many new
    sessions opening, when the fault struck."""

    pics: list[Any]
    sids: list[str]
    firsts: list[str]
    streams: list[Streaming]
    new_pics: list[Any]
    opened: list[httpx.Response]

    def check(self, client: httpx.Client, url: str, oracle: Oracle, first: httpx.Response) -> None:
        """Every session answers as vLLM's own generate at its last finished turn (`first`:
        the first session's answer, already asked), at least one answer was cut, and every
        session that opened answers as vLLM does on its picture; a refused open left none."""
        answers = [first.json()["text"]] + [
            ask(client, url, sid, QUESTIONS[1], max_new_tokens=TOKENS)["text"]
            for sid in self.sids[1:]
        ]
        cut = 0
        for pic, first_text, stream, answer in zip(
            self.pics, self.firsts, self.streams, answers, strict=True
        ):
            history = [(QUESTIONS[0], first_text), *stream.finished()]
            cut += not stream.finished()
            assert answer == expected(oracle, history, QUESTIONS[1], pic)
        assert cut, "every answer finished before the fault: nothing was cut"
        for pic, reply in zip(self.new_pics, self.opened, strict=True):
            if reply.status_code != 200:  # refused while the engine was down: nothing opened
                assert reply.status_code == 503, reply.text
                assert reply.json()["error"]["code"] == "engine_restarting"
                continue
            sid = reply.json()["session_id"]
            text = ask(client, url, sid, QUESTIONS[0], max_new_tokens=TOKENS)["text"]
            assert text == expected(oracle, [], QUESTIONS[0], pic)


def fault_mid_stream_and_mid_open(
    client: httpx.Client, url: str, chats: int, seed: int, fault: Callable[[], None]
) -> Chats:
    """Open `chats` sessions and answer their first question; then, while each streams a long
    answer and as many new sessions open with 1024x768 pictures, run `fault`; return when every
    stream and open has ended."""
    pics = [picture(seed + i) for i in range(chats)]
    new_pics = [picture(seed + 100 + i).resize((1024, 768)) for i in range(chats)]
    sids = [open_session(client, url, data_uri(pic)) for pic in pics]
    firsts = [ask(client, url, sid, QUESTIONS[0], max_new_tokens=TOKENS)["text"] for sid in sids]
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
        fault()  # mid-stream, and mid-open
        for stream in streams:
            stream.thread.join(180)
        opened = [future.result() for future in opens]
    return Chats(pics, sids, firsts, streams, new_pics, opened)


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
    limits = httpx.Limits(max_connections=4 * chats + 4)
    with httpx.Client(timeout=180, limits=limits) as client:
        cores: list[psutil.Process] = []

        def strike() -> None:  # the core as it is now (an earlier test's fault replaced it)
            cores.append(engine_core(server))
            os.kill(cores[0].pid, FAULTS[fault])

        done = fault_mid_stream_and_mid_open(client, url, chats, seed, strike)
        body = {"type": "query", "prompt": QUESTIONS[1], "max_new_tokens": TOKENS}
        first = until_engine_back(client, url, done.sids[0], body)
        assert first.status_code == 200, first.text
        assert not cores[0].is_running()
        done.check(client, url, oracle, first)


class CoreKiller:
    """Kill each vLLM engine core the server's workers start, until stopped: an engine that
    cannot start (as on a GPU that has gone bad)."""

    def __init__(self, server: TorchServe) -> None:
        self.server = server
        self.killed = 0
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="core-killer")

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join()

    def _run(self) -> None:
        while not self.stopped.wait(0.05):  # a core appears at any moment: look again
            for core in engine_cores(self.server):
                with contextlib.suppress(psutil.NoSuchProcess):
                    core.kill()
                    self.killed += 1


def ping(server: TorchServe) -> int:
    try:
        return httpx.get(server.url("/ping"), timeout=5).status_code
    except httpx.HTTPError:
        return 0


RECOVERY_S = 10  # how long a worker may fail to come back before /ping fails


@pytest.fixture(scope="module")
def failing_server(
    tmp_path_factory: pytest.TempPathFactory, checkpoint: Path
) -> Iterator[TorchServe]:
    """A server whose engine gives up after two tries at starting again, and whose /ping fails
    once its worker has not come back for RECOVERY_S (300 s in the shipped model-config.yaml)."""
    config = tmp_path_factory.mktemp("config") / "model-config.yaml"
    shipped = MODEL_CONFIG.read_text()
    assert "maxRetryTimeoutInSec: 300" in shipped
    config.write_text(
        shipped.replace("maxRetryTimeoutInSec: 300", f"maxRetryTimeoutInSec: {RECOVERY_S}")
    )
    store = tmp_path_factory.mktemp("store")
    build_archive(checkpoint, store, name="llava", config_file=config)
    env = {
        **KIT_ENV,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
        "LLAVA_ENGINE_RESTART_ATTEMPTS": "2",
    }
    with TorchServe(store, "llava", workdir=tmp_path_factory.mktemp("ts"), env=env) as ts:
        yield ts


@pytest.mark.parametrize("chats", [1, 8])
def test_an_engine_that_cannot_start_again_fails_ping_and_costs_no_finished_turn(
    failing_server: TorchServe, oracle: Oracle, chats: int
) -> None:
    """Every engine core killed as it starts, from mid-stream and mid-open at `chats` chats:
    each answer in flight is cut, the engine gives up after its tries, the worker exits and
    /ping fails (SageMaker would replace the instance) for as long as no core can start; once
    one can, /ping is healthy again and every session answers as vLLM's own generate does at
    its last finished turn, from its snapshot, as does every session that opened."""
    server = failing_server
    url = server.url("/predictions/llava")
    limits = httpx.Limits(max_connections=4 * chats + 4)
    with httpx.Client(timeout=180, limits=limits) as client:
        killer = CoreKiller(server)
        try:
            done = fault_mid_stream_and_mid_open(client, url, chats, 7000 + chats, killer.start)
            wait_for(lambda: ping(server) != 200, "/ping to fail", 180)
            assert ping(server) != 200  # still failing while no core can start
        finally:
            killer.stop()
        assert killer.killed >= 2, "the engine's tries to start again were not seen"
        wait_for(lambda: ping(server) == 200, "/ping to be healthy again", 300)
        body = {"type": "query", "prompt": QUESTIONS[1], "max_new_tokens": TOKENS}
        first = until_engine_back(client, url, done.sids[0], body)
        assert first.status_code == 200, first.text
        done.check(client, url, oracle, first)


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
