"""Hostile and malformed requests against a real TorchServe on loopback.

Every case checks the status, the error code and (where one applies) the field the error names,
then that a cheap good request on a shared session still works: a bad request must never cost
anyone else an answer. A hypothesis-driven fuzz then throws generated bodies at the server.

Image URLs here are IP literals only (no DNS): the address policy refuses them before any
connection, which the in-process check at the end proves with the socket layer booby-trapped.
The Content-Type is not checked: a JSON body is read as JSON whatever the header says (SageMaker
clients send all sorts); only the body must be a JSON object.
"""

from __future__ import annotations

import base64
import io
import json
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from conftest import start_server
from helpers import data_uri, make_image, open_session, post
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from PIL import Image

from llava.api.headers import NEW_SESSION, SESSION_HEADER
from llava.core.errors import ImageForbidden, InvalidRequest
from llava.core.params import MAX_BODY_BYTES
from llava.fronts.torchserve.launcher import TorchServe
from llava.images import ImageLoader, ImagePolicy

pytestmark = pytest.mark.integration

ROUTE = "/predictions/llava"
UNKNOWN_SID = "0123456789abcdef0123456789abcdef01234567"
# Placeholders filled in per run.
SHARED, CLOSED, EXPIRED = "@shared@", "@closed@", "@expired@"
PORT, LISTENER, MGMT = "@port@", "@listener@", "@mgmt@"
TORCHSERVE_LIMIT = 6_553_600  # max_request_size in config.properties


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


GOOD_IMAGE = data_uri(make_image(1, (16, 16)))
TRUNCATED_PNG = b64(png(make_image(2))[:100])
HUGE_PNG = b64(png(Image.new("1", (8000, 6000))))  # 48 Mpx, a few KB


@dataclass(frozen=True)
class Case:
    """One bad request and what must come back."""

    id: str
    body: Any  # dict (sent as JSON), bytes (sent as is) or a callable making bytes
    status: int
    code: str | None  # None: TorchServe's own reply, no JSON body
    field: str | None = None  # None: the error names no field
    sid: str | None = None
    headers: tuple[tuple[str, str], ...] = ()  # extra request headers
    says: str = ""  # a word the message must contain


def query(**extra: Any) -> dict[str, Any]:
    return {"type": "query", "prompt": "Hi?", "max_new_tokens": 2, **extra}


def opening(image: Any = GOOD_IMAGE, **extra: Any) -> dict[str, Any]:
    return {"type": "open_session", "image": image, **extra}


def generate(**extra: Any) -> dict[str, Any]:
    return {"type": "generate", "image": GOOD_IMAGE, "prompt": "Hi?", "max_new_tokens": 2, **extra}


def invalid(
    case_id: str,
    body: Any,
    name: str,
    sid: str | None = None,
    headers: dict[str, str] | None = None,
    says: str = "",
) -> Case:
    headers_ = tuple((headers or {}).items())
    return Case(case_id, body, 400, "invalid_request", name, sid, headers_, says)


def image_case(case_id: str, image: str, status: int, code: str) -> Case:
    return Case(case_id, opening(image), status, code, "image")


def oversized(size: int) -> Callable[[], bytes]:
    def build() -> bytes:
        head = b'{"type": "open_session", "image": "'
        return head + b"A" * (size - len(head) - 2) + b'"}'

    return build


