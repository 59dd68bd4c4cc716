"""SessionService.step() over a fake engine and a fake image source: no torch, no network."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from llava.api.headers import (
    CLOSED_SESSION_HEADER,
    JSON_CONTENT_TYPE,
    NEW_SESSION_HEADER,
    SESSION_HEADER,
    STREAM_CONTENT_TYPE,
    iso_utc,
)
from llava.api.replies import Reply
from llava.core.errors import ImageError, InvalidRequest
from llava.core.params import GenerationParams
from llava.server.service import Incoming, SessionService
from llava.sessions.store import SessionStore

TTL = 60.0
WALL0 = 1_700_000_000.0
DATA_IMAGE = "data:image/png;base64,AAAA"
HTTPS_IMAGE = "https://images.example.com/cat.png"
HEADER_VALUE = re.compile(r"^([0-9a-f]{40}); Expires=(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ)$")


# -- fakes ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Picture:
    """What the fake image source returns: a marker naming the reference."""

    ref: str


class FakeImages:
    """data: refs load at once; https refs wait for `gate`; refs containing 'bad' fail."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.loads: list[str] = []

    @staticmethod
    def decoder(data: Any) -> Any:  # `read` returns the image itself
        return data

    def read(self, ref: str) -> Picture:
        self.loads.append(ref)
        if "bad" in ref:
            raise ImageError("cannot decode image", field="image")
        if ref.startswith("https://") and not self.gate.wait(10):
            raise TimeoutError("test gate never opened")
        return Picture(ref)


@dataclass(eq=False)
class FakeState:
    image: Any
    system_prompt: str | None
    nbytes: int = 100
    history: list[tuple[str, str]] = field(default_factory=list)


@dataclass(eq=False)
class FakeTurn:
    """An answer that repeats the prompt's words, one per step."""

    state: FakeState
    prompt: str
    params: GenerationParams
    history: bool
    words: list[str]
    generated: list[str] = field(default_factory=list)
    text: str = ""
    delta: str = ""
    done: bool = False
    finish_reason: str | None = None
    prefill_steps: int = 0  # steps that prefill the prompt before the first word

    def usage(self) -> dict[str, Any]:
        return {"generated_tokens": len(self.generated), "finish_reason": self.finish_reason}


HALF_CHARACTER = "<0xE2>"  # a prompt word the fake engine samples as a token with no text yet


