"""A local SageMaker runtime: the `sagemaker-runtime` wire protocol in front of local TorchServes.

An unmodified boto3 client pointed at it (`AWS_ENDPOINT_URL_SAGEMAKER_RUNTIME`, any dummy
credentials) sees what it would see from a SageMaker endpoint with sticky sessions:

- `POST /endpoints/{name}/invocations` (`invoke_endpoint`) and
  `POST /endpoints/{name}/invocations-response-stream`
  (`invoke_endpoint_with_response_stream`, answered as AWS event-stream `PayloadPart` frames
  as the container's chunks arrive);
- sticky routing: `SessionId="NEW_SESSION"` (or none) goes to the least-loaded instance, the
  container's new-session header pins the id to that instance and comes back as
  `NewSessionId`; a known id goes to its instance; an unknown (or closed, or past its
  `Expires`) id is refused with 400 `ValidationError` before reaching any container; the
  container's closed-session header unpins the id and comes back as `ClosedSessionId`;
- streaming calls cannot open sessions (`NEW_SESSION` is outside their pattern: 400);
- a container error (status >= 400) becomes 424 `ModelError` with `OriginalStatusCode`,
  `OriginalMessage` (the container's body) and `LogStreamArn`;
- only the API's request headers reach the container (Content-Type, Accept, the session id,
  custom attributes), as SageMaker's router strips the rest;
- with `prefix_aware`, requests without a session id are routed as PREFIX_AWARE (prefix.py);
- `POST /endpoints/{name}/openai/v1/chat/completions`, the OpenAI-compatible path: a bearer
  token checked as AWS signs it (bearer.py), the container's reply relayed as it is.

    with TorchServe("model-store") as a, TorchServe("model-store") as b:
        with LocalRuntime([a.url(), b.url()], name="llava") as runtime:
            smr = boto3.client("sagemaker-runtime", endpoint_url=runtime.url, ...)
            smr.invoke_endpoint(EndpointName="llava", Body=..., SessionId="NEW_SESSION")

`python -m llava local-endpoint` starts N TorchServes and this runtime in front of them.
"""

from __future__ import annotations

import logging
import re
import sys
import threading
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote, urlsplit

import httpx

from llava.api.headers import CLOSED_SESSION_HEADER, NEW_SESSION, NEW_SESSION_HEADER, SESSION_HEADER
from llava.core.params import MAX_BODY_BYTES
from llava.fronts.local_runtime.bearer import check_bearer
from llava.fronts.local_runtime.prefix import PREFIX_AWARE_ID_HEADER, PrefixAware
from llava.fronts.local_runtime.replies import Replies, common_headers, send
from llava.fronts.local_runtime.router import Refusal, StickyRouter, check_session_id
from llava.fronts.local_runtime.wire import (
    InstanceGone,
    container_frames,
    is_draining,
    read_body,
    write_chunk,
)

log = logging.getLogger(__name__)

EVENTSTREAM_CONTENT_TYPE = "application/vnd.amazon.eventstream"
CUSTOM_ATTRIBUTES_HEADER = "X-Amzn-SageMaker-Custom-Attributes"
_PATH = re.compile(
    r"/endpoints/([^/]+)/(invocations|invocations-response-stream|openai/v1/chat/completions)"
)
OPENAI = "openai/v1/chat/completions"
# Where the container takes a chat sent to the OpenAI-compatible path: on for every endpoint,
# whose containers need serve only /invocations (docs/sagemaker.md says what is verified).
OPENAI_CONTAINER_PATH = "/invocations"


