"""The TorchServe adapter over a fake context and a SessionService on a fake engine."""

from __future__ import annotations

import gc
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from llava.api.headers import (
    JSON_CONTENT_TYPE,
    NEW_SESSION_HEADER,
    SESSION_HEADER,
    STREAM_CONTENT_TYPE,
)
from llava.api.replies import Reply
from llava.core.errors import ImageError
from llava.core.params import GenerationParams
from llava.fronts.assembly import freeze_startup_objects
from llava.fronts.torchserve.handler import EARLY_HEAD_BYTES, SessionHandler
from llava.server.service import SessionService
from llava.sessions.store import SessionStore

DATA_IMAGE = "data:image/png;base64,AAAA"
HTTPS_IMAGE = "https://images.example.com/cat.png"


# -- fakes ---------------------------------------------------------------------------------


class FakeContext:
    """Mimics the parts of ts.context.Context the handler uses."""

    def __init__(self, request_ids: list[str], headers: list[dict[str, str]] | None = None) -> None:
        self.request_ids: dict[int, str] = dict(enumerate(request_ids))
        self._headers = headers or [{} for _ in request_ids]
        self.statuses: dict[int, tuple[int, str]] = {}
        self.content_types: dict[int, str] = {}
        self.headers: dict[int, dict[str, str]] = {}
        self.stopping_criteria: Any = None

    def get_all_request_header(self, idx: int) -> dict[str, str]:
        return self._headers[idx]

    def set_response_status(self, code: int = 200, phrase: str = "", idx: int = 0) -> None:
        self.statuses[idx] = (code, phrase)

    def set_response_content_type(self, idx: int, value: str) -> None:
        self.content_types[idx] = value

    def set_response_header(self, idx: int, key: str, value: str) -> None:
        self.headers.setdefault(idx, {})[key] = value


class FakeImages:
    def __init__(self) -> None:
        self.gate = threading.Event()

    @staticmethod
    def decoder(data: Any) -> Any:  # `read` returns the image itself
        return data

    def read(self, ref: str) -> str:
        if "bad" in ref:
            raise ImageError("cannot decode image", field="image")
        if ref.startswith("https://"):
            self.gate.wait(10)
        return ref


@dataclass(eq=False)
class FakeState:
    image: Any
    nbytes: int = 64


@dataclass(eq=False)
class FakeTurn:
    words: list[str]
    generated: list[str] = field(default_factory=list)
    text: str = ""
    delta: str = ""
    done: bool = False
    finish_reason: str | None = None

    def usage(self) -> dict[str, Any]:
        return {"generated_tokens": len(self.generated)}


class FakeEngine:
    """Each turn yields the prompt's words, one per step."""

    def image_preparer(self) -> Any:
        return lambda image, earlier: image

    def earlier_images(self, state: Any) -> list[Any]:
        return []

    def new_session(self, image: Any, system_prompt: str | None = None) -> FakeState:
        return FakeState(image)

    def start_open(self, state: Any, answer_follows: bool = False) -> FakeTurn:
        turn = FakeTurn([])
        turn.done = True  # nothing to compute
        return turn

    @staticmethod
    def out_of_memory(exc: BaseException) -> bool:
        return False

    def free_memory(self) -> None:
        pass

    def start_turn(
        self,
        state: Any,
        prompt: str,
        params: GenerationParams,
        *,
        history: bool = True,
        image: Any = None,
        conversation: Any = None,
    ) -> FakeTurn:
        return FakeTurn(prompt.split())

    def step(self, turns: list[FakeTurn]) -> dict[int, BaseException]:
        errors: dict[int, BaseException] = {}
        for i, turn in enumerate(turns):
            if turn.done:
                continue
            word = turn.words[len(turn.generated)]
            if word == "boom":
                errors[i] = RuntimeError("the engine failed mid-answer")
                continue
            turn.delta = word if not turn.generated else " " + word
            turn.generated.append(word)
            turn.text += turn.delta
            if len(turn.generated) == len(turn.words):
                turn.done, turn.finish_reason = True, "stop"
        return errors

    def finish_turn(self, turn: FakeTurn) -> None:
        pass

    def abort_turn(self, turn: FakeTurn) -> None:
        pass

    def release(self, state: Any) -> None:
        pass


class ExplodingService:
    def step(self, batch: Any) -> Any:
        raise RuntimeError("bug above the per-request guards")


# -- fixtures and helpers ------------------------------------------------------------------


@pytest.fixture
def images() -> Iterator[FakeImages]:
    source = FakeImages()
    yield source
    source.gate.set()