class FakeEngine:
    """Deterministic engine that records every call.

    `step_errors` maps a prompt to the exception its turn fails with on the next step;
    `step_raises` makes the whole step raise; `finish_raises` makes finish_turn raise.
    """

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.step_errors: dict[str, BaseException] = {}
        self.step_raises: BaseException | None = None
        self.finish_raises: dict[str, BaseException] = {}
        self.start_raises: dict[str, BaseException] = {}
        self.open_steps = 0
        self.prefill_steps = 0  # steps every question's prompt takes before its first word
        self.steps = 0

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]

    def image_preparer(self) -> Any:
        return lambda image, earlier: image

    def earlier_images(self, state: FakeState) -> list[Any]:
        return []

    def new_session(self, image: Any, system_prompt: str | None = None) -> FakeState:
        self.calls.append(("new_session", (image, system_prompt)))
        return FakeState(image, system_prompt)

    def start_open(self, state: FakeState, answer_follows: bool = False) -> FakeTurn:
        """An open that takes `open_steps` steps (0: computed at once)."""
        turn = FakeTurn(state, "<open>", GenerationParams(), True, ["<open>"] * self.open_steps)
        turn.done = not self.open_steps
        return turn

    def replay(self, state: FakeState, history: list[tuple[str, str]]) -> None:
        state.history = list(history)

    def out_of_memory(self, exc: BaseException) -> bool:
        return isinstance(exc, MemoryError)

    def free_memory(self) -> None:
        self.calls.append(("free_memory", None))

    def start_turn(
        self,
        state: FakeState,
        prompt: str,
        params: GenerationParams,
        *,
        history: bool = True,
        image: Any = None,
        conversation: Any = None,
    ) -> FakeTurn:
        self.calls.append(
            ("start_turn", prompt) if image is None else ("start_turn", (prompt, image))
        )
        if prompt in self.start_raises:
            raise self.start_raises[prompt]
        words = prompt.split()[: params.max_new_tokens]
        return FakeTurn(state, prompt, params, history, words, prefill_steps=self.prefill_steps)

    def step(self, turns: list[FakeTurn]) -> dict[int, BaseException]:
        self.steps += 1
        self.calls.append(("step", [t.prompt for t in turns]))
        if self.step_raises is not None:
            raise self.step_raises
        errors: dict[int, BaseException] = {}
        for i, turn in enumerate(turns):
            if turn.done:
                continue
            if turn.prompt in self.step_errors:
                errors[i] = self.step_errors[turn.prompt]
                continue
            if turn.prefill_steps:
                turn.prefill_steps -= 1
                turn.delta = ""
                continue
            word = turn.words[len(turn.generated)]
            turn.delta = word if not turn.generated else " " + word
            if word == HALF_CHARACTER:  # a token whose text is held back
                turn.delta = ""
            turn.generated.append(word)
            turn.text += turn.delta
            if len(turn.generated) == len(turn.words):
                turn.done = True
                turn.finish_reason = (
                    "length" if turn.params.max_new_tokens == len(turn.words) else "stop"
                )
        return errors

    def finish_turn(self, turn: FakeTurn) -> None:
        if turn.prompt == "<open>":
            self.calls.append(("finish_open", turn.state.image))
            return
        self.calls.append(("finish_turn", turn.prompt))
        if turn.prompt in self.finish_raises:
            raise self.finish_raises[turn.prompt]
        turn.state.history.append((turn.prompt, turn.text))

    def cut_short(self, turn: FakeTurn) -> None:
        turn.done, turn.finish_reason = True, "length"

    def abort_turn(self, turn: FakeTurn) -> None:
        name = "abort_open" if turn.prompt == "<open>" else "abort_turn"
        self.calls.append((name, turn.prompt))

    def release(self, state: FakeState) -> None:
        self.calls.append(("release", state))


class FakeClock:
    def __init__(self) -> None:
        self.now = 500.0

    def __call__(self) -> float:
        return self.now

    def wall(self) -> float:
        return WALL0 + self.now


# -- fixtures and helpers ------------------------------------------------------------------


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def images() -> Iterator[FakeImages]:
    source = FakeImages()
    yield source
    source.gate.set()  # let any blocked fetch thread finish


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def make_service(
    engine: FakeEngine, images: FakeImages, clock: FakeClock, **store_kw: Any
) -> SessionService:
    options: dict[str, Any] = {"ttl_s": TTL, "max_sessions": 8}
    options.update(store_kw)
    store = SessionStore(
        release=lambda session, reason: engine.release(session.state),
        clock=clock,
        wall_clock=clock.wall,
        **options,
    )
    return SessionService(engine, store, images, fetch_threads=2)


@pytest.fixture
def service(engine: FakeEngine, images: FakeImages, clock: FakeClock) -> Iterator[SessionService]:
    svc = make_service(engine, images, clock)
    yield svc
    images.gate.set()
    svc.close()


class Client:
    """Plays TorchServe: bodies only on a request's first step, headers every step."""

    def __init__(self) -> None:
        self.seen: set[str] = set()
        self.counter = 0

    def new_id(self) -> str:
        self.counter += 1
        return f"req-{self.counter}"

    def item(self, request_id: str, body: Any, headers: dict[str, str]) -> Incoming:
        first = request_id not in self.seen
        self.seen.add(request_id)
        return Incoming(request_id, body if first else {}, headers)


def open_body(image: str = DATA_IMAGE, **extra: Any) -> bytes:
    return json.dumps({"type": "open_session", "image": image, **extra}).encode()


def query_body(prompt: str, **extra: Any) -> bytes:
    return json.dumps({"type": "query", "prompt": prompt, **extra}).encode()


def close_body() -> bytes:
    return json.dumps({"type": "close_session"}).encode()


