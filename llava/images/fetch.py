"""Fetch http(s) images over pinned, vetted connections: redirects, deadlines, byte limit."""

from __future__ import annotations

import ssl
import threading
import time
from collections.abc import Iterable
from typing import Any

import httpcore
import httpx

from llava.core.errors import ImageFetchError, ImageForbidden, InvalidRequest
from llava.images.limits import READ_CHUNK, read_limited, too_many_bytes
from llava.images.policy import ImagePolicy, host_allow_listed, parse_ip, vet_address
from llava.images.refs import INLINE_HINT, clean_text, describe_ref
from llava.images.resolve import Resolver, resolve_host

_MAX_URL_CHARS = 8192
_USER_AGENT = "llava-sessions-image-loader/0.1"


def _clamp(timeout: float | None, deadline: float, exc: type[Exception]) -> float:
    """Shrink a per-operation timeout to what is left of the overall deadline."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise exc("the total deadline for fetching the image passed")
    return remaining if timeout is None else min(timeout, remaining)


class _DeadlineStream(httpcore.NetworkStream):
    """Network stream whose every read and write also respects the fetch deadline."""

    def __init__(self, inner: httpcore.NetworkStream, deadline: float) -> None:
        self._inner = inner
        self._deadline = deadline

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        """Read up to `max_bytes`, giving up at the deadline."""
        return self._inner.read(max_bytes, _clamp(timeout, self._deadline, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        """Write `buffer`, giving up at the deadline."""
        self._inner.write(buffer, _clamp(timeout, self._deadline, httpcore.WriteTimeout))

    def close(self) -> None:
        """Close the underlying stream."""
        self._inner.close()

    def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> httpcore.NetworkStream:
        """Upgrade to TLS, verifying the certificate against the URL's host name."""
        # httpcore passes the URL host here, not the pinned IP we connected to, so the
        # certificate is still checked against the name the client asked for.
        timeout = _clamp(timeout, self._deadline, httpcore.ConnectTimeout)
        tls = self._inner.start_tls(ssl_context, server_hostname, timeout)
        return _DeadlineStream(tls, self._deadline)

    def get_extra_info(self, info: str) -> Any:
        """Delegate connection details (TLS object, readability) to the inner stream."""
        return self._inner.get_extra_info(info)


class _PinnedBackend(httpcore.NetworkBackend):
    """Resolve a host, vet every address, and connect to a vetted address, never re-resolving."""

    def __init__(self, policy: ImagePolicy, resolver: Resolver, deadline: float) -> None:
        self._policy = policy
        self._resolver = resolver
        self._deadline = deadline
        self._inner = httpcore.SyncBackend()

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.NetworkStream:
        """Connect to `host` through an address that passed the policy."""
        addresses = resolve_host(self._resolver, host, port, self._deadline)
        if not host_allow_listed(host, self._policy):
            # All of them, not just the first: a host answering one public and one private
            # address could otherwise steer a retry onto the private one.
            for address in addresses:
                vet_address(address, self._policy, host)
        error: Exception | None = None
        for address in addresses:
            try:
                stream = self._inner.connect_tcp(
                    address,
                    port,
                    timeout=_clamp(timeout, self._deadline, httpcore.ConnectTimeout),
                    local_address=local_address,
                    socket_options=socket_options,
                )
            except httpcore.ConnectError as exc:
                error = exc
                continue
            return _DeadlineStream(stream, self._deadline)
        raise error or httpcore.ConnectError(f"no address to connect to for {host}")

    def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.NetworkStream:
        """Refuse unix sockets: image URLs only ever reach TCP hosts."""
        raise httpcore.ConnectError("unix sockets are not used for image fetches")

    def sleep(self, seconds: float) -> None:
        """Sleep between retries (none are configured)."""
        time.sleep(seconds)


class _PinnedTransport(httpx.HTTPTransport):
    """httpx transport whose connections all go through a `_PinnedBackend`."""

    def __init__(self, backend: _PinnedBackend, ssl_context: ssl.SSLContext) -> None:
        super().__init__(verify=ssl_context, trust_env=False)
        # httpx has no public hook for an httpcore network backend, so the pool it built is
        # swapped for one that uses ours (httpx is pinned <1 in pyproject for this reason).
        self._pool = httpcore.ConnectionPool(
            ssl_context=ssl_context,
            network_backend=backend,
            max_connections=4,
            retries=0,
        )


def _failure(exc: Exception) -> str:
    """Say in a few words why a fetch failed, without echoing server-controlled text."""
    if "CERTIFICATE_VERIFY_FAILED" in str(exc):
        return "its TLS certificate did not verify"
    if isinstance(exc, httpx.ConnectError):
        return "could not connect"
    if isinstance(exc, httpx.ProtocolError):
        return "the server broke the HTTP protocol"
    return f"transfer failed ({type(exc).__name__})"