@pytest.fixture
def handler(images: FakeImages) -> Iterator[SessionHandler]:
    engine = FakeEngine()
    store = SessionStore(ttl_s=60, max_sessions=2, release=lambda s, r: engine.release(s.state))
    service = SessionService(engine, store, images, fetch_threads=1)
    h = SessionHandler()
    h.service = service
    yield h
    images.gate.set()
    service.close()


def body(kind: str, **fields: Any) -> bytes:
    return json.dumps({"type": kind, **fields}).encode()


def call(
    handler: SessionHandler, rows: list[tuple[str, Any, dict[str, str]]], key: str = "body"
) -> tuple[list[Any], FakeContext]:
    """Run one handle() step; rows are (request id, body, headers)."""
    context = FakeContext([rid for rid, _, _ in rows], [h for _, _, h in rows])
    data = [{key: b} for _, b, _ in rows]
    outputs = handler.handle(data, context)
    assert len(outputs) == len(data)
    assert len(context.stopping_criteria) == len(data)
    return outputs, context


def handle_all(
    handler: SessionHandler, ids: list[str], data: list[Any], headers: list[dict[str, str]]
) -> tuple[list[Any], FakeContext]:
    """Re-send withheld requests, as TorchServe's frontend does, until each has its reply;
    return the outputs and one context holding every reply by the request's first index."""
    merged = FakeContext(ids, headers)
    outputs: list[Any] = [None] * len(ids)
    criteria: list[Any] = [None] * len(ids)
    waiting = list(range(len(ids)))
    for _ in range(1000):  # each idle step waits for the image threads: a few seconds at most
        if not waiting:
            break
        context = FakeContext([ids[i] for i in waiting], [headers[i] for i in waiting])
        step_outputs = handler.handle([data[i] for i in waiting], context)
        for j, i in enumerate(list(waiting)):
            if j not in context.statuses:
                continue  # withheld: sent again next step
            merged.statuses[i] = context.statuses[j]
            merged.content_types[i] = context.content_types[j]
            if j in context.headers:
                merged.headers[i] = context.headers[j]
            outputs[i], criteria[i] = step_outputs[j], context.stopping_criteria[j]
            waiting.remove(i)
    assert not waiting, f"requests {waiting} were never answered"
    merged.stopping_criteria = criteria
    return outputs, merged


def call_all(
    handler: SessionHandler, rows: list[tuple[str, Any, dict[str, str]]], key: str = "body"
) -> tuple[list[Any], FakeContext]:
    """Run handle() steps until every row has its reply (images load on threads)."""
    ids, headers = [rid for rid, _, _ in rows], [h for _, _, h in rows]
    return handle_all(handler, ids, [{key: b} for _, b, _ in rows], headers)


def stops(context: FakeContext) -> list[bool | None]:
    return [criterion(b"anything") for criterion in context.stopping_criteria]


def open_session(handler: SessionHandler) -> str:
    outputs, _ = call_all(handler, [("open", body("open_session", image=DATA_IMAGE), {})])
    return json.loads(outputs[0])["session_id"]


# -- tests ---------------------------------------------------------------------------------


def test_open_sets_status_content_type_headers_and_whole_response(handler: SessionHandler) -> None:
    outputs, context = call_all(handler, [("r0", body("open_session", image=DATA_IMAGE), {})])
    reply = json.loads(outputs[0])
    assert context.statuses == {0: (200, "OK")}
    assert context.content_types == {0: JSON_CONTENT_TYPE}
    assert context.headers[0][NEW_SESSION_HEADER].startswith(reply["session_id"] + "; Expires=")
    assert context.headers[0][SESSION_HEADER] == context.headers[0][NEW_SESSION_HEADER]
    assert stops(context) == [None]
    assert context.request_ids == {0: "r0"}


def test_withheld_request_is_removed_from_request_ids_with_a_placeholder(
    handler: SessionHandler,
) -> None:
    sid = open_session(handler)
    rows = [
        ("q", body("query", prompt="a b c"), {SESSION_HEADER: sid}),
        ("bad", b"{oops", {}),
    ]
    outputs, context = call(handler, rows)
    assert context.request_ids == {1: "bad"}
    assert outputs[0] == b""
    assert 0 not in context.statuses and 0 not in context.content_types and 0 not in context.headers
    assert context.statuses[1] == (400, "Bad Request")
    assert json.loads(outputs[1])["error"]["code"] == "invalid_request"
    assert stops(context) == [None, None]


def test_pending_open_is_withheld_then_answered(
    handler: SessionHandler, images: FakeImages
) -> None:
    outputs, context = call(handler, [("r0", body("open_session", image=HTTPS_IMAGE), {})])
    assert outputs == [b""]
    assert context.request_ids == {}
    images.gate.set()
    for _ in range(100):
        outputs, context = call(handler, [("r0", {}, {})])
        if context.request_ids:
            break
    assert context.request_ids == {0: "r0"}
    assert context.statuses == {0: (200, "OK")}
    assert "session_id" in json.loads(outputs[0])


