"""The session API end to end on each real front (TorchServe, Ray Serve): statuses, headers,
bodies, and answers."""

from __future__ import annotations

import json
import re
import time
from datetime import datetime, timezone

import pytest
from engine_under_test import assert_reused, oracle
from helpers import ask, data_uri, make_image, open_session, post

from llava.api.headers import CLOSED_SESSION_HEADER, NEW_SESSION, NEW_SESSION_HEADER, SESSION_HEADER
from llava.fronts.torchserve.handler import EARLY_HEAD_BYTES
from llava.fronts.torchserve.launcher import TorchServe

pytestmark = pytest.mark.integration

EXPIRES = re.compile(
    r"^((?:r\d+x[a-z0-9]+-)?[0-9a-f]{40}); Expires=(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ)$"
)
ROUTES = ["/predictions/llava", "/invocations"]


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    return oracle(tiny_checkpoint)


# Long enough that the opening fills whole blocks of vLLM's prefix cache (32 tokens on a CPU),
# so what each turn reuses shows on both engines.
BRIEF = (
    "You are a careful assistant. Look at the picture the user sends, describe what you see "
    "in it plainly and briefly, and say so when you are not sure of something in it."
)


@pytest.mark.parametrize("route", ROUTES)
def test_open_query_follow_up_close(front, client, route):
    url = front.url(route)
    r = post(
        client,
        url,
        {"type": "open_session", "image": data_uri(make_image(1)), "system_prompt": BRIEF},
        **{SESSION_HEADER: NEW_SESSION},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    sid = body["session_id"]
    for name in (NEW_SESSION_HEADER, SESSION_HEADER):
        match = EXPIRES.match(r.headers[name])
        assert match and match.group(1) == sid and match.group(2) == body["expires_at"]
    expires = datetime.strptime(body["expires_at"], "%Y-%m-%dT%H:%M:%SZ").replace(
        tzinfo=timezone.utc
    )
    assert 1100 < expires.timestamp() - time.time() <= 1201  # the 20-minute default TTL

    first = ask(client, url, sid, "What is in the picture?", max_new_tokens=8)
    assert first["session_id"] == sid and first["text"]
    usage = first["usage"]
    assert usage["generated_tokens"] >= 1 and usage["cached_tokens"] > 16  # image tokens reused
    assert usage["ttft_ms"] <= usage["total_ms"]

    second = ask(client, url, sid, "And what else?", max_new_tokens=8)
    assert_reused(usage, second["usage"])  # the first turn is cached

    r = post(client, url, {"type": "close_session"}, sid)
    assert r.status_code == 200 and r.headers[CLOSED_SESSION_HEADER] == sid
    assert r.json() == {"session_id": sid, "closed": True, "success": True}

    r = post(client, url, {"type": "query", "prompt": "Still there?"}, sid)
    assert r.status_code == 400 and r.json()["error"]["code"] == "session_closed"


def test_missing_session_header_also_opens(front, client):
    sid = open_session(client, front.url("/invocations"), data_uri(make_image(2)))
    assert re.fullmatch(r"(r\d+x[a-z0-9]+-)?[0-9a-f]{40}", sid)
    post(client, front.url("/invocations"), {"type": "close_session"}, sid)


@pytest.mark.parametrize(
    ("body", "sid", "status", "code"),
    [
        (
            {"type": "query", "prompt": "hi"},
            "0123456789abcdef0123456789abcdef01234567",
            400,
            "session_not_found",
        ),
        ({"type": "close_session"}, "nope", 400, "session_not_found"),
        ({"type": "query", "prompt": "hi"}, None, 400, "invalid_request"),
        ({"type": "query", "prompt": "hi"}, "bad_id.with_dots", 400, "invalid_request"),
        ({"type": "dance"}, None, 400, "invalid_request"),
        ({"type": "open_session", "image": " "}, None, 400, "invalid_request"),
        (
            {"type": "open_session", "image": "data:image/png;base64,AAAA"},
            None,
            400,
            "invalid_image",
        ),
        ({"type": "query", "prompt": "hi", "temperature": -1}, "abc", 400, "invalid_request"),
    ],
)
def test_bad_requests_get_a_4xx_json_error_and_the_server_keeps_serving(
    front, client, reference, body, sid, status, code
):
    url = front.url("/predictions/llava")
    r = post(client, url, body, sid)
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == code
    sid = open_session(client, url, data_uri(make_image(3)))
    # still serving, and serving right: the answer is the pipeline's
    assert (
        ask(client, url, sid, "ok?", max_new_tokens=2)["text"]
        == reference.answers(make_image(3), ["ok?"], 2)[0]
    )


def test_body_that_is_not_json_is_a_400(front, client):
    r = client.post(
        front.url("/predictions/llava"),
        content=b"{not json",
        headers={"Content-Type": "application/json"},
    )
    assert r.status_code == 400 and r.json()["error"]["field"] == "body"


def test_streaming_sends_deltas_then_usage(front, client, reference):
    url = front.url("/invocations")
    image = make_image(13)
    sid = open_session(client, url, data_uri(image))
    body = {"type": "query", "prompt": "Tell me more.", "max_new_tokens": 16, "stream": True}
    with client.stream("POST", url, json=body, headers={SESSION_HEADER: sid}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("application/x-ndjson")
        lines = [line for line in r.iter_lines() if line]
    events = [json.loads(line) for line in lines]
    assert "usage" in events[-1] and all("text" in e for e in events[:-1])
    assert len(events) > 2  # really streamed in pieces
    text = "".join(e["text"] for e in events[:-1])
    assert text == reference.answers(image, ["Tell me more."], 16)[0]
    assert events[-1]["usage"]["generated_tokens"] >= 1


def test_a_large_whole_answer_is_the_same_answer(front, client, reference):
    """A whole answer to a request of 64 KiB or more (a chat carrying pictures) comes chunked on
    TorchServe, its head sent with its first token (tests/unit/test_handler.py holds when its
    body stops being re-sent); the answer it gets is the one a small request gets."""
    url = front.url("/invocations")
    image = make_image(16)
    question = {"type": "query", "prompt": "Tell me more.", "max_new_tokens": 16}
    replies = []
    for padding in (0, EARLY_HEAD_BYTES):  # JSON's whitespace, in place of a picture's bytes
        sid = open_session(client, url, data_uri(image))
        content = json.dumps(question).encode() + b" " * padding
        headers = {"Content-Type": "application/json", SESSION_HEADER: sid}
        replies.append(client.post(url, content=content, headers=headers))
    small, large = replies
    assert small.status_code == large.status_code == 200, large.text
    assert small.json()["text"] == large.json()["text"]
    assert small.json()["text"] == reference.answers(image, ["Tell me more."], 16)[0]
    assert "content-length" in small.headers
    if isinstance(front, TorchServe):
        assert large.headers.get("transfer-encoding") == "chunked"  # its head went out early


def test_a_long_stream_arrives_piece_by_piece(front, client):
    """Chunks reach the client as they are generated, not all at the end."""
    url = front.url("/predictions/llava")
    sid = open_session(client, url, data_uri(make_image(15)))
    body = {
        "type": "query",
        "prompt": "Go on.",
        "max_new_tokens": 200,
        "temperature": 2.0,
        "seed": 5,
        "stream": True,
    }
    arrivals = []
    started = time.perf_counter()
    with client.stream("POST", url, json=body, headers={SESSION_HEADER: sid}) as r:
        for line in r.iter_lines():
            if line:
                arrivals.append(time.perf_counter() - started)
    assert len(arrivals) > 20
    assert arrivals[0] < arrivals[-1] / 4  # the first piece came long before the last


def test_generate_answers_without_a_session(front, client, reference):
    url = front.url("/predictions/llava")
    image = make_image(14)
    r = post(
        client,
        url,
        {
            "type": "generate",
            "image": data_uri(image),
            "prompt": "What is this?",
            "max_new_tokens": 10,
        },
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert "session_id" not in body and NEW_SESSION_HEADER not in r.headers
    assert body["text"] == reference.answers(image, ["What is this?"], 10)[0]
    assert body["usage"]["cached_tokens"] == 0
    r = post(
        client,
        url,
        {
            "type": "generate",
            "image": data_uri(image),
            "prompt": "And?",
            "history": [["What is this?", body["text"]]],
            "stream": True,
        },
    )
    assert r.status_code == 200 and r.text.strip().splitlines()[-1].startswith('{"usage"')