class HttpFetch:
    """ImageLoader's http(s) half: vet URLs, follow redirects by hand, read within limits."""

    policy: ImagePolicy
    _resolver: Resolver
    _transport: httpx.BaseTransport | None
    _lock: threading.Lock
    _ssl_context: ssl.SSLContext | None

    def _parse_url(self, text: str) -> httpx.URL:
        """Parse a URL from a request or a redirect."""
        if len(text) > _MAX_URL_CHARS:
            raise InvalidRequest(f"image URL is longer than {_MAX_URL_CHARS} characters")
        try:
            return httpx.URL(text)
        except (httpx.InvalidURL, ValueError, TypeError):
            raise InvalidRequest(
                f"image URL {describe_ref(text)} is malformed; check the URL"
            ) from None

    def _vet_url(self, url: httpx.URL, deadline: float, hop: int) -> None:
        """Check scheme, credentials and (when pinning is unavailable) addresses of a URL."""
        where = describe_ref(str(url))
        scheme = url.scheme
        if scheme == "http" and not self.policy.allow_http:
            raise ImageForbidden(
                f"plain http image URLs are disabled ({where}); use https or {INLINE_HINT}"
            )
        if scheme not in ("http", "https"):
            what = "redirected to" if hop else "got"
            raise InvalidRequest(
                f"image fetch {what} unsupported scheme {clean_text(scheme, 16)!r}"
            )
        if not url.raw_host:
            raise InvalidRequest(f"image URL {where} has no host")
        if url.userinfo:
            raise InvalidRequest(
                f"image URL {where} contains credentials; image URLs must not carry them"
            )
        host = url.raw_host.decode("ascii")
        if host_allow_listed(host, self.policy):
            return
        if parse_ip(host) is not None:
            # Literal addresses are refused before any connection is attempted.
            vet_address(host, self.policy, host)
        elif self._transport is not None:
            # A caller-supplied transport does its own connecting, so the best we can do
            # is vet what the name resolves to now (no pinning against DNS rebinding).
            port = url.port or (443 if scheme == "https" else 80)
            for address in resolve_host(self._resolver, host, port, deadline):
                vet_address(address, self.policy, host)

    def _client(self, deadline: float) -> tuple[httpx.Client, bool]:
        """Build the client for one fetch; say whether we own (and must close) its transport."""
        headers = {
            "User-Agent": _USER_AGENT,
            "Accept": "image/*",
            # Compressed bodies would be inflated outside our byte accounting.
            "Accept-Encoding": "identity",
        }
        transport = self._transport
        owned = transport is None
        if transport is None:
            backend = _PinnedBackend(self.policy, self._resolver, deadline)
            transport = _PinnedTransport(backend, self._tls_context())
        client = httpx.Client(
            transport=transport, headers=headers, follow_redirects=False, trust_env=False
        )
        return client, owned

    def _tls_context(self) -> ssl.SSLContext:
        """Return the shared certificate-verifying TLS context, creating it on first use."""
        with self._lock:
            if self._ssl_context is None:
                self._ssl_context = httpx.create_ssl_context()
            return self._ssl_context

    def _timeouts(self, deadline: float, where: str) -> httpx.Timeout:
        """Return per-request timeouts clipped to what is left of the deadline."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise self._timed_out(where)
        connect = min(self.policy.connect_timeout_s, remaining)
        read = min(self.policy.read_timeout_s, remaining)
        return httpx.Timeout(connect=connect, read=read, write=read, pool=connect)

    def _timed_out(self, where: str) -> ImageFetchError:
        """Build the error for a fetch that ran out of time."""
        p = self.policy
        return ImageFetchError(
            f"timed out fetching image from {where} (limits: connect {p.connect_timeout_s}s, "
            f"read {p.read_timeout_s}s, total {p.total_timeout_s}s); "
            f"use a faster host or {INLINE_HINT}"
        )

    def _fetch_url(self, text: str) -> bytes:
        """Download an http(s) image, following and re-vetting redirects by hand."""
        deadline = time.monotonic() + self.policy.total_timeout_s
        url = self._parse_url(text)
        where = describe_ref(text)
        client, owned = self._client(deadline)
        try:
            for hop in range(self.policy.max_redirects + 1):
                self._vet_url(url, deadline, hop)
                where = describe_ref(str(url))
                timeout = self._timeouts(deadline, where)
                with client.stream("GET", url, timeout=timeout) as response:
                    if response.has_redirect_location:
                        url = self._parse_url(str(url.join(response.headers["location"])))
                        continue
                    return self._read_response(response, deadline, where)
            raise ImageFetchError(
                f"image URL {describe_ref(text)} redirected more than "
                f"{self.policy.max_redirects} times; link to the final image URL"
            )
        except (httpx.TimeoutException, httpcore.TimeoutException):
            raise self._timed_out(where) from None
        except (httpx.HTTPError, httpx.InvalidURL, httpx.StreamError, ssl.SSLError) as exc:
            raise ImageFetchError(
                f"could not fetch image from {where}: {_failure(exc)}; check that the URL is "
                f"reachable over https with a valid certificate, or {INLINE_HINT}"
            ) from exc
        finally:
            if owned:
                client.close()

    def _read_response(self, response: httpx.Response, deadline: float, where: str) -> bytes:
        """Check a final response and read its body within the byte limit."""
        if not 200 <= response.status_code < 300:
            raise ImageFetchError(
                f"image URL {where} answered HTTP {response.status_code}; check that the URL "
                "is correct and publicly readable",
                upstream_status=response.status_code,
            )
        encoding = response.headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            raise ImageFetchError(
                f"image URL {where} sent a {clean_text(encoding, 20)!r}-encoded body although "
                f"identity was requested; serve the image uncompressed or {INLINE_HINT}"
            )
        declared = response.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.policy.max_bytes:
            raise too_many_bytes(f"image at {where}", self.policy.max_bytes)
        return read_limited(
            response.iter_bytes(READ_CHUNK), self.policy.max_bytes, deadline, f"image at {where}"
        )
