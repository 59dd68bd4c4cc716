"""Sessions over SageMaker's WebSocket (`/invocations-bidirectional-stream`), on each front that
serves them (`socket_front`): one connection, one session; frames are the session API's bodies
and replies, errors carry HTTP's codes; a closed connection leaves the session to be taken up
by id. Driven by a real WebSocket client (`websockets`) and the kit's own
`SessionClient.connect`."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from engine_under_test import assert_reused, oracle
from helpers import Reference, ask, data_uri, make_image, open_session
from websockets.sync.client import ClientConnection, connect

from llava.api.headers import SESSION_HEADER, SOCKET_PATH
from llava.client import SessionClient

pytestmark = pytest.mark.integration
PROMPTS = ["What is in the picture?", "And what else?", "Say it again."]
TOKENS = 6


@pytest.fixture(scope="module")
def reference(tiny_checkpoint: Any) -> Reference:
    return oracle(tiny_checkpoint)


def socket_of(front: Any) -> ClientConnection:
    return connect(front.url(SOCKET_PATH).replace("http://", "ws://"), open_timeout=30)


def send(ws: ClientConnection, body: dict[str, Any]) -> list[dict[str, Any]]:
    """Send one frame; return the frames of its reply (a stream's up to its last line)."""
    ws.send(json.dumps(body))
    frames = [json.loads(ws.recv(timeout=120))]
    if body.get("stream") is True and "status" not in frames[0]:
        while not ({"usage", "error"} & frames[-1].keys()):
            frames.append(json.loads(ws.recv(timeout=120)))
    return frames


def query(prompt: str, **extra: Any) -> dict[str, Any]:
    return {"type": "query", "prompt": prompt, "max_new_tokens": TOKENS, **extra}


@pytest.fixture()
def ws(socket_front: Any) -> Iterator[ClientConnection]:
    with socket_of(socket_front) as connection:
        yield connection


def test_a_conversation_over_one_socket_answers_as_the_pipeline(
    ws: ClientConnection, reference: Reference
) -> None:
    pic = make_image(700)
    [opened] = send(ws, {"type": "open_session", "image": data_uri(pic)})
    assert opened["session_id"] and "status" not in opened, opened
    [first] = send(ws, query(PROMPTS[0]))
    streamed = send(ws, query(PROMPTS[1], stream=True))
    assert len(streamed) >= 2 and "usage" in streamed[-1], streamed
    expected = reference.answers(pic, PROMPTS[:2], TOKENS)
    assert [first["text"], "".join(f.get("text", "") for f in streamed)] == expected
    assert_reused(first["usage"], streamed[-1]["usage"])  # the session's state, not a replay
    [rolled] = send(ws, {"type": "rollback"})
    assert rolled["rolled_back"] is True, rolled
    [again] = send(ws, query(PROMPTS[2]))
    assert again["text"] == reference.answers(pic, [PROMPTS[0], PROMPTS[2]], TOKENS)[1]
    [closed] = send(ws, {"type": "close_session"})
    assert closed["closed"] is True
    [after] = send(ws, query(PROMPTS[0]))  # the connection holds no session now
    assert after["status"] == 400 and after["error"]["field"] == "session_id", after


def test_errors_come_as_frames_with_http_s_codes_and_the_socket_keeps_serving(
    ws: ClientConnection, socket_front: Any
) -> None:
    ws.send("not json")
    bad = json.loads(ws.recv(timeout=30))
    assert (bad["status"], bad["error"]["code"]) == (400, "invalid_request"), bad
    url = socket_front.url("/invocations")
    with httpx.Client(timeout=60) as http:  # a session that was closed, and HTTP's answer
        gone = open_session(http, url, data_uri(make_image(705)))
        http.post(url, json={"type": "close_session"}, headers={SESSION_HEADER: gone})
        r = http.post(url, json=query("Hello?"), headers={SESSION_HEADER: gone})
    [unknown] = send(ws, query("Hello?", session_id=gone))
    assert r.status_code >= 400
    assert (unknown["status"], unknown["error"]["code"]) == (
        r.status_code,
        r.json()["error"]["code"],
    )
    [no_image] = send(ws, {"type": "open_session", "image": "https://10.0.0.1/x.png"})
    assert no_image["status"] == 400 and no_image["error"]["code"].startswith("image"), no_image
    [opened] = send(ws, {"type": "open_session", "image": data_uri(make_image(701))})
    [twice] = send(ws, {"type": "open_session", "image": data_uri(make_image(702))})
    assert twice["status"] == 400 and twice["error"]["field"] == "type", twice
    [other] = send(ws, query("Hello?", session_id=gone))
    assert other["status"] == 400 and opened["session_id"] in other["error"]["message"]
    [answered] = send(ws, query(PROMPTS[0]))
    assert answered["text"] and "status" not in answered, answered


def test_a_session_outlives_its_connection_and_is_taken_up_by_id(
    socket_front: Any, reference: Reference
) -> None:
    pic = make_image(703)
    with socket_of(socket_front) as ws:
        [opened] = send(ws, {"type": "open_session", "image": data_uri(pic)})
        [first] = send(ws, query(PROMPTS[0]))
    sid = opened["session_id"]
    with socket_of(socket_front) as ws:  # a new connection names it once, then holds it
        [second] = send(ws, query(PROMPTS[1], session_id=sid))
        [third] = send(ws, query(PROMPTS[2]))
    assert [first["text"], second["text"], third["text"]] == reference.answers(pic, PROMPTS, TOKENS)
    assert_reused(first["usage"], second["usage"])
    with httpx.Client(timeout=60) as http:  # and over HTTP, with the header
        r = http.post(
            socket_front.url("/invocations"),
            json={"type": "close_session"},
            headers={SESSION_HEADER: sid},
        )
    assert r.status_code == 200, r.text


def test_the_kit_s_client_speaks_it(socket_front: Any, reference: Reference) -> None:
    pic = make_image(704)
    client = SessionClient.connect(socket_front.url())
    with client, client.session(image=data_uri(pic)) as s:
        first = s.ask(PROMPTS[0], max_new_tokens=TOKENS).text
        stream = s.stream(PROMPTS[1], max_new_tokens=TOKENS)
        second = "".join(stream)
        assert s.last_usage and s.last_usage["cached_tokens"] > 0
    assert [first, second] == reference.answers(pic, PROMPTS[:2], TOKENS)


def test_pings_are_answered_and_connections_accepted_while_answers_stream(
    socket_front: Any,
) -> None:
    """SageMaker pings every 60 s and wants a connection accepted within 250 ms: 10 of each are
    made while four sessions stream long answers (figures, not a timed pass)."""
    long = {"max_new_tokens": 400, "stream": True}
    opened = threading.Barrier(5)

    def busy(seed: int) -> int:
        with socket_of(socket_front) as ws:
            send(ws, {"type": "open_session", "image": data_uri(make_image(710 + seed))})
            opened.wait(60)
            return len(send(ws, query("Tell me everything.", **long)))

    accepted, ponged, busy_at = [], [], []
    with ThreadPoolExecutor(4) as pool, socket_of(socket_front) as ws:
        streams = [pool.submit(busy, seed) for seed in range(4)]
        opened.wait(60)
        for _ in range(10):
            busy_at.append(sum(not f.done() for f in streams))
            start = time.monotonic()
            with socket_of(socket_front):
                accepted.append(time.monotonic() - start)
            start = time.monotonic()
            assert ws.ping().wait(30)
            ponged.append(time.monotonic() - start)
        assert all(f.result() > 2 for f in streams)  # each a streamed answer of many frames
    print(
        f"\nsocket accepted in at most {max(accepted) * 1000:.0f} ms, pinged back in at most"
        f" {max(ponged) * 1000:.0f} ms, streams running: {busy_at}"
    )


def test_a_follow_up_over_the_socket_answers_as_over_http_in_fewer_bytes(
    socket_front: Any,
) -> None:
    """The same follow-up on the same picture over both: the same answer. Figures: the bytes a
    client sends for it (a client frame's header is 6 bytes up to 125 bytes of payload, 8 up to
    64 KiB: RFC 6455), and the time to its first streamed token."""
    pic = data_uri(make_image(730))
    body = query(PROMPTS[1], stream=True)
    with socket_of(socket_front) as ws:
        [opened] = send(ws, {"type": "open_session", "image": pic})
        send(ws, query(PROMPTS[0]))
        frame = json.dumps(body).encode()
        named = json.dumps({**body, "session_id": opened["session_id"]}).encode()  # the kit's
        start = time.monotonic()
        ws.send(frame.decode())
        lines = [json.loads(ws.recv(timeout=60))]
        socket_first = time.monotonic() - start
        while "usage" not in lines[-1]:
            lines.append(json.loads(ws.recv(timeout=60)))
    url = socket_front.url("/invocations")
    with httpx.Client(timeout=60) as http:
        sid = open_session(http, url, pic)
        ask(http, url, sid, PROMPTS[0], max_new_tokens=TOKENS)
        request = http.build_request("POST", url, json=body, headers={SESSION_HEADER: sid})
        head = f"POST {request.url.raw_path.decode()} HTTP/1.1\r\n" + "".join(
            f"{k}: {v}\r\n" for k, v in request.headers.items()
        )
        start = time.monotonic()
        got: list[dict[str, Any]] = []
        with http.stream("POST", url, json=body, headers={SESSION_HEADER: sid}) as r:
            for line in filter(None, r.iter_lines()):
                if not got:
                    http_first = time.monotonic() - start
                got.append(json.loads(line))
    assert "".join(x.get("text", "") for x in lines) == "".join(x.get("text", "") for x in got)
    socket_bytes = len(frame) + (6 if len(frame) < 126 else 8)
    kit_bytes = len(named) + (6 if len(named) < 126 else 8)
    http_bytes = len(head) + 2 + len(request.content)
    print(
        f"\nfollow-up bytes: socket {socket_bytes} (the kit's client, naming its session:"
        f" {kit_bytes}), HTTP {http_bytes}; first token: socket {socket_first * 1000:.0f} ms,"
        f" HTTP {http_first * 1000:.0f} ms"
    )