def sid_headers(sid: str) -> dict[str, str]:
    return {SESSION_HEADER: sid}


def one(
    service: SessionService, request_id: str, body: Any, headers: dict[str, str] | None = None
) -> Reply | None:
    [reply] = service.step([Incoming(request_id, body, headers or {})])
    return reply


def body_of(reply: Reply) -> Any:
    return json.loads(reply.body)


def lines_of(reply: Reply) -> list[Any]:
    assert reply.body.endswith(b"\n")
    return [json.loads(line) for line in reply.body.decode().splitlines()]


def open_session(service: SessionService, request_id: str = "open") -> str:
    reply = one(service, request_id, open_body())
    assert reply is not None and reply.status == 200, reply
    return body_of(reply)["session_id"]


def run_until_reply(
    service: SessionService,
    client: Client,
    request_id: str,
    body: Any,
    headers: dict[str, str],
    limit: int = 50,
) -> tuple[Reply, int]:
    """Step one request until it gets a reply; return it and the number of steps taken."""
    for n in range(1, limit + 1):
        [reply] = service.step([client.item(request_id, body, headers)])
        if reply is not None:
            return reply, n
    raise AssertionError(f"no reply after {limit} steps")


# -- open ----------------------------------------------------------------------------------


def test_open_replies_with_both_session_headers_and_body(
    service: SessionService, engine: FakeEngine, clock: FakeClock
) -> None:
    reply = one(service, "r1", open_body(system_prompt="Be brief."))
    assert reply is not None
    assert reply.status == 200
    assert reply.last is None
    assert reply.content_type == JSON_CONTENT_TYPE
    new_value, sticky_value = reply.headers[NEW_SESSION_HEADER], reply.headers[SESSION_HEADER]
    assert new_value == sticky_value
    match = HEADER_VALUE.match(new_value)
    assert match, new_value
    sid, expires = match.groups()
    assert expires == iso_utc(clock.wall() + TTL)
    assert body_of(reply) == {"session_id": sid, "expires_at": expires}
    image = Picture(DATA_IMAGE)
    assert engine.calls == [("new_session", (image, "Be brief.")), ("finish_open", image)]
    assert service.store.stats() == {"sessions": 1, "opening": 0, "bytes": 100}
    assert service.in_flight == 0


def test_pending_https_open_is_withheld_until_the_image_arrives(
    service: SessionService, images: FakeImages, engine: FakeEngine
) -> None:
    client = Client()
    for _ in range(3):
        [reply] = service.step([client.item("r1", open_body(HTTPS_IMAGE), {})])
        assert reply is None
    assert service.store.stats()["opening"] == 1
    assert engine.calls == []
    images.gate.set()
    reply, _ = run_until_reply(service, client, "r1", open_body(HTTPS_IMAGE), {})
    assert reply.status == 200
    assert NEW_SESSION_HEADER in reply.headers
    image = Picture(HTTPS_IMAGE)
    assert engine.calls == [("new_session", (image, None)), ("finish_open", image)]
    assert service.store.stats() == {"sessions": 1, "opening": 0, "bytes": 100}


def test_pending_open_does_not_hold_up_other_requests(service: SessionService) -> None:
    sid = open_session(service)
    client = Client()
    batch = [
        client.item("slow", open_body(HTTPS_IMAGE), {}),
        client.item("fast", close_body(), sid_headers(sid)),
    ]
    slow, fast = service.step(batch)
    assert slow is None
    assert fast is not None and fast.status == 200


def test_abandoned_pending_open_frees_its_slot(
    service: SessionService, images: FakeImages, engine: FakeEngine
) -> None:
    assert one(service, "r1", open_body(HTTPS_IMAGE)) is None
    assert service.store.stats()["opening"] == 1
    assert service.step([]) == []
    assert service.store.stats() == {"sessions": 0, "opening": 0, "bytes": 0}
    assert service.in_flight == 0
    images.gate.set()
    assert service.step([]) == []
    assert "new_session" not in engine.names()


