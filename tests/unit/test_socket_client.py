"""The client's WebSocket transport against a real WebSocket server (websockets') that answers
as a scripted front: a reply that comes after the client gave up on it is never read as the next
request's, and a streamed answer left unread is read out before the next request goes."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from websockets.sync.server import ServerConnection, serve

from llava.client import SessionClient, TransportError
from llava.client.sockets import socket_url

Script = Callable[[dict[str, Any], ServerConnection], None]


@pytest.fixture()
def server() -> Iterator[Callable[[Script], str]]:
    """`server(script)`: a WebSocket server on loopback calling `script(frame, connection)` for
    each frame; returns its URL."""
    servers: list[Any] = []

    def start(script: Script) -> str:
        def handler(connection: ServerConnection) -> None:
            for text in connection:
                script(json.loads(text), connection)

        running = serve(handler, "127.0.0.1", 0)
        servers.append(running)
        threading.Thread(target=running.serve_forever, daemon=True).start()
        return f"ws://127.0.0.1:{running.socket.getsockname()[1]}"

    yield start
    for running in servers:
        running.shutdown()


def test_a_late_reply_is_never_taken_for_the_next_one(server: Callable[[Script], str]) -> None:
    release = threading.Event()

    def script(frame: dict[str, Any], connection: ServerConnection) -> None:
        if frame["type"] == "open_session":
            connection.send(json.dumps({"session_id": "s-1"}))
        elif frame["prompt"] == "slow":
            release.wait(30)  # answered after the client's timeout
            connection.send(json.dumps({"text": "the slow one's answer"}))
        else:
            connection.send(json.dumps({"text": "the next one's answer"}))

    client = SessionClient.connect(server(script), timeout=0.5)
    session = client.session(image="data:image/png;base64,AA==")
    with pytest.raises(TransportError):
        session.ask("slow")
    release.set()
    with pytest.raises(TransportError, match="connect again"):
        session.ask("next")
    client.close()


def test_a_stream_left_unread_is_read_out_first(server: Callable[[Script], str]) -> None:
    def script(frame: dict[str, Any], connection: ServerConnection) -> None:
        if frame["type"] == "open_session":
            connection.send(json.dumps({"session_id": "s-1"}))
        elif frame.get("stream"):
            for word in ("a", "b", "c"):
                connection.send(json.dumps({"text": word}))
            connection.send(json.dumps({"usage": {"generated_tokens": 3}}))
        else:
            assert frame["session_id"] == "s-1"
            connection.send(json.dumps({"text": "whole"}))

    client = SessionClient.connect(server(script))
    with client, client.session(image="data:image/png;base64,AA==") as session:
        deltas = session.stream("go")
        assert next(deltas) == "a"
        deltas.close()  # the caller stopped reading
        assert session.ask("again").text == "whole"


def test_error_frames_become_the_kits_errors(server: Callable[[Script], str]) -> None:
    from llava.core.errors import SessionExpired

    def script(frame: dict[str, Any], connection: ServerConnection) -> None:
        if frame["type"] == "open_session":
            connection.send(json.dumps({"session_id": "s-1"}))
        else:
            error = {"code": "session_expired", "message": "expired", "field": None}
            connection.send(json.dumps({"error": error, "status": 400}))

    client = SessionClient.connect(server(script))
    with client:
        session = client.session(image="data:image/png;base64,AA==")
        with pytest.raises(SessionExpired):
            session.ask("hello?")


def test_urls_name_the_socket() -> None:
    assert socket_url("http://h:8080") == "ws://h:8080/invocations-bidirectional-stream"
    assert socket_url("https://h/") == "wss://h/invocations-bidirectional-stream"
    assert socket_url("ws://h:1/elsewhere") == "ws://h:1/elsewhere"
    with pytest.raises(ValueError):
        socket_url("ftp://h")
