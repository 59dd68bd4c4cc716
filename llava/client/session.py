"""The session API: SessionClient opens sessions, Session asks in them, Answer holds replies."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from llava.api.headers import NEW_SESSION, NEW_SESSION_HEADER, SESSION_HEADER, STREAM_CONTENT_TYPE
from llava.client.errors import EndpointError, ErrorResponse, TransportError, error_for
from llava.client.inline import image_ref
from llava.client.lines import ndjson_lines
from llava.client.response import Response
from llava.client.transports import HttpTransport, SageMakerTransport, Transport
from llava.core.errors import KitError, SessionBusy, SessionClosed, SessionError, SessionLost

# Named for the package, as before the split, so logging configuration keeps matching.
log = logging.getLogger("llava.client")
T = TypeVar("T")

# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class Answer:
    """One whole answer: its text, the server's usage numbers, and the session it belongs to.

    `usage` holds `prefill_tokens`, `cached_tokens`, `generated_tokens`, `ttft_ms`,
    `total_ms`, `finish_reason` and `session_bytes`.
    """

    text: str
    usage: dict[str, Any]
    session_id: str

    @property
    def finish_reason(self) -> str | None:
        return self.usage.get("finish_reason")


# --------------------------------------------------------------------------- the client


class SessionClient:
    """Open sessions on a model endpoint; `session()` returns a `Session` to ask questions in.

        client = SessionClient.for_url("http://127.0.0.1:8080/predictions/llava")
        with client.session(image="https://example.com/cat.png") as s:
            print(s.ask("What is in the picture?").text)

    Use `for_endpoint("<endpoint name>")` for a SageMaker endpoint, or pass any `Transport`.
    """

    def __init__(self, transport: Transport) -> None:
        self.transport = transport

    @classmethod
    def for_url(cls, url: str, *, timeout: float = 120.0, http_client: Any = None) -> SessionClient:
        """A client for a TorchServe URL (`.../predictions/<model>` or `.../invocations`)."""
        return cls(HttpTransport(url, timeout=timeout, http_client=http_client))

    @classmethod
    def connect(cls, url: str, *, timeout: float = 120.0) -> SessionClient:
        """A client over one WebSocket to a container (`ws://host:8080`, or the socket's own
        URL): the path SageMaker's bidirectional streaming reaches. The connection holds one
        session; needs `websockets`."""
        from llava.client.sockets import SocketTransport

        return cls(SocketTransport(url, timeout=timeout))

    @classmethod
    def for_endpoint(
        cls,
        endpoint_name: str,
        region_name: str | None = None,
        runtime_client: Any = None,
        *,
        inference_component: str | None = None,
    ) -> SessionClient:
        """A client for a SageMaker endpoint through boto3's `sagemaker-runtime` client.

        With no `runtime_client`, boto3 builds one (credentials, region and
        `AWS_ENDPOINT_URL_SAGEMAKER_RUNTIME` from the usual places).
        """
        return cls(
            SageMakerTransport(
                endpoint_name,
                runtime_client,
                region_name=region_name,
                inference_component=inference_component,
            )
        )

    def session(
        self,
        image: str | os.PathLike[str] | bytes,
        system_prompt: str | None = None,
        history: list[tuple[str, str]] | None = None,
    ) -> Session:
        """Open a session on one image and return it (a context manager that closes it).

        `image` is an https:// URL, an s3:// URI, a data: URI, raw image bytes, or a local file
        path (read and sent inline, at most about 4.5 MB: send bigger images by URL).
        """
        body: dict[str, Any] = {"type": "open_session", "image": image_ref(image)}
        if system_prompt is not None:
            body["system_prompt"] = system_prompt
        if history:  # a conversation carried over: the session starts with it
            body["history"] = [list(pair) for pair in history]
        response = self._call(body, NEW_SESSION)
        obj = _json_body(response)
        value = response.header(NEW_SESSION_HEADER) or response.header(SESSION_HEADER) or ""
        sid = value.split(";", 1)[0].strip() or obj.get("session_id")
        if not sid:
            raise TransportError("the endpoint opened no session id", response=response)
        expires = obj.get("expires_at")
        if expires is None and "Expires=" in value:
            expires = value.split("Expires=", 1)[1].strip()
        return Session(self, sid, expires_at=expires)

    def resume(self, session_id: str) -> Session:
        """Take up a session kept in the endpoint's shared store (its instance went away)."""
        response = self._call({"type": "open_session", "resume": session_id}, NEW_SESSION)
        return Session(self, session_id, expires_at=_json_body(response).get("expires_at"))

    def close(self) -> None:
        """Release the transport's connections (if the client created them)."""
        close = getattr(self.transport, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> SessionClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- policy shared by sessions

    def _call(self, body: Mapping[str, Any], session_id: str | None) -> Response:
        try:
            response = self.transport.invoke(_encode(body), session_id)
        except ErrorResponse as exc:
            raise error_for(exc.response) from exc.__cause__
        if response.status >= 400:
            raise error_for(response)
        return response

    def _stream(self, body: Mapping[str, Any], session_id: str) -> Iterator[dict[str, Any]]:
        """Yield the JSON objects of a streamed answer, one per complete line."""
        try:
            yield from ndjson_lines(self.transport.invoke_stream(_encode(body), session_id))
        except ErrorResponse as exc:
            raise error_for(exc.response) from exc.__cause__


class Session:
    """One open session: ask questions about its image, stream answers, close it.

        with client.session(image="photo.png", system_prompt="Answer briefly.") as s:
            s.ask("What is in the picture?").text
            s.ask("Describe it from scratch.", history=False)   # ignores the conversation
            text = "".join(s.stream("And the colors?"))
            s.last_usage["generated_tokens"]

    Leaving the block (or `close()`, which is idempotent) closes the session on the server.
    A closed session refuses further use with `SessionClosed`. A session is meant for one
    thread at a time: the server answers a second concurrent question with `SessionBusy`.
    """

    def __init__(self, client: SessionClient, session_id: str, *, expires_at: str | None = None):
        self.client = client
        self.id = session_id
        self.expires_at = expires_at
        self.last_usage: dict[str, Any] | None = None
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"expires {self.expires_at}"
        return f"Session({self.id!r}, {state})"

    def ask(
        self,
        prompt: str,
        *,
        max_new_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        history: bool = True,
    ) -> Answer:
        """Ask one question and wait for the whole answer."""
        body = self._query(prompt, max_new_tokens, temperature, top_p, seed, history, False)
        obj = _json_body(self._call(body))
        usage = obj.get("usage") or {}
        self.last_usage = usage
        return Answer(
            text=obj.get("text", ""), usage=usage, session_id=obj.get("session_id", self.id)
        )

    def stream(
        self,
        prompt: str,
        *,
        max_new_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        history: bool = True,
    ) -> Iterator[str]:
        """Ask one question and yield the answer's text deltas as they are generated.

        `last_usage` holds the answer's usage once the stream is over. An error reported
        in the stream raises the kit's typed error.
        """
        self._check_open()
        body = self._query(prompt, max_new_tokens, temperature, top_p, seed, history, True)
        self.last_usage = None
        return self._deltas(body)

    def _deltas(self, body: dict[str, Any]) -> Iterator[str]:
        done = False
        try:
            for obj in self._opened_stream(body):
                if "error" in obj:
                    raise error_for(
                        Response(500, {"Content-Type": STREAM_CONTENT_TYPE}, _encode(obj))
                    )
                if "text" in obj:
                    if obj["text"]:
                        yield obj["text"]
                elif "usage" in obj:
                    usage = dict(obj["usage"] or {})
                    if obj.get("finish_reason") is not None:
                        usage.setdefault("finish_reason", obj["finish_reason"])
                    self.last_usage = usage
                    done = True
        except SessionError as exc:
            self._forget(exc)
            raise
        if not done:
            raise TransportError("the stream ended before its final usage line")

    def rollback(self) -> int:
        """Undo the last question and answer on the server; return the questions left. Asking
        the same question again (a regenerate) then costs only the new answer's tokens."""
        self._check_open()
        try:
            obj = _json_body(
                self._resuming(lambda: self.client._call({"type": "rollback"}, self.id))
            )
        except SessionError as exc:
            self._forget(exc)
            raise
        return int(obj.get("turns", 0))

    def close(self) -> None:
        """Close the session on the server; calling it again does nothing."""
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + 5.0
        while True:
            try:
                self.client._call({"type": "close_session"}, self.id)
                return
            except SessionBusy:  # an abandoned stream the server has not noticed yet
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
            except SessionError:  # expired, closed or unknown: gone either way
                return
            except EndpointError as exc:
                if exc.error_code == "ValidationError" and exc.status == 400:
                    return  # SageMaker's router no longer knows the id: gone too
                raise

    def __enter__(self) -> Session:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # do not hide the error that left the block
            self.close()
        except Exception as close_exc:
            log.warning("closing session %s after an error failed: %s", self.id, close_exc)

    # -- internals

    def _check_open(self) -> None:
        if self._closed:
            err = SessionClosed(
                f"session {self.id} is closed: open a new one with client.session(...)",
                field="session_id",
            )
            err.response = None  # type: ignore[attr-defined]
            raise err

    def _query(
        self,
        prompt: str,
        max_new_tokens: int | None,
        temperature: float | None,
        top_p: float | None,
        seed: int | None,
        history: bool,
        stream: bool,
    ) -> dict[str, Any]:
        body: dict[str, Any] = {"type": "query", "prompt": prompt}
        for name, value in (
            ("max_new_tokens", max_new_tokens),
            ("temperature", temperature),
            ("top_p", top_p),
            ("seed", seed),
        ):
            if value is not None:
                body[name] = value
        if stream:
            body["stream"] = True
        if not history:
            body["history"] = False
        return body

    def _call(self, body: Mapping[str, Any]) -> Response:
        self._check_open()
        try:
            return self._resuming(lambda: self.client._call(body, self.id))
        except SessionError as exc:
            self._forget(exc)
            raise

    def _opened_stream(self, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """A stream's lines, its start (where a lost session shows) made with `_resuming`."""

        def start() -> tuple[dict[str, Any] | None, Iterator[dict[str, Any]]]:
            lines = iter(self.client._stream(body, self.id))
            return next(lines, None), lines

        first, rest = self._resuming(start)
        if first is not None:
            yield first
            yield from rest

    def _resuming(self, call: Callable[[], T]) -> T:
        """Make a call; if the session was lost (`session_lost`) or the router no longer knows
        it (its instance went away: SageMaker's 400 ValidationError), resume it from the
        endpoint's shared store once and call again."""
        try:
            return call()
        except (SessionLost, EndpointError) as exc:
            forgot = (  # SageMaker's router: "Session id ... not found, closed or expired"
                isinstance(exc, EndpointError)
                and exc.error_code == "ValidationError"
                and "session" in str(exc).lower()
            )
            if isinstance(exc, EndpointError) and not (forgot and exc.status == 400):
                raise
            try:
                self.client.resume(self.id)
            except KitError:
                raise exc from None  # not in the store either: the original error stands
            log.info("session %s resumed from the endpoint's shared store", self.id)
            return call()

    def _forget(self, exc: SessionError) -> None:
        """A session the server no longer has needs no close."""
        if not isinstance(exc, SessionBusy):
            self._closed = True


def _encode(obj: Mapping[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def _json_body(response: Response) -> dict[str, Any]:
    try:
        obj = json.loads(response.body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TransportError(
            f"answer is not JSON: {response.body[:200]!r}", original=exc, response=response
        ) from exc
    if not isinstance(obj, dict):
        raise TransportError("answer is not a JSON object", response=response)
    if isinstance(obj.get("error"), dict):  # a large whole answer that failed after its head
        raise error_for(replace(response, status=max(response.status, 500)))  # went (docs/api.md)
    return obj