@pytest.mark.parametrize("image", ["bad", "data:image/png;base64,bad", "https://x.example/bad.png"])
def test_image_error_on_open_is_400_and_leaves_no_slot(service: SessionService, image: str) -> None:
    client = Client()
    reply, _ = run_until_reply(service, client, "r1", open_body(image), {})
    assert reply.status == 400
    assert body_of(reply)["error"]["code"] == "invalid_image"
    assert service.store.stats() == {"sessions": 0, "opening": 0, "bytes": 0}
    assert service.in_flight == 0


def test_capacity_exceeded_is_429_with_retry_after(
    engine: FakeEngine, images: FakeImages, clock: FakeClock
) -> None:
    service = make_service(engine, images, clock, max_sessions=2)
    try:
        open_session(service, "a")
        open_session(service, "b")
        reply = one(service, "c", open_body())
        assert reply is not None
        assert reply.status == 429
        assert reply.headers == {"Retry-After": "30"}
        error = body_of(reply)["error"]
        assert error["code"] == "capacity_exceeded"
        assert error["retry_after_s"] == 30
        assert service.store.stats()["sessions"] == 2
        assert engine.names().count("new_session") == 2
    finally:
        service.close()


# -- query ---------------------------------------------------------------------------------


def test_query_is_withheld_until_done_then_one_json_reply_with_usage(
    service: SessionService, engine: FakeEngine
) -> None:
    sid = open_session(service)
    client = Client()
    replies = [
        service.step([client.item("q", query_body("one two three"), sid_headers(sid))])[0]
        for _ in range(3)
    ]
    assert replies[:2] == [None, None]
    reply = replies[2]
    assert reply is not None
    assert reply.status == 200
    assert reply.last is None
    assert reply.content_type == JSON_CONTENT_TYPE
    assert body_of(reply) == {
        "session_id": sid,
        "text": "one two three",
        "usage": {"generated_tokens": 3, "finish_reason": "stop"},
    }
    assert engine.names().count("finish_turn") == 1
    assert "abort_turn" not in engine.names()
    assert not service.store.get(sid).busy
    assert service.store.get(sid).state.history == [("one two three", "one two three")]
    assert service.in_flight == 0


def test_query_params_reach_the_engine(service: SessionService, engine: FakeEngine) -> None:
    sid = open_session(service)
    reply, steps = run_until_reply(
        service,
        Client(),
        "q",
        query_body("a b c d", max_new_tokens=2, history=False),
        sid_headers(sid),
    )
    assert steps == 2
    assert body_of(reply)["text"] == "a b"
    assert body_of(reply)["usage"]["finish_reason"] == "length"


def test_stream_query_sends_text_chunks_then_a_final_usage_line(service: SessionService) -> None:
    sid = open_session(service)
    client = Client()
    body = query_body("one two three", stream=True)
    replies = [service.step([client.item("q", body, sid_headers(sid))])[0] for _ in range(3)]
    assert all(r is not None for r in replies)
    first, second, final = replies
    for chunk in (first, second, final):
        assert chunk.content_type == STREAM_CONTENT_TYPE
        assert chunk.status == 200
    assert (first.last, second.last, final.last) == (False, False, True)
    assert lines_of(first) == [{"text": "one"}]
    assert lines_of(second) == [{"text": " two"}]
    assert lines_of(final) == [
        {"text": " three"},
        {"usage": {"generated_tokens": 3, "finish_reason": "stop"}, "finish_reason": "stop"},
    ]
    assert service.in_flight == 0
    assert not service.store.get(sid).busy


def test_stream_head_waits_for_the_first_token(service: SessionService, engine: FakeEngine) -> None:
    """A prefill over several steps sends nothing, so a client's first line is a token."""
    sid = open_session(service)
    engine.prefill_steps = 3
    client = Client()
    body = query_body("one two", stream=True)
    replies = [service.step([client.item("q", body, sid_headers(sid))])[0] for _ in range(4)]
    assert replies[:3] == [None, None, None]
    assert replies[3] is not None and lines_of(replies[3]) == [{"text": "one"}]