def test_stream_chunks_stop_false_then_true(handler: SessionHandler) -> None:
    sid = open_session(handler)
    headers = {SESSION_HEADER.lower(): sid}
    first, ctx1 = call(handler, [("s", body("query", prompt="a b", stream=True), headers)])
    assert stops(ctx1) == [False]
    assert ctx1.content_types == {0: STREAM_CONTENT_TYPE}
    assert ctx1.statuses == {0: (200, "OK")}
    assert json.loads(first[0]) == {"text": "a"}
    last, ctx2 = call(handler, [("s", {}, headers)])
    assert stops(ctx2) == [True]
    assert [json.loads(line) for line in last[0].splitlines()][0] == {"text": " b"}


def test_stopping_criteria_never_raise(handler: SessionHandler) -> None:
    sid = open_session(handler)
    rows = [
        ("s", body("query", prompt="a b c", stream=True), {SESSION_HEADER: sid}),
        ("o", body("open_session", image=DATA_IMAGE), {}),
        ("x", b"[]", {}),
    ]
    _, context = call(handler, rows)
    for criterion in context.stopping_criteria:
        for output in (None, b"", b"x", "text", {"a": 1}, object(), 0):
            assert criterion(output) in (None, False, True)
    assert stops(context) == [False, None, None]


def test_statuses_and_headers_are_set_per_index(handler: SessionHandler) -> None:
    rows = [  # two session slots: the broken image's is freed when its load fails
        ("bad-close", body("close_session"), {SESSION_HEADER: "unknown1"}),
        ("bad-image", body("open_session", image="bad"), {}),
        ("ok", body("open_session", image=DATA_IMAGE), {}),
        ("full", body("open_session", image=DATA_IMAGE), {}),
    ]
    outputs, context = call_all(handler, rows)
    assert context.statuses == {
        0: (400, "Bad Request"),
        1: (400, "Bad Request"),
        2: (200, "OK"),
        3: (429, "Too Many Requests"),
    }
    assert set(context.headers) == {2, 3}
    assert set(context.headers[2]) == {NEW_SESSION_HEADER, SESSION_HEADER}
    assert context.headers[3] == {"Retry-After": "30"}
    errors = [json.loads(outputs[i])["error"]["code"] for i in (0, 1, 3)]
    assert errors == ["session_not_found", "invalid_image", "capacity_exceeded"]
    assert context.content_types == dict.fromkeys(range(4), JSON_CONTENT_TYPE)
    assert stops(context) == [None] * 4


@pytest.mark.parametrize("key", ["body", "data"])
def test_rows_with_body_or_data_keys_are_read(handler: SessionHandler, key: str) -> None:
    outputs, context = call_all(
        handler, [("r", body("open_session", image=DATA_IMAGE), {})], key=key
    )
    assert context.statuses[0][0] == 200
    assert "session_id" in json.loads(outputs[0])


def test_decoded_dict_body_and_raw_row_are_read(handler: SessionHandler) -> None:
    data = [
        {"body": {"type": "open_session", "image": DATA_IMAGE}},
        body("open_session", image=DATA_IMAGE),
    ]
    outputs, context = handle_all(handler, ["d", "raw"], data, [{}, {}])
    assert len(outputs) == 2
    assert context.statuses == {0: (200, "OK"), 1: (200, "OK")}


def test_body_key_wins_over_data_key(handler: SessionHandler) -> None:
    data = [{"body": body("open_session", image=DATA_IMAGE), "data": b"{garbage"}]
    outputs, context = handle_all(handler, ["r"], data, [{}])
    assert context.statuses[0][0] == 200
    assert "session_id" in json.loads(outputs[0])


def test_service_step_raising_answers_each_request_with_500(handler: SessionHandler) -> None:
    handler.service = ExplodingService()  # type: ignore[assignment]
    rows = [("a", body("open_session", image=DATA_IMAGE), {}), ("b", b"{}", {}), ("c", {}, {})]
    outputs, context = call(handler, rows)
    assert context.statuses == {i: (500, "Internal Server Error") for i in range(3)}
    for output in outputs:
        error = json.loads(output)["error"]
        assert error["code"] == "internal_error"
        assert "bug above" not in output.decode()
    assert stops(context) == [None, None, None]
    assert context.request_ids == {0: "a", 1: "b", 2: "c"}


