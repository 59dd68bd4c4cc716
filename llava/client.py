"""The session client: open a session on one image, ask about it, close it.

Policy lives in `SessionClient` and `Session` (request bodies, session ids, line buffering of
streamed answers, error mapping); bytes move through a `Transport` behind one seam:
`HttpTransport` talks to TorchServe (or any `/invocations` URL) with httpx, `SageMakerTransport`
to a SageMaker endpoint through boto3's `sagemaker-runtime` client.

    from llava.client import SessionClient

    client = SessionClient.for_url("http://127.0.0.1:8080/predictions/llava")
    # or: SessionClient.for_endpoint("llava")   (boto3; AWS_ENDPOINT_URL_SAGEMAKER_RUNTIME works)
    with client.session(image="examples/sample.png") as s:
        answer = s.ask("What is in the picture?", max_new_tokens=64)
        print(answer.text, answer.usage["generated_tokens"])
        for delta in s.stream("And the colors?"):
            print(delta, end="", flush=True)
        print(s.last_usage)
    # leaving the block closed the session

Errors are the kit's own (`llava.errors`): a container's JSON error body becomes the same typed
error on every transport (`SessionExpired`, `SessionBusy`, `CapacityExceeded` with
`retry_after_s`, ...), SageMaker's `ModelError` wrapper included. Failures of the way there are
`TransportError` (no usable answer: connection refused, timeout, unreadable stream) and its
subclass `EndpointError` (the endpoint itself refused: SageMaker's `ValidationError`,
`ModelNotReadyException`, `ServiceUnavailable`, an unknown session id at the router).
Every error raised here carries `err.response` (a `Response`, or None when nothing came back).

    KitError (llava.errors)
    └── TransportError (502 transport_error)       .original: the underlying exception
        └── EndpointError (endpoint_error)         .error_code: e.g. "ValidationError"
"""

from __future__ import annotations

import base64
import json
import logging
import mimetypes
import os
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from llava.errors import (
    CapacityExceeded,
    ImageTooLarge,
    KitError,
    SessionBusy,
    SessionClosed,
    SessionError,
    from_body,
)
from llava.protocol import (
    CLOSED_SESSION_HEADER,
    JSON_CONTENT_TYPE,
    MAX_BODY_BYTES,
    NEW_SESSION,
    NEW_SESSION_HEADER,
    SESSION_HEADER,
    STREAM_CONTENT_TYPE,
    header,
)

log = logging.getLogger(__name__)

# A base64 image inside the JSON body must keep the body under SageMaker's 6 MiB: base64 grows
# bytes by 4/3, and the envelope needs a little room (about 4.5 MB of raw image).
MAX_INLINE_IMAGE_BYTES = (MAX_BODY_BYTES - 4096) // 4 * 3
_URL_PREFIXES = ("https://", "http://", "s3://", "data:")
_IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".gif", ".webp", ".bmp", ".tif", ".tiff")


# --------------------------------------------------------------------------- errors


class TransportError(KitError):
    """No usable answer came back: the connection failed, timed out, or the stream broke.

    `original` is the underlying exception (httpx, botocore), `response` what came back if any.
    """

    status, code = 502, "transport_error"

    def __init__(
        self,
        message: str,
        *,
        original: BaseException | None = None,
        response: Response | None = None,
        **details: Any,
    ) -> None:
        super().__init__(message, **details)
        self.original = original
        self.response = response


class EndpointError(TransportError):
    """The endpoint itself refused the request before (or instead of) the model answering.

    On SageMaker: `ValidationError` (400, e.g. an unknown session id or endpoint),
    `ModelNotReadyException` (429), `ServiceUnavailable` (503), `InternalFailure` (500),
    `ModelStreamError` / `InternalStreamFailure` in a stream. `error_code` is that name and
    `status` the HTTP status of the refusal.
    """

    code = "endpoint_error"

    def __init__(
        self,
        message: str,
        *,
        error_code: str = "",
        status: int | None = None,
        original: BaseException | None = None,
        response: Response | None = None,
    ) -> None:
        super().__init__(message, original=original, response=response)
        self.error_code = error_code
        if status is not None:
            self.status = status