def test_stream_sends_a_line_for_a_token_whose_text_is_held_back(
    service: SessionService,
) -> None:
    """Every step of an answer reaches the client, so a live stream never looks stalled."""
    sid = open_session(service)
    client = Client()
    body = query_body(f"one {HALF_CHARACTER} two three", stream=True)
    replies = [service.step([client.item("q", body, sid_headers(sid))])[0] for _ in range(4)]
    assert all(r is not None for r in replies)
    assert [lines_of(r)[0] for r in replies[:3]] == [
        {"text": "one"},
        {"text": ""},
        {"text": " two"},
    ]


def test_prefill_failing_before_the_first_token_answers_with_its_status(
    service: SessionService, engine: FakeEngine
) -> None:
    """No head has gone out yet, so the error is a plain 4xx/5xx answer, not an in-band line."""
    sid = open_session(service)
    engine.prefill_steps = 3
    client = Client()
    body = query_body("a b", stream=True)
    [waiting] = service.step([client.item("q", body, sid_headers(sid))])
    assert waiting is None
    engine.step_errors["a b"] = RuntimeError("out of memory in a chunk")
    [failed] = service.step([client.item("q", None, sid_headers(sid))])
    assert failed is not None and failed.status == 500 and failed.last is None
    assert body_of(failed)["error"]["code"] == "internal_error"
    assert not service.store.get(sid).busy


def test_stream_finishing_in_its_first_step_is_a_whole_response(service: SessionService) -> None:
    sid = open_session(service)
    reply = one(service, "q", query_body("hello", stream=True), sid_headers(sid))
    assert reply is not None
    assert reply.last is None
    assert reply.content_type == STREAM_CONTENT_TYPE
    assert lines_of(reply) == [
        {"text": "hello"},
        {"usage": {"generated_tokens": 1, "finish_reason": "stop"}, "finish_reason": "stop"},
    ]


def test_second_concurrent_query_on_a_session_is_409(
    service: SessionService, engine: FakeEngine
) -> None:
    sid = open_session(service)
    client = Client()
    first, second = service.step(
        [
            client.item("q1", query_body("a b c"), sid_headers(sid)),
            client.item("q2", query_body("x y"), sid_headers(sid)),
        ]
    )
    assert first is None
    assert second is not None and second.status == 409
    assert body_of(second)["error"]["code"] == "session_busy"
    assert engine.names().count("start_turn") == 1
    reply, _ = run_until_reply(service, client, "q1", None, sid_headers(sid))
    assert body_of(reply)["text"] == "a b c"


def test_start_turn_error_is_400_and_leaves_the_session_idle(
    service: SessionService, engine: FakeEngine
) -> None:
    sid = open_session(service)
    engine.start_raises["too long"] = InvalidRequest("prompt is 9999 tokens", field="prompt")
    reply = one(service, "q", query_body("too long"), sid_headers(sid))
    assert reply is not None and reply.status == 400
    assert body_of(reply)["error"] == {
        "code": "invalid_request",
        "message": "prompt is 9999 tokens",
        "field": "prompt",
    }
    assert not service.store.get(sid).busy
    assert service.in_flight == 0


@pytest.mark.parametrize(
    ("headers_for", "code"),
    [
        (lambda sid: {SESSION_HEADER: "0" * 40}, "session_not_found"),
        (lambda sid: {}, "invalid_request"),
    ],
)
def test_query_on_missing_session_is_400(
    service: SessionService, headers_for: Any, code: str
) -> None:
    sid = open_session(service)
    reply = one(service, "q", query_body("hi"), headers_for(sid))
    assert reply is not None and reply.status == 400
    assert body_of(reply)["error"]["code"] == code


# -- close ---------------------------------------------------------------------------------


def test_close_replies_with_closed_header_and_releases(
    service: SessionService, engine: FakeEngine
) -> None:
    sid = open_session(service)
    reply = one(service, "c", close_body(), sid_headers(sid))
    assert reply is not None and reply.status == 200
    assert reply.headers == {CLOSED_SESSION_HEADER: sid}
    assert body_of(reply) == {"session_id": sid, "closed": True, "success": True}
    assert engine.names()[-1] == "release"
    assert service.store.stats()["sessions"] == 0
    again = one(service, "q", query_body("hi"), sid_headers(sid))
    assert again is not None and again.status == 400
    assert body_of(again)["error"]["code"] == "session_closed"