class LocalRuntime:
    """Serve the sagemaker-runtime API for one endpoint backed by local container URLs.

    `instances` are base URLs of TorchServes (or any container answering `POST /invocations`).
    `routes` shows the sticky routing table (session id -> instance index).

        runtime = LocalRuntime(["http://127.0.0.1:8080", "http://127.0.0.1:8180"]).start()
        print(runtime.url)     # AWS_ENDPOINT_URL_SAGEMAKER_RUNTIME
        runtime.stop()
    """

    def __init__(
        self,
        instances: Sequence[str],
        *,
        name: str = "llava",
        host: str = "127.0.0.1",
        port: int = 0,
        region: str = "us-east-1",
        account: str = "000000000000",
        timeout_s: float = 60.0,
        enforce_expiry: bool = True,
        prefix_aware: PrefixAware | None = None,
        credentials: Mapping[str, str] | None = None,
    ) -> None:
        if not instances:
            raise ValueError("need at least one container instance")
        self.instances = [url.rstrip("/") for url in instances]
        self.name = name
        self.host = host
        self.region = region
        self.account = account
        self.enforce_expiry = enforce_expiry
        self.prefix_aware = prefix_aware
        # Access key -> secret: what bearer tokens on the OpenAI path must be signed with.
        self.credentials = dict(credentials or {"local": "local"})
        self.replies = Replies(name, region, account)
        self._requested_port = port
        self.router = StickyRouter(len(self.instances), name, enforce_expiry=enforce_expiry)
        n = 8 * len(self.instances) + 8
        self._http = httpx.Client(
            timeout=httpx.Timeout(timeout_s, connect=5.0),
            limits=httpx.Limits(max_connections=n, max_keepalive_connections=n),
        )
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("not started")
        return self._server.server_address[1]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> LocalRuntime:
        """Bind and serve in a background thread."""
        self._server = _Server((self.host, self._requested_port), _Handler)
        self._server.runtime = self
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="local-sagemaker-runtime", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the connections to the containers."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._http.close()

    def __enter__(self) -> LocalRuntime:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def routes(self) -> dict[str, int]:
        """A copy of the sticky routing table: session id -> instance index."""
        return self.router.routes

    def replace(self, index: int, url: str) -> None:
        """Put a new instance in place `index` (a deployment update replacing an instance):
        its sessions resume from the shared store on whichever instance they reach."""
        self.instances[index] = url.rstrip("/")
        self.router.up(index)

    # -- one request

    def _handle(self, h: _Handler) -> None:
        read, openai = False, urlsplit(h.path).path.endswith("/" + OPENAI)
        try:
            operation = self._operation(h)
            body, read = read_body(h, MAX_BODY_BYTES), True
            streaming = operation == "invocations-response-stream"
            sid = h.headers.get(SESSION_HEADER) if operation != OPENAI else None
            sid = sid.strip() if sid is not None else None
            check_session_id(sid, streaming)
            target = None if sid is None or sid == NEW_SESSION else sid
            index = self.router.lookup(target) if target else self._pick(h, body, operation)
            headers = self._forward_headers(h, streaming, operation == OPENAI)
            tried: set[int] = set()
            while True:  # an instance that is gone or draining: the next one takes it
                base = self.instances[index]
                try:
                    with self.router.in_flight(index):
                        if operation == OPENAI:
                            self._relay(h, base + OPENAI_CONTAINER_PATH, body, headers)
                        elif streaming:
                            self._stream(h, base + "/invocations", body, headers)
                        else:
                            url = base + "/invocations"
                            self._invoke(h, url, body, headers, index, target is None)
                    return
                except InstanceGone:
                    tried.add(index)
                    self.router.down(index)
                    if len(tried) == len(self.instances):
                        raise self.replies.unreachable(ConnectionError("every instance")) from None
                    index = self.router.move(target, index, frozenset(tried))
        except Refusal as refusal:
            h.close_connection = h.close_connection or not read  # its body was left unread
            self.replies.refuse(h, refusal, openai=openai)
        except (BrokenPipeError, ConnectionResetError):
            h.close_connection = True
        except Exception as exc:  # a bug here: answer like the service would, keep serving
            log.exception("local runtime failed on %s", h.path)
            h.close_connection = True
            failure = Refusal(500, "InternalFailure", f"{type(exc).__name__}: {exc}")
            self.replies.refuse(h, failure, openai=openai)

    def _operation(self, h: _Handler) -> str:
        """The operation a request calls, its path, credentials and endpoint checked (in AWS's
        order: a caller without a token learns nothing) before its body is read."""
        match = _PATH.fullmatch(urlsplit(h.path).path)
        if match is None:
            raise Refusal(404, "UnknownOperationException", f"no operation at {h.path}")
        name, operation = unquote(match.group(1)), match.group(2)
        if operation == OPENAI:
            now = datetime.now(timezone.utc)
            check_bearer(h.headers.get("Authorization"), self.region, self.credentials, now)
        if name != self.name:
            raise Refusal(
                400, "ValidationError", f"Endpoint {name} of account {self.account} not found."
            )
        return operation

    def _pick(self, h: _Handler, body: bytes, operation: str) -> int:
        """The instance for a request without a session: by its prefix where the endpoint routes
        prefix-aware (a body's bytes; an OpenAI chat's text), else the least busy."""
        if self.prefix_aware is None:
            return self.router.pick()
        aware_id = h.headers.get(PREFIX_AWARE_ID_HEADER)
        chain = self.prefix_aware.chain(body, aware_id, chat=operation == OPENAI)
        return self.router.pick_by_prefix(chain, self.prefix_aware.concurrency_threshold)

    @staticmethod
    def _forward_headers(h: _Handler, streaming: bool, openai: bool) -> dict[str, str]:
        """Only the API's own request headers reach the container (on the OpenAI path, whose
        docs name no session, only the body's type)."""
        out = {"Content-Type": h.headers.get("Content-Type") or "application/octet-stream"}
        accept = h.headers.get("X-Amzn-SageMaker-Accept" if streaming else "Accept")
        if accept:
            out["Accept"] = accept
        for name in () if openai else (SESSION_HEADER, CUSTOM_ATTRIBUTES_HEADER):
            value = h.headers.get(name)
            if value is not None:
                out[name] = value.strip()
        return out

    def _invoke(
        self,
        h: _Handler,
        url: str,
        body: bytes,
        headers: dict[str, str],
        index: int,
        opening: bool,
    ) -> None:
        try:
            r = self._http.post(url, content=body, headers=headers)
        except httpx.HTTPError as exc:
            raise self._gone_or_unreachable(url, exc) from exc
        if is_draining(r.status_code, r.content):
            raise InstanceGone()
        if r.status_code >= 400:
            self.replies.model_error(h, r.status_code, r.content)
            return
        out = {"Content-Type": r.headers.get("Content-Type", "application/json")}
        new = r.headers.get(NEW_SESSION_HEADER)
        if new is None and ";" in r.headers.get(SESSION_HEADER, ""):  # the AWS sample's form
            new = r.headers[SESSION_HEADER]
        if new:
            if opening:
                self.router.pin(new, index)
                out[NEW_SESSION_HEADER] = new.strip()
            else:
                log.warning("instance %d sent a new session id on a session request", index)
        closed = r.headers.get(CLOSED_SESSION_HEADER)
        if closed:
            self.router.unpin(closed.strip(), index)
            out[CLOSED_SESSION_HEADER] = closed.strip()
        if CUSTOM_ATTRIBUTES_HEADER in r.headers:
            out[CUSTOM_ATTRIBUTES_HEADER] = r.headers[CUSTOM_ATTRIBUTES_HEADER]
        send(h, 200, out, r.content)

    def _stream(self, h: _Handler, url: str, body: bytes, headers: dict[str, str]) -> None:
        r = self._open_stream(url, body, headers)
        try:
            if r.status_code >= 400:
                r.read()
                if is_draining(r.status_code, r.content):
                    raise InstanceGone()
                self.replies.model_error(h, r.status_code, r.content)
                return
            h.send_response(200)
            common_headers(h)
            h.send_header("Content-Type", EVENTSTREAM_CONTENT_TYPE)
            h.send_header(
                "X-Amzn-SageMaker-Content-Type",
                r.headers.get("Content-Type", "application/octet-stream"),
            )
            h.send_header("Transfer-Encoding", "chunked")
            h.end_headers()
            for frame in container_frames(r):
                write_chunk(h, frame)
            write_chunk(h, b"")
        except (BrokenPipeError, ConnectionResetError):
            h.close_connection = True  # the client went away: closing `r` tells the container
        finally:
            r.close()

    def _relay(self, h: _Handler, url: str, body: bytes, headers: dict[str, str]) -> None:
        """The OpenAI path: the container's reply as is, status and body (server-sent events
        relayed as they arrive), as SageMaker returns it."""
        r = self._open_stream(url, body, headers)
        try:
            if r.status_code == 503:
                r.read()
                if is_draining(r.status_code, r.content):
                    raise InstanceGone()
            h.send_response(r.status_code)
            common_headers(h)
            h.send_header("Content-Type", r.headers.get("Content-Type", "application/json"))
            h.send_header("Transfer-Encoding", "chunked")
            h.end_headers()
            if r.is_stream_consumed:
                write_chunk(h, r.content)
            else:
                for chunk in r.iter_raw():
                    if chunk:
                        write_chunk(h, chunk)
            write_chunk(h, b"")
        except httpx.HTTPError:
            h.close_connection = True  # the container broke off: so does the reply
        except (BrokenPipeError, ConnectionResetError):
            h.close_connection = True  # the client went away: closing `r` tells the container
        finally:
            r.close()

    def _open_stream(self, url: str, body: bytes, headers: dict[str, str]) -> httpx.Response:
        """Send a request to a container and return its reply unread (streamed)."""
        request = self._http.build_request("POST", url, content=body, headers=headers)
        try:
            return self._http.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise self._gone_or_unreachable(url, exc) from exc

    def _gone_or_unreachable(self, url: str, exc: httpx.HTTPError) -> Exception:
        """An instance that refused the connection, or dropped it and no longer answers /ping,
        is gone (its sessions go elsewhere); any other failure is the container's."""
        if isinstance(exc, httpx.ConnectError) or (
            isinstance(exc, (httpx.NetworkError, httpx.RemoteProtocolError))
            and not isinstance(exc, httpx.TimeoutException)
            and not self._answers_ping(url.rsplit("/", 1)[0])
        ):
            return InstanceGone()
        return self.replies.unreachable(exc)

    def _answers_ping(self, base: str) -> bool:
        try:
            return self._http.get(base + "/ping", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    runtime: LocalRuntime

    def handle_error(self, request: Any, client_address: Any) -> None:
        """Log a client that went away in one line, not as a traceback on stderr."""
        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, TimeoutError)):
            log.debug("client %s went away: %s", client_address, exc)
        else:
            log.exception("error serving %s", client_address)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "LocalSageMakerRuntime/0.1"
    server: _Server

    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        self.server.runtime._handle(self)

    def do_GET(self) -> None:  # noqa: N802
        if urlsplit(self.path).path == "/ping":
            send(self, 200, {"Content-Type": "text/plain"}, b"")
            return
        refusal = Refusal(404, "UnknownOperationException", f"no operation at {self.path}")
        self.server.runtime.replies.refuse(self, refusal)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        log.debug("%s %s", self.address_string(), format % args)


# --------------------------------------------------------------------------- the command
