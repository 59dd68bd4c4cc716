"""The Transport seam and its HTTP (httpx) and SageMaker (boto3) implementations."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

from llava.api.headers import (
    CLOSED_SESSION_HEADER,
    JSON_CONTENT_TYPE,
    NEW_SESSION_HEADER,
    SESSION_HEADER,
    STREAM_CONTENT_TYPE,
)
from llava.client.errors import EndpointError, ErrorResponse, TransportError
from llava.client.response import Response
from llava.core.errors import KitError


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