def test_close_of_unknown_session_is_400(service: SessionService) -> None:
    reply = one(service, "c", close_body(), sid_headers("deadbeef"))
    assert reply is not None
    assert reply.status == 400
    assert body_of(reply)["error"]["code"] == "session_not_found"


def test_close_during_an_answer_releases_when_it_ends(
    service: SessionService, engine: FakeEngine
) -> None:
    sid = open_session(service)
    client = Client()
    assert service.step([client.item("q", query_body("a b c"), sid_headers(sid))]) == [None]
    query, close = service.step(
        [client.item("q", None, sid_headers(sid)), client.item("c", close_body(), sid_headers(sid))]
    )
    assert close is not None and close.status == 200
    assert query is None
    assert "release" not in engine.names()
    [query] = service.step([client.item("q", None, sid_headers(sid))])
    assert query is not None and body_of(query)["text"] == "a b c"
    assert engine.names()[-1] == "release"
    assert service.store.stats()["sessions"] == 0


# -- isolation -----------------------------------------------------------------------------


def test_batch_mixing_good_and_bad_requests_answers_each_on_its_own(
    service: SessionService, engine: FakeEngine
) -> None:
    sid = open_session(service)
    client = Client()
    batch = [
        ("good-query", query_body("alpha beta"), sid_headers(sid)),
        ("bad-json", b"{nope", {}),
        ("bad-type", json.dumps({"type": "delete"}).encode(), {}),
        ("bad-tokens", query_body("x", max_new_tokens=0), sid_headers(sid)),
        ("bad-close", close_body(), sid_headers("unknown1")),
        ("too-big", b'{"type": "open_session", "image": "' + b"A" * (7 << 20) + b'"}', {}),
        ("good-open", open_body(), {}),
    ]
    replies = service.step([client.item(rid, body, h) for rid, body, h in batch])
    by_id = dict(zip([rid for rid, _, _ in batch], replies, strict=True))
    assert by_id["good-query"] is None
    expected = {
        "bad-json": (400, "invalid_request", "body"),
        "bad-type": (400, "invalid_request", "type"),
        "bad-tokens": (400, "invalid_request", "max_new_tokens"),
        "bad-close": (400, "session_not_found", None),
        "too-big": (413, "payload_too_large", "body"),
    }
    for rid, (status, code, field_name) in expected.items():
        reply = by_id[rid]
        assert reply is not None, rid
        assert reply.status == status, rid
        assert body_of(reply)["error"]["code"] == code, rid
        assert body_of(reply)["error"].get("field") == field_name, rid
    # The open's image loads on a thread: its reply may come some steps later.
    later: dict[str, Reply | None] = {"good-query": None, "good-open": by_id["good-open"]}
    headers = {"good-query": sid_headers(sid), "good-open": {}}
    for _ in range(500):
        waiting = [rid for rid, reply in later.items() if reply is None]
        if not waiting:
            break
        replies = service.step([client.item(rid, None, headers[rid]) for rid in waiting])
        later.update(zip(waiting, replies, strict=True))
    opened, final = later["good-open"], later["good-query"]
    assert opened is not None and opened.status == 200
    assert final is not None and body_of(final)["text"] == "alpha beta"


def test_engine_error_in_one_turn_fails_only_that_turn(
    service: SessionService, engine: FakeEngine
) -> None:
    sid_ok, sid_bad = open_session(service, "o1"), open_session(service, "o2")
    engine.step_errors["boom boom"] = RuntimeError("secret-detail in a traceback")
    client = Client()
    ok, bad = service.step(
        [
            client.item("ok", query_body("a b"), sid_headers(sid_ok)),
            client.item("bad", query_body("boom boom"), sid_headers(sid_bad)),
        ]
    )
    assert ok is None
    assert bad is not None
    assert bad.status == 500
    error = body_of(bad)["error"]
    assert error["code"] == "internal_error"
    assert "secret-detail" not in bad.body.decode()
    assert "Traceback" not in bad.body.decode()
    assert ("abort_turn", "boom boom") in engine.calls
    assert not service.store.get(sid_bad).busy
    [ok] = service.step([client.item("ok", None, sid_headers(sid_ok))])
    assert ok is not None and body_of(ok)["text"] == "a b"