class ErrorResponse(Exception):
    """Raised by `Transport.invoke_stream` when the answer is an error status, not a stream.

    The client turns `response` into the typed error, as it does for `invoke`.
    """

    def __init__(self, response: Response) -> None:
        super().__init__(f"HTTP {response.status}")
        self.response = response


def error_for(response: Response) -> KitError:
    """Rebuild the kit's typed error from an error response (status and JSON body)."""
    try:
        body: Any = json.loads(response.body) if response.body else None
    except (UnicodeDecodeError, json.JSONDecodeError):
        body = response.body.decode("utf-8", "replace")
    err = from_body(response.status, body)
    if type(err) is KitError:
        err.status = response.status
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, CapacityExceeded) and "retry_after_s" not in (error or {}):
        retry = header(response.headers, "Retry-After")
        if retry and retry.isdigit():
            err.retry_after_s = err.details["retry_after_s"] = int(retry)
    err.response = response  # type: ignore[attr-defined]
    return err


# --------------------------------------------------------------------------- transports


@dataclass
class Response:
    """One whole answer as the transport saw it: status, headers and body bytes.

    `raw` is the transport's own object (an `httpx.Response`, boto3's response dict, or the
    botocore exception a SageMaker `ModelError` came in).
    """

    status: int
    headers: Mapping[str, str]
    body: bytes
    raw: Any = field(default=None, repr=False)

    def header(self, name: str) -> str | None:
        """Look a header up case-insensitively."""
        return header(self.headers, name)


@runtime_checkable
class Transport(Protocol):
    """Move one request body to the model and its answer back.

    `session_id` is the value of the SageMaker session header: `NEW_SESSION` to open, the id
    after, None to send none. `invoke_stream` yields raw byte chunks with arbitrary boundaries
    and raises `ErrorResponse` when the answer is an error rather than a stream. Failures of the
    way there raise `TransportError`. A `close()` method, if any, is called by
    `SessionClient.close()`.
    """

    def invoke(self, body: bytes, session_id: str | None) -> Response: ...

    def invoke_stream(self, body: bytes, session_id: str | None) -> Iterator[bytes]: ...


class HttpTransport:
    """Talk to TorchServe (`/predictions/<model>` or `/invocations`) over HTTP with httpx.

    The session id travels in the `X-Amzn-SageMaker-Session-Id` header, as on SageMaker:

        transport = HttpTransport("http://127.0.0.1:8080/predictions/llava", timeout=60)
    """

    def __init__(self, url: str, *, timeout: float = 120.0, http_client: Any = None) -> None:
        import httpx

        self.url = url
        self._own = http_client is None
        self._http = http_client or httpx.Client(timeout=timeout)

    def _headers(self, session_id: str | None, accept: str) -> dict[str, str]:
        headers = {"Content-Type": JSON_CONTENT_TYPE, "Accept": accept}
        if session_id is not None:
            headers[SESSION_HEADER] = session_id
        return headers

    def invoke(self, body: bytes, session_id: str | None) -> Response:
        import httpx

        try:
            r = self._http.post(
                self.url, content=body, headers=self._headers(session_id, JSON_CONTENT_TYPE)
            )
        except httpx.HTTPError as exc:
            raise TransportError(f"{self.url}: {exc}", original=exc) from exc
        return Response(r.status_code, dict(r.headers), r.content, raw=r)

    def invoke_stream(self, body: bytes, session_id: str | None) -> Iterator[bytes]:
        import httpx

        try:
            with self._http.stream(
                "POST",
                self.url,
                content=body,
                headers=self._headers(session_id, STREAM_CONTENT_TYPE),
            ) as r:
                if r.status_code >= 400:
                    r.read()
                    raise ErrorResponse(Response(r.status_code, dict(r.headers), r.content, r))
                yield from r.iter_raw()
        except httpx.HTTPError as exc:
            raise TransportError(f"{self.url}: {exc}", original=exc) from exc

    def close(self) -> None:
        if self._own:
            self._http.close()