CASES = [
    # -- the body as a whole
    invalid("json-syntax", b"{not json", "body"),
    invalid("json-trailing-garbage", b'{"type": "close_session"} extra', "body"),
    invalid("json-single-quotes", b"{'type': 'query'}", "body"),
    invalid("empty-body", b"", "body"),
    invalid("whitespace-body", b"  \n ", "body"),
    invalid("array-body", b'[{"type": "query"}]', "body"),
    invalid("string-body", b'"{\\"type\\": \\"close_session\\"}"', "body", sid=SHARED),
    invalid("number-body", b"42", "body"),
    invalid("null-body", b"null", "body"),
    invalid("invalid-utf8", b'{"type": "\xff\xfe"}', "body"),
    invalid("deeply-nested", b'{"type": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", "body"),
    invalid("bad-json-as-text-plain", b"{oops", "body", headers={"Content-Type": "text/plain"}),
    invalid(
        "huge-int-literal", b'{"type":"query","prompt":"x","seed":1' + b"0" * 5000 + b"}", "body"
    ),
    Case("over-6mib-limit", oversized(MAX_BODY_BYTES + 1000), 413, "payload_too_large", "body"),
    Case("over-torchserve-limit", oversized(TORCHSERVE_LIMIT + 1000), 413, None),
    # -- type
    invalid("missing-type", {"prompt": "Hi?"}, "type"),
    invalid("null-type", {"type": None}, "type"),
    invalid("unknown-type", {"type": "delete_everything"}, "type"),
    invalid("type-not-string", {"type": ["query"]}, "type"),
    # -- unknown fields, per type (management settings among them: the body never reaches it)
    invalid("open-unknown-field", opening(minWorkers=8), "minWorkers"),
    invalid("query-unknown-field", query(temperture=0.5), "temperture", sid=SHARED),
    invalid("close-unknown-field", {"type": "close_session", "force": True}, "force", sid=SHARED),
    invalid("generate-unknown-field", generate(batchSize=64), "batchSize"),
    # -- wrong types, per field
    invalid("image-not-string", opening(123), "image"),
    invalid("system-prompt-list", opening(system_prompt=["Be brief."]), "system_prompt"),
    invalid("prompt-number", query(prompt=42), "prompt", sid=SHARED),
    invalid("max-new-tokens-string", query(max_new_tokens="5"), "max_new_tokens", sid=SHARED),
    invalid("max-new-tokens-float", query(max_new_tokens=5.5), "max_new_tokens", sid=SHARED),
    invalid("temperature-string", query(temperature="hot"), "temperature", sid=SHARED),
    invalid("stream-string", query(stream="yes"), "stream", sid=SHARED),
    invalid("query-history-list", query(history=[["q", "a"]]), "history", sid=SHARED),
    invalid("seed-bool", query(seed=True), "seed", sid=SHARED),
    invalid("session-id-number", query(session_id=7), "session_id", sid=SHARED),
    # -- non-finite and huge numbers
    invalid(
        "temperature-nan",
        b'{"type":"query","prompt":"x","temperature":NaN}',
        "temperature",
        sid=SHARED,
    ),
    invalid(
        "top-p-infinity", b'{"type":"query","prompt":"x","top_p":Infinity}', "top_p", sid=SHARED
    ),
    invalid(
        "max-new-tokens-1e999",
        b'{"type":"query","prompt":"x","max_new_tokens":1e999}',
        "max_new_tokens",
        sid=SHARED,
    ),
    invalid("seed-2-pow-64", query(seed=2**64), "seed", sid=SHARED),
    invalid("max-new-tokens-10-pow-40", query(max_new_tokens=10**40), "max_new_tokens", sid=SHARED),
    # -- out-of-range generation parameters
    invalid("max-new-tokens-0", query(max_new_tokens=0), "max_new_tokens", sid=SHARED),
    invalid("max-new-tokens-1025", query(max_new_tokens=1025), "max_new_tokens", sid=SHARED),
    invalid("temperature-negative", query(temperature=-0.1), "temperature", sid=SHARED),
    invalid("temperature-above-2", query(temperature=2.5), "temperature", sid=SHARED),
    invalid("top-p-zero", query(top_p=0), "top_p", sid=SHARED),
    invalid("seed-negative", query(seed=-1), "seed", sid=SHARED),
    # -- prompts
    invalid("prompt-missing", {"type": "query"}, "prompt", sid=SHARED),
    invalid("prompt-empty", query(prompt=""), "prompt", sid=SHARED),
    invalid("prompt-whitespace", query(prompt=" \n\t "), "prompt", sid=SHARED),
    invalid("prompt-over-char-limit", query(prompt="x" * 16_001), "prompt", sid=SHARED),
    # 15,000 characters (under max_prompt_chars) but ~9,000 tokens (over max_prompt_tokens)
    invalid(
        "prompt-over-token-limit", query(prompt="word " * 3000), "prompt", sid=SHARED, says="tokens"
    ),
    invalid("generate-over-token-limit", generate(prompt="word " * 3000), "prompt", says="tokens"),
    invalid("system-prompt-over-limit", opening(system_prompt="s" * 8_001), "system_prompt"),
    # -- session ids
    invalid("query-without-session", query(), "session_id"),
    invalid("session-id-underscore", query(), "session_id", sid="abc_def"),
    invalid("session-id-dot", query(), "session_id", sid="abc.def"),
    invalid("session-id-too-long", query(), "session_id", sid="a" * 257),
    invalid("session-id-leading-hyphen", query(), "session_id", sid="-abc"),
    invalid("session-id-trailing-newline", query(session_id="abc\n"), "session_id"),
    invalid("new-session-on-query", query(), "session_id", sid=NEW_SESSION),
    invalid("body-header-mismatch", query(session_id=UNKNOWN_SID), "session_id", sid=SHARED),
    invalid("open-with-a-session", opening(), "session_id", sid=SHARED),
    invalid("generate-with-a-session", generate(), "session_id", sid=SHARED),
    Case("unknown-session", query(), 400, "session_not_found", sid=UNKNOWN_SID),
    Case("unknown-session-close", {"type": "close_session"}, 400, "session_not_found", sid="a--b"),
    Case("closed-session", query(), 400, "session_closed", sid=CLOSED),
    Case("closed-session-close", {"type": "close_session"}, 400, "session_closed", sid=CLOSED),
    Case("expired-session", query(), 400, "session_expired", sid=EXPIRED),
    # -- images
    invalid("image-empty", opening(""), "image"),
    image_case("image-invalid-base64", "!!!not base64!!!", 400, "invalid_image"),
    image_case("image-not-an-image", b64(b"plain text, not pixels"), 400, "invalid_image"),
    image_case("image-truncated-png", TRUNCATED_PNG, 400, "invalid_image"),
    image_case("image-too-many-pixels", HUGE_PNG, 413, "image_too_large"),
    image_case("data-uri-text-plain", "data:text/plain;base64,aGVsbG8=", 400, "invalid_request"),
    image_case("data-uri-not-base64", "data:image/png,rawbytes", 400, "invalid_request"),
    image_case("url-unsupported-scheme", "ftp://198.51.100.7/cat.png", 400, "invalid_request"),
    image_case("url-with-credentials", "https://user:pw@10.0.0.1/cat.png", 400, "invalid_request"),
    image_case("url-s3-malformed", "s3://Not_A_Bucket/cat.png", 400, "invalid_request"),
    image_case(
        "url-http-disabled", f"http://127.0.0.1:{LISTENER}/cat.png", 400, "image_url_forbidden"
    ),
    image_case(
        "url-loopback-listener", f"https://127.0.0.1:{LISTENER}/cat.png", 400, "image_url_forbidden"
    ),
    image_case("url-loopback-server", f"https://127.0.0.1:{PORT}/ping", 400, "image_url_forbidden"),
    image_case(
        "url-loopback-management",
        f"https://127.0.0.1:{MGMT}/models/llava?min_worker=4",
        400,
        "image_url_forbidden",
    ),
    image_case("url-private-10", "https://10.0.0.1/cat.png", 400, "image_url_forbidden"),
    image_case(
        "url-metadata-v4", "https://169.254.169.254/latest/meta-data/", 400, "image_url_forbidden"
    ),
    image_case("url-loopback-v6", f"https://[::1]:{LISTENER}/cat.png", 400, "image_url_forbidden"),
    image_case(
        "url-metadata-v6", "https://[fd00:ec2::254]/latest/meta-data/", 400, "image_url_forbidden"
    ),
    image_case(
        "url-v4-mapped-loopback", "https://[::ffff:127.0.0.1]/cat.png", 400, "image_url_forbidden"
    ),
    image_case("url-unspecified", "https://0.0.0.0/cat.png", 400, "image_url_forbidden"),
    # -- generate
    invalid("generate-history-not-list", generate(history="q, a"), "history"),
    invalid("generate-history-triple", generate(history=[["q", "a", "x"]]), "history"),
    invalid("generate-history-non-string", generate(history=[["q", 1]]), "history"),
    invalid("generate-history-too-long", generate(history=[["q", "a"]] * 65), "history"),
    invalid("generate-missing-prompt", {"type": "generate", "image": GOOD_IMAGE}, "prompt"),
]
# The URLs above that name non-loopback addresses: checked in process, connections forbidden.
OFFLINE_URLS = [
    c.body["image"]
    for c in CASES
    if isinstance(c.body, dict) and str(c.body.get("image", "")).startswith(("http", "ftp"))
]


# -- fixtures --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def listener() -> Iterator[socket.socket]:
    """A loopback port that must never see a connection from the image fetcher."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    sock.setblocking(False)
    yield sock
    sock.close()


@pytest.fixture(scope="module")
def sessions(server: TorchServe) -> Iterator[dict[str, str]]:
    url = server.url(ROUTE)
    with httpx.Client(timeout=60) as client:
        shared = open_session(client, url, GOOD_IMAGE)
        closed = open_session(client, url, GOOD_IMAGE)
        assert post(client, url, {"type": "close_session"}, closed).status_code == 200
        yield {SHARED: shared, CLOSED: closed}
        post(client, url, {"type": "close_session"}, shared)


@pytest.fixture(scope="module")
def short_ttl(model_store, tmp_path_factory) -> Iterator[TorchServe]:
    """A server whose sessions expire after one idle second (for the expired case only)."""
    ts = start_server(
        model_store,
        tmp_path_factory.mktemp("short-ttl"),
        LLAVA_SESSION_TTL_S="1",
        LLAVA_REAPER_INTERVAL_S="0.2",
    )
    try:
        yield ts
    finally:
        ts.stop()


def fill(text: str, values: dict[str, str]) -> str:
    for key, value in values.items():
        text = text.replace(key, value)
    return text


def good_query(client: httpx.Client, url: str, sid: str) -> None:
    r = post(client, url, {"type": "query", "prompt": "Still fine?", "max_new_tokens": 1}, sid)
    assert r.status_code == 200, f"the next good request failed: {r.status_code} {r.text}"
    assert r.json()["usage"]["generated_tokens"] == 1


# -- the cases -------------------------------------------------------------------------------


def test_the_suite_has_at_least_40_distinct_cases() -> None:
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids)) >= 40
    bodies = [
        json.dumps(c.body, sort_keys=True) if isinstance(c.body, dict) else c.body for c in CASES
    ]
    requests = {(repr(b), c.sid, c.headers) for b, c in zip(bodies, CASES, strict=True)}
    assert len(requests) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case: Case, request, server, sessions, listener) -> None:
    target, good_sid = server, sessions[SHARED]
    values = {
        **sessions,
        PORT: str(server.port),
        LISTENER: str(listener.getsockname()[1]),
        MGMT: str(server.management_port),
    }
    if case.sid == EXPIRED:
        target = request.getfixturevalue("short_ttl")
        with httpx.Client(timeout=60) as client:
            values[EXPIRED] = open_session(client, target.url(ROUTE), GOOD_IMAGE)
            good_sid = open_session(client, target.url(ROUTE), GOOD_IMAGE)
        time.sleep(1.6)  # past the TTL: the reaper frees it
    url = target.url(ROUTE)

    if callable(case.body):
        content = case.body()
    elif isinstance(case.body, bytes):
        content = fill(case.body.decode("latin-1"), values).encode("latin-1")
    else:
        content = fill(json.dumps(case.body), values).encode()
    headers = {"Content-Type": "application/json", **dict(case.headers)}
    if case.sid is not None:
        headers[SESSION_HEADER] = fill(case.sid, values)

    with httpx.Client(timeout=60) as client:
        started = time.monotonic()
        r = client.post(url, content=content, headers=headers)
        elapsed = time.monotonic() - started
        assert r.status_code == case.status, r.text[:500]
        if case.code is None:  # TorchServe refused the body itself, before the handler
            assert r.content == b""
        else:
            assert r.headers["content-type"].startswith("application/json")
            error = r.json()["error"]
            assert error["code"] == case.code, error
            assert error.get("field") == case.field, error
            assert error["message"] and case.says in error["message"], error
        assert elapsed < 10, f"a bad request took {elapsed:.1f} s"
        if case.sid == EXPIRED:  # the good session was idle as long: give it a fresh twin
            good_sid = open_session(client, url, GOOD_IMAGE)
        good_query(client, url, good_sid)

    with pytest.raises(BlockingIOError):  # nothing ever connected to the loopback listener
        listener.accept()


def test_json_sent_as_text_plain_or_octet_stream_is_accepted(server, sessions) -> None:
    """The Content-Type is not checked: the body must be a JSON object, however labelled."""
    url = server.url(ROUTE)
    body = json.dumps({"type": "query", "prompt": "Labelled oddly?", "max_new_tokens": 1})
    with httpx.Client(timeout=60) as client:
        for content_type in ("text/plain", "application/octet-stream", None):
            headers = {SESSION_HEADER: sessions[SHARED]}
            if content_type:
                headers["Content-Type"] = content_type
            r = client.post(url, content=body.encode(), headers=headers)
            assert r.status_code == 200, (content_type, r.text)


@pytest.mark.parametrize("url", OFFLINE_URLS)
def test_refused_urls_never_open_a_socket(url: str, monkeypatch) -> None:
    """The same references, in process, with every way to the network booby-trapped."""

    def trap(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"network touched for {url}: {args!r}")

    monkeypatch.setattr(socket, "getaddrinfo", trap)
    monkeypatch.setattr(socket, "create_connection", trap)
    monkeypatch.setattr(socket.socket, "connect", trap)
    monkeypatch.setattr(socket.socket, "connect_ex", trap)
    concrete = fill(url, {PORT: "8080", LISTENER: "9", MGMT: "8081"})
    with pytest.raises((ImageForbidden, InvalidRequest)):
        ImageLoader(ImagePolicy()).load(concrete)


# -- generated bodies against the live server -------------------------------------------------

SAFE_IMAGES = [
    GOOD_IMAGE,
    TRUNCATED_PNG,
    "!!!",
    "",
    "data:text/plain;base64,aGk=",
    "https://10.0.0.1/x.png",
    "https://[fd00:ec2::254]/",
    "http://127.0.0.1:9/x.png",
    "s3://Not_A_Bucket/x",
]
# Free text never contains "://": no generated reference can name a host to connect to.
texts = st.text(max_size=12).filter(lambda s: "://" not in s)
scalars = (
    st.none()
    | st.booleans()
    | st.integers(-3, 3)
    | st.sampled_from([2**63, -(2**63), 10**30, 1e308, float("nan"), float("inf"), 0.5, 1025])
    | texts
)
values = st.recursive(
    scalars,
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(texts, kids, max_size=2),
    max_leaves=5,
)
FIELDS = {
    "type": st.sampled_from(["open_session", "query", "close_session", "generate"]) | values,
    "image": st.sampled_from(SAFE_IMAGES) | values,
    "prompt": st.sampled_from(["What?", "", "  ", "x" * 16_001]) | values,
    "system_prompt": st.sampled_from(["Be brief.", None]) | values,
    "max_new_tokens": st.sampled_from([1, 2, 0, -1, 1025, "2", 2.5]) | values,
    "temperature": st.sampled_from([0, 0.7, 2.0, -1, 3]) | values,
    "top_p": st.sampled_from([1, 0.5, 0, 2]) | values,
    "seed": st.sampled_from([None, 0, 1, -1]) | values,
    "stream": st.booleans() | values,
    "history": st.sampled_from([True, False, [], [["q", "a"]]]) | values,
    "session_id": st.sampled_from([UNKNOWN_SID, "a_b"]) | values,
}


# Valid requests of each type (and the session they need), mutated in 0-2 fields: most of the
# generated requests get past the first check, and some are served.
LIVE_BASES = {
    "open_session": ({"type": "open_session", "image": GOOD_IMAGE}, None),
    "query": ({"type": "query", "prompt": "What?", "max_new_tokens": 2}, "fuzz"),
    "close_session": ({"type": "close_session"}, "fuzz"),
    "generate": (
        {"type": "generate", "image": GOOD_IMAGE, "prompt": "What?", "max_new_tokens": 2},
        None,
    ),
}
sid_values = st.sampled_from([None, "fuzz", NEW_SESSION, "", "a_b", UNKNOWN_SID, "x" * 300])


@st.composite
def live_requests(draw: Any) -> tuple[bytes, str, str | None]:
    base, sid = LIVE_BASES[draw(st.sampled_from(sorted(LIVE_BASES)))]
    body = dict(base)
    for _ in range(draw(st.integers(0, 2))):
        action = draw(st.sampled_from(["set", "set", "drop", "add"]))
        if action == "drop" and body:
            body.pop(draw(st.sampled_from(sorted(body))))
        elif action == "add":
            body[draw(texts)] = draw(values)
        else:
            name = draw(st.sampled_from(sorted(FIELDS)))
            body[name] = draw(FIELDS[name])
    if body.get("type") in ("query", "generate") and "max_new_tokens" not in body:
        body["max_new_tokens"] = 2  # valid answers stay short: the default is 256 tokens
    if draw(st.integers(0, 3)) == 0:
        sid = draw(sid_values)
    return json.dumps(body).encode(), "application/json", sid


raw_requests = st.tuples(
    st.binary(max_size=64),
    st.sampled_from(["application/json", "text/plain", "application/x-foo"]),
    sid_values,
)


@given(request=live_requests() | live_requests() | live_requests() | raw_requests)
@settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
def test_generated_bodies_get_a_4xx_json_error_or_a_200(server, sessions, request) -> None:
    url = server.url(ROUTE)
    content, content_type, sid = request
    headers = {"Content-Type": content_type}
    with httpx.Client(timeout=60) as client:
        if "fuzz" not in sessions:
            sessions["fuzz"] = open_session(client, url, GOOD_IMAGE)
        fuzz_sid = sessions["fuzz"]
        if sid is not None:
            headers[SESSION_HEADER] = fuzz_sid if sid == "fuzz" else sid
        r = client.post(url, content=content, headers=headers)
        assert r.status_code < 500, (content[:300], r.status_code, r.text[:300])
        event(f"HTTP {r.status_code} {r.json()['error']['code'] if r.status_code >= 400 else ''}")
        if r.status_code == 200:
            lines = r.text.strip().splitlines()
            reply = json.loads(lines[-1])
            if "session_id" in reply and "text" not in reply and "closed" not in reply:
                post(client, url, {"type": "close_session"}, reply["session_id"])  # an open
            if reply.get("closed") and reply["session_id"] == fuzz_sid:
                del sessions["fuzz"]
        else:
            error = r.json()["error"]
            assert 400 <= r.status_code < 500 and error["code"] and error["message"]
        good_query(client, url, sessions[SHARED])