def test_engine_error_after_a_stream_started_is_reported_in_band(
    service: SessionService, engine: FakeEngine
) -> None:
    sid = open_session(service)
    client = Client()
    body = query_body("a b c d", stream=True)
    [first] = service.step([client.item("s", body, sid_headers(sid))])
    assert first is not None and first.last is False
    engine.step_errors["a b c d"] = RuntimeError("secret-detail")
    [failed] = service.step([client.item("s", None, sid_headers(sid))])
    assert failed is not None
    assert failed.last is True
    assert failed.content_type == STREAM_CONTENT_TYPE
    [line] = lines_of(failed)
    assert line["error"]["code"] == "internal_error"
    assert "secret-detail" not in failed.body.decode()
    assert service.in_flight == 0
    assert not service.store.get(sid).busy


def test_whole_engine_step_raising_fails_every_turn_but_not_the_service(
    service: SessionService, engine: FakeEngine
) -> None:
    sids = [open_session(service, f"o{i}") for i in range(2)]
    engine.step_raises = RuntimeError("device lost")
    client = Client()
    replies = service.step(
        [client.item(f"q{i}", query_body("a b"), sid_headers(s)) for i, s in enumerate(sids)]
    )
    assert [r.status if r else None for r in replies] == [500, 500]
    assert engine.names().count("abort_turn") == 2
    engine.step_raises = None
    reply, _ = run_until_reply(service, client, "again", query_body("c d"), sid_headers(sids[0]))
    assert body_of(reply)["text"] == "c d"


def test_request_leaving_the_batch_aborts_its_turn_and_frees_the_session(
    service: SessionService, engine: FakeEngine
) -> None:
    sid = open_session(service)
    client = Client()
    assert service.step([client.item("gone", query_body("a b c d"), sid_headers(sid))]) == [None]
    assert service.store.get(sid).busy
    assert service.step([]) == []
    assert ("abort_turn", "a b c d") in engine.calls
    assert "finish_turn" not in engine.names()
    assert not service.store.get(sid).busy
    assert service.in_flight == 0
    reply, _ = run_until_reply(service, client, "next", query_body("x y"), sid_headers(sid))
    assert body_of(reply)["text"] == "x y"


def test_only_the_missing_request_is_abandoned(service: SessionService, engine: FakeEngine) -> None:
    sid_a, sid_b = open_session(service, "o1"), open_session(service, "o2")
    client = Client()
    service.step(
        [
            client.item("a", query_body("a1 a2 a3"), sid_headers(sid_a)),
            client.item("b", query_body("b1 b2 b3"), sid_headers(sid_b)),
        ]
    )
    assert service.step([client.item("b", None, sid_headers(sid_b))]) == [None]
    assert [c for c in engine.calls if c[0] == "abort_turn"] == [("abort_turn", "a1 a2 a3")]
    [b] = service.step([client.item("b", None, sid_headers(sid_b))])
    assert b is not None and body_of(b)["text"] == "b1 b2 b3"


def test_finish_turn_raising_fails_only_that_request(
    service: SessionService, engine: FakeEngine
) -> None:
    sid_ok, sid_bad = open_session(service, "o1"), open_session(service, "o2")
    engine.finish_raises["bad"] = RuntimeError("commit failed")
    client = Client()
    ok, bad = service.step(
        [
            client.item("ok", query_body("fine", stream=True), sid_headers(sid_ok)),
            client.item("bad", query_body("bad"), sid_headers(sid_bad)),
        ]
    )
    assert ok is not None and ok.status == 200
    assert bad is not None and bad.status == 500