class SageMakerTransport:
    """Talk to a SageMaker endpoint through boto3's `sagemaker-runtime` client.

    `invoke_endpoint(..., SessionId=...)` carries whole answers (its `NewSessionId` and
    `ClosedSessionId` come back as the usual session headers); streamed answers come from
    `invoke_endpoint_with_response_stream`, whose `PayloadPart` bytes are yielded as they arrive.
    A container error arrives wrapped in botocore's `ModelError` (HTTP 424): its
    `OriginalStatusCode` and `OriginalMessage` are unwrapped back into the container's answer.

        transport = SageMakerTransport("llava", region_name="us-east-1")
    """

    def __init__(
        self,
        endpoint_name: str,
        runtime_client: Any = None,
        *,
        region_name: str | None = None,
        inference_component: str | None = None,
    ) -> None:
        if runtime_client is None:
            import boto3

            runtime_client = boto3.client("sagemaker-runtime", region_name=region_name)
        self.endpoint_name = endpoint_name
        self.runtime = runtime_client
        self.inference_component = inference_component

    def _kwargs(self, body: bytes, session_id: str | None, accept: str) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "EndpointName": self.endpoint_name,
            "Body": body,
            "ContentType": JSON_CONTENT_TYPE,
            "Accept": accept,
        }
        if session_id is not None:
            kwargs["SessionId"] = session_id
        if self.inference_component:
            kwargs["InferenceComponentName"] = self.inference_component
        return kwargs

    def invoke(self, body: bytes, session_id: str | None) -> Response:
        try:
            out = self.runtime.invoke_endpoint(**self._kwargs(body, session_id, JSON_CONTENT_TYPE))
        except Exception as exc:
            raise self._translate(exc) from exc
        meta = out.get("ResponseMetadata", {})
        headers = dict(meta.get("HTTPHeaders", {}))
        for name, key in (
            ("Content-Type", "ContentType"),
            (NEW_SESSION_HEADER, "NewSessionId"),
            (CLOSED_SESSION_HEADER, "ClosedSessionId"),
        ):
            if out.get(key) is not None:
                headers[name] = out[key]
        payload = out.get("Body", b"")
        try:
            data = payload if isinstance(payload, bytes) else payload.read()
        except Exception as exc:
            raise TransportError(f"reading the answer body: {exc}", original=exc) from exc
        return Response(int(meta.get("HTTPStatusCode", 200)), headers, data, raw=out)

    def invoke_stream(self, body: bytes, session_id: str | None) -> Iterator[bytes]:
        try:
            out = self.runtime.invoke_endpoint_with_response_stream(
                **self._kwargs(body, session_id, STREAM_CONTENT_TYPE)
            )
        except Exception as exc:
            raise self._translate(exc) from exc
        events = out["Body"]
        try:
            for event in events:
                if "PayloadPart" in event:
                    data = event["PayloadPart"].get("Bytes")
                    if data:
                        yield data
                    continue
                for name in ("ModelStreamError", "InternalStreamFailure"):
                    if name in event:  # modeled as exceptions; tolerate them as plain events
                        info = event[name] or {}
                        raise EndpointError(
                            f"{name}: {info.get('Message', '')}",
                            error_code=info.get("ErrorCode") or name,
                            status=424 if name == "ModelStreamError" else 500,
                        )
        except KitError:
            raise
        except Exception as exc:
            raise self._translate(exc) from exc
        finally:
            close = getattr(events, "close", None)
            if close is not None:
                close()

    def _translate(self, exc: Exception) -> Exception:
        """Turn a botocore exception into the container's answer or a transport error."""
        from botocore.exceptions import BotoCoreError, ClientError

        if isinstance(exc, ClientError):
            parsed = exc.response or {}
            error = parsed.get("Error", {})
            code = error.get("Code", "")
            meta = parsed.get("ResponseMetadata", {})
            status = int(meta.get("HTTPStatusCode") or 0) or None
            if code == "ModelError" and parsed.get("OriginalStatusCode"):
                original = parsed.get("OriginalMessage") or ""
                response = Response(
                    int(parsed["OriginalStatusCode"]),
                    {"Content-Type": JSON_CONTENT_TYPE},
                    original.encode(),
                    raw=exc,
                )
                return ErrorResponse(response)
            response = Response(status or 0, dict(meta.get("HTTPHeaders", {})), b"", raw=parsed)
            return EndpointError(
                f"{code or 'error'}: {error.get('Message', '')}",
                error_code=code,
                status=status,
                original=exc,
                response=response,
            )
        if isinstance(exc, BotoCoreError):
            return TransportError(str(exc), original=exc)
        return exc


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
        self, image: str | os.PathLike[str] | bytes, system_prompt: str | None = None
    ) -> Session:
        """Open a session on one image and return it (a context manager that closes it).

        `image` is an https:// URL, an s3:// URI, a data: URI, raw image bytes, or a local file
        path (read and sent inline, at most about 4.5 MB: send bigger images by URL).
        """
        body: dict[str, Any] = {"type": "open_session", "image": image_ref(image)}
        if system_prompt is not None:
            body["system_prompt"] = system_prompt
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
            for obj in self.client._stream(body, self.id):
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
            return self.client._call(body, self.id)
        except SessionError as exc:
            self._forget(exc)
            raise

    def _forget(self, exc: SessionError) -> None:
        """A session the server no longer has needs no close."""
        if not isinstance(exc, SessionBusy):
            self._closed = True