def test_uninitialized_handler_answers_500_and_does_not_raise() -> None:
    context = FakeContext(["a", "b"])
    outputs = SessionHandler().handle([{"body": b"{}"}, {"body": b"{}"}], context)
    assert len(outputs) == 2
    assert context.statuses == {
        0: (500, "Internal Server Error"),
        1: (500, "Internal Server Error"),
    }
    assert [c(None) for c in context.stopping_criteria] == [None, None]


def test_empty_batch_sets_empty_criteria(handler: SessionHandler) -> None:
    context = FakeContext([])
    assert handler.handle([], context) == []
    assert context.stopping_criteria == []


def whole_answer_steps(
    handler: SessionHandler, sid: str, request: bytes
) -> list[tuple[bytes, FakeContext]]:
    """Every step of a whole answer, its body re-sent as TorchServe does: each step until
    the request has had a reply, none after."""
    steps: list[tuple[bytes, FakeContext]] = []
    replied = False
    while not steps or not steps[-1][1].request_ids or stops(steps[-1][1]) == [False]:
        outputs, context = call(handler, [("w", {} if replied else request, {SESSION_HEADER: sid})])
        replied = replied or bool(context.request_ids)
        steps.append((outputs[0], context))
    return steps


def test_a_large_whole_answer_sends_its_head_with_its_first_token(handler: SessionHandler) -> None:
    sid = open_session(handler)
    small = body("query", prompt="a b c")
    large = small + b" " * EARLY_HEAD_BYTES  # JSON's whitespace: a picture's bytes, say
    [(answer, kept)] = whole_answer_steps(handler, sid, small)[-1:]
    assert stops(kept) == [None] and kept.statuses == {0: (200, "OK")}
    head, *middle, last = whole_answer_steps(handler, sid, large)
    assert head[0] == b"" and stops(head[1]) == [False]
    assert head[1].statuses == {0: (200, "OK")} and head[1].content_types == {0: JSON_CONTENT_TYPE}
    assert [context.request_ids for _, context in middle] == [{}]  # withheld, body not re-sent
    assert stops(last[1]) == [True]
    assert json.loads(last[0]) == json.loads(answer)  # the same answer, as the body's one chunk


def test_a_large_whole_answer_that_fails_after_its_head_ends_with_the_error_body(
    handler: SessionHandler,
) -> None:
    sid = open_session(handler)
    request = body("query", prompt="a boom") + b" " * EARLY_HEAD_BYTES
    head, last = whole_answer_steps(handler, sid, request)
    assert stops(head[1]) == [False]
    assert stops(last[1]) == [True]
    assert json.loads(last[0])["error"]["code"] == "internal_error"
    small = whole_answer_steps(handler, sid, body("query", prompt="a boom"))[-1]
    assert small[1].statuses == {0: (500, "Internal Server Error")}  # its status kept


class StubService:
    def __init__(self, replies: list[Reply | None]) -> None:
        self.replies = replies

    def step(self, batch: Any) -> list[Reply | None]:
        return self.replies


def test_unusual_statuses_get_a_reason_phrase(handler: SessionHandler) -> None:
    handler.service = StubService([Reply(b"{}", status=499), Reply(b"{}", status=599)])  # type: ignore[assignment]
    _, context = call(handler, [("a", b"{}", {}), ("b", b"{}", {})])
    assert context.statuses == {0: (499, "Client Closed Request"), 1: (599, "Error")}


def test_startup_objects_are_kept_out_of_later_collections() -> None:
    gc.unfreeze()  # start from nothing frozen (another test may have frozen)
    startup = [[i] for i in range(10_000)]  # what loading the model leaves behind
    try:
        freeze_startup_objects()
        assert gc.get_freeze_count() >= len(startup)
        walked = {id(o) for o in gc.get_objects()}  # what a full collection walks
        assert not any(id(o) in walked for o in startup)
    finally:
        gc.unfreeze()


def test_a_worker_whose_engine_failed_for_good_flushes_its_sessions_then_exits() -> None:
    """TorchServe then starts a new worker, and /ping answers 503 until one is ready."""
    import subprocess
    import sys

    script = """
import threading, types
from llava.fronts.torchserve.handler import exit_when_engine_fails
engine = types.SimpleNamespace(failure=None)
drained = lambda grace: print("drained", grace, flush=True)
instance = types.SimpleNamespace(service=types.SimpleNamespace(engine=engine), drain=drained)
exit_when_engine_fails(instance, period_s=0.01)
print("serving", flush=True)
engine.failure = "vLLM's engine did not start again in 5 tries"
threading.Event().wait(30)
print("still serving", flush=True)
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1, done.stderr
    assert done.stdout.split() == ["serving", "drained", "0.0"]
    assert "did not start again" in done.stderr