def test_a_reply_that_fails_to_render_rolls_its_turn_back_and_frees_the_session(
    service: SessionService, engine: FakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unexpected error while writing an answer's chunk fails that request alone, and its
    turn is rolled back: the session answers the next question (not 409 for ever)."""
    from llava.server import inflight

    sid = open_session(service, "o1")
    real_chunk = inflight.Answering.chunk

    def broken(self: Any) -> Any:
        if self.turn.prompt.startswith("doomed"):
            raise RuntimeError("cannot render")
        return real_chunk(self)

    monkeypatch.setattr(inflight.Answering, "chunk", broken)
    client = Client()
    body = query_body("doomed to fail slowly")  # an answer of several steps
    reply, _ = run_until_reply(service, client, "q1", body, sid_headers(sid))
    assert reply.status == 500
    assert ("abort_turn", "doomed to fail slowly") in engine.calls
    again, _ = run_until_reply(service, client, "q2", query_body("fine"), sid_headers(sid))
    assert again.status == 200, again.body


# -- hardening -------------------------------------------------------------------------------


class FieldlessImages(FakeImages):
    """Raise image errors the way llava.images does: without naming a field."""

    def read(self, ref: str) -> Picture:
        if "bad" in ref:
            raise InvalidRequest("data URI has media type 'text/plain'")
        return super().read(ref)


@pytest.mark.parametrize("image", ["data:text/plain;base64,bad", "https://x.example/bad.png"])
def test_image_errors_name_the_image_field(
    engine: FakeEngine, clock: FakeClock, image: str
) -> None:
    images = FieldlessImages()
    images.gate.set()
    service = make_service(engine, images, clock)
    try:
        reply, _ = run_until_reply(service, Client(), "o", open_body(image), {})
        assert reply.status == 400 and body_of(reply)["error"]["field"] == "image"
        assert service.store.stats()["opening"] == 0
    finally:
        service.close()


def test_an_open_that_fails_after_the_engine_opened_frees_the_state(
    service: SessionService, engine: FakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("store refused")

    monkeypatch.setattr(service.store, "add", refuse)
    reply = one(service, "o", open_body())
    assert reply is not None and reply.status == 500
    assert engine.names()[-3:] == ["new_session", "finish_open", "release"]
    assert service.store.stats() == {"sessions": 0, "opening": 0, "bytes": 0}


def test_a_failing_memory_policy_fails_neither_the_open_nor_the_answer(
    engine: FakeEngine, images: FakeImages, clock: FakeClock
) -> None:
    class Broken:
        def rebalance(self, sessions: list[Any], keep: str | None) -> list[Any]:
            raise RuntimeError("policy bug")

    service = make_service(engine, images, clock, memory=Broken())
    try:
        sid = open_session(service)
        reply, _ = run_until_reply(service, Client(), "q", query_body("a b"), sid_headers(sid))
        assert reply.status == 200 and body_of(reply)["text"] == "a b"
    finally:
        service.close()


def test_a_whole_answer_ends_in_time_with_what_it_has(engine: FakeEngine) -> None:
    """SageMaker drops a response that takes over 60 s: a whole answer still generating at
    `whole_answer_s` ends with its text so far (finish reason "length"), and its session goes
    on; a streamed one is not cut."""
    store = SessionStore(ttl_s=60, max_sessions=4)
    service = SessionService(engine, store, FakeImages(), whole_answer_s=0.0)
    sid = open_session(service, "o1")
    client = Client()
    long_question = "one two three four five six"
    reply, steps = run_until_reply(
        service, client, "q1", query_body(long_question), sid_headers(sid)
    )
    body = body_of(reply)
    assert reply.status == 200 and body["usage"]["finish_reason"] == "length"
    assert 0 < body["usage"]["generated_tokens"] < len(long_question.split())
    lines = []
    for _ in range(50):  # a stream is not cut: it runs to its end
        [chunk] = service.step(
            [client.item("q2", query_body(long_question, stream=True), sid_headers(sid))]
        )
        if chunk is not None:
            lines += lines_of(chunk)
            if chunk.last is not False:
                break
    assert lines[-1]["finish_reason"] != "length"
    assert lines[-1]["usage"]["generated_tokens"] == len(long_question.split())