# --------------------------------------------------------------------------- helpers


def ndjson_lines(chunks: Iterable[bytes]) -> Iterator[dict[str, Any]]:
    """Reassemble newline-delimited JSON objects from byte chunks with arbitrary boundaries."""
    buffer = b""
    for chunk in chunks:
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            if line.strip():
                yield _parse_line(line)
    if buffer.strip():
        yield _parse_line(buffer)


def _parse_line(line: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TransportError(f"unreadable stream line {line[:200]!r}: {exc}") from exc
    if not isinstance(obj, dict):
        raise TransportError(f"stream line is not a JSON object: {line[:200]!r}")
    return obj


def image_ref(image: str | os.PathLike[str] | bytes) -> str:
    """Turn a URL, a data: URI, raw bytes or a local file path into the request's `image`."""
    if isinstance(image, (bytes, bytearray)):
        return _data_uri(bytes(image), None)
    if isinstance(image, str) and image.startswith(_URL_PREFIXES):
        return image
    path = Path(image)
    try:
        is_file = path.is_file()
    except (OSError, ValueError):  # a long base64 string is no path
        is_file = False
    if is_file:
        size = path.stat().st_size
        if size > MAX_INLINE_IMAGE_BYTES:
            raise _too_large(size, str(path))
        return _data_uri(path.read_bytes(), path.name)
    if str(image).lower().endswith(_IMAGE_SUFFIXES):
        raise FileNotFoundError(f"image file not found: {image}")
    return str(image)  # base64 or another form: the server validates it


def _data_uri(data: bytes, name: str | None) -> str:
    if len(data) > MAX_INLINE_IMAGE_BYTES:
        raise _too_large(len(data), name or "image")
    mime = _sniff(data) or (mimetypes.guess_type(name)[0] if name else None)
    return f"data:{mime or 'application/octet-stream'};base64,{base64.b64encode(data).decode()}"


def _too_large(size: int, what: str) -> ImageTooLarge:
    return ImageTooLarge(
        f"{what} is {size} bytes; inline images must stay under {MAX_INLINE_IMAGE_BYTES} bytes "
        "(SageMaker's 6 MiB body limit with base64): upload it and pass an https:// URL or an "
        "s3:// URI instead",
        field="image",
    )


def _sniff(data: bytes) -> str | None:
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "image/png"
    if data.startswith(b"\xff\xd8\xff"):
        return "image/jpeg"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "image/gif"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    if data.startswith(b"BM"):
        return "image/bmp"
    return None


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
    return obj
