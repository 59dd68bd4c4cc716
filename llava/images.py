"""Turn image references from requests into normalized RGB images, safely.

This module is the kit's security boundary for images: a request may name an image by
https URL, s3://bucket/key, data: URI or raw base64, and everything about that reference is
hostile until proven otherwise.

- URLs: only https (http if the policy allows). Every address a host resolves to is vetted
  (loopback, private, link-local, multicast, reserved, shared, cloud metadata, and IPv6 forms
  that embed those are refused) on every redirect hop, and the connection goes to the vetted
  address itself, so DNS cannot answer differently between the check and the connect. TLS is
  still verified against the host name. Redirects are followed by hand and re-vetted.
- Limits: connect/read timeouts plus one deadline for the whole fetch; a byte limit enforced
  while streaming; a pixel limit checked from the image header before anything is decoded.
- Content is identified from its bytes, never from Content-Type, and only common raster
  formats are parsed.

This layer is pure: no torch or transformers; boto3 is imported only when s3:// is used.
"""

from __future__ import annotations

import base64
import binascii
import functools
import io
import ipaddress
import math
import re
import socket
import ssl
import threading
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import httpcore
import httpx
from PIL import Image, ImageOps

from llava.errors import (
    ImageError,
    ImageFetchError,
    ImageForbidden,
    ImageTooLarge,
    InvalidRequest,
    KitError,
)

__all__ = ["ImageLoader", "ImagePolicy", "check_address", "describe_ref"]

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
Resolver = Callable[[str, int], list[str]]

_CHUNK = 64 * 1024
_MAX_URL_CHARS = 8192
_USER_AGENT = "llava-sessions-image-loader/0.1"
_HINT = "send the image inline as base64 instead"
# Formats worth accepting from strangers; Pillow's exotic plugins (EPS shells out to
# Ghostscript, others are rarely exercised) stay out of reach.
_WANTED_FORMATS = ("PNG", "JPEG", "MPO", "GIF", "WEBP", "BMP", "TIFF", "AVIF")
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]{0,31}):")
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_WARNINGS_LOCK = threading.Lock()


@dataclass(frozen=True)
class ImagePolicy:
    """Limits and address rules for loading images named in requests."""

    allow_http: bool = False
    allow_hosts: tuple[str, ...] = ()
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 10.0
    total_timeout_s: float = 20.0
    max_bytes: int = 20 * 1024 * 1024
    max_pixels: int = 40_000_000
    max_redirects: int = 3
    allow_s3: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.allow_hosts, str):
            raise InvalidRequest(
                "ImagePolicy.allow_hosts must be a tuple of host names or CIDRs, not one "
                f"string; write ({self.allow_hosts!r},)",
                field="allow_hosts",
            )
        # Accept any iterable (e.g. a list from YAML) but store a tuple so policies hash.
        object.__setattr__(self, "allow_hosts", tuple(self.allow_hosts))
        _allow_list(self.allow_hosts)
        for name in ("connect_timeout_s", "read_timeout_s", "total_timeout_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise InvalidRequest(f"ImagePolicy.{name} must be a positive number of seconds")
        for name, low in (("max_bytes", 1), ("max_pixels", 1), ("max_redirects", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or value < low:
                raise InvalidRequest(f"ImagePolicy.{name} must be an integer >= {low}")

    @property
    def allowed_schemes(self) -> frozenset[str]:
        """Return the reference schemes this policy accepts ("base64" meaning bare base64)."""
        schemes = {"https", "data", "base64"}
        if self.allow_http:
            schemes.add("http")
        if self.allow_s3:
            schemes.add("s3")
        return frozenset(schemes)


# --- address policy -----------------------------------------------------------------------

_METADATA = frozenset(
    ipaddress.ip_address(a)
    for a in (
        "169.254.169.254",  # AWS/GCP/Azure instance metadata
        "169.254.170.2",  # ECS task metadata and credentials
        "169.254.170.23",  # EKS pod identity agent
        "fd00:ec2::254",  # AWS instance metadata over IPv6
        "fd00:ec2::23",  # EKS pod identity agent over IPv6
        "100.100.100.200",  # Alibaba Cloud metadata
        "192.0.0.192",  # Oracle Cloud metadata
    )
)

# Spelled out rather than left to `ipaddress` flags, whose meaning shifts between Python
# versions (e.g. 192.0.0.0/24 and multicast count as "global" on some of them).
_BLOCKED_NETWORKS: tuple[tuple[IPNetwork, str], ...] = tuple(
    (ipaddress.ip_network(net), reason)
    for net, reason in (
        ("0.0.0.0/8", "unspecified"),
        ("10.0.0.0/8", "private"),
        ("100.64.0.0/10", "shared (carrier-grade NAT)"),
        ("127.0.0.0/8", "loopback"),
        ("169.254.0.0/16", "link-local"),
        ("172.16.0.0/12", "private"),
        ("192.0.0.0/24", "reserved"),
        ("192.0.2.0/24", "reserved"),
        ("192.168.0.0/16", "private"),
        ("198.18.0.0/15", "reserved"),
        ("198.51.100.0/24", "reserved"),
        ("203.0.113.0/24", "reserved"),
        ("224.0.0.0/4", "multicast"),
        ("240.0.0.0/4", "reserved"),
        ("::/128", "unspecified"),
        ("::1/128", "loopback"),
        ("64:ff9b:1::/48", "private"),
        ("100::/64", "reserved"),
        ("2001::/23", "reserved"),
        ("2001:db8::/32", "reserved"),
        ("fc00::/7", "private"),
        ("fe80::/10", "link-local"),
        ("fec0::/10", "site-local"),
        ("ff00::/8", "multicast"),
    )
)

_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_IPV4_COMPAT = ipaddress.ip_network("::/96")


@dataclass(frozen=True)
class _AllowList:
    hosts: frozenset[str]
    networks: tuple[IPNetwork, ...]


@functools.lru_cache(maxsize=64)
def _allow_list(entries: tuple[str, ...]) -> _AllowList:
    """Split allow_hosts into host names and networks, refusing entries that are neither."""
    hosts: set[str] = set()
    networks: list[IPNetwork] = []
    for entry in entries:
        if not isinstance(entry, str) or not entry.strip():
            raise InvalidRequest(
                f"ImagePolicy.allow_hosts entry {entry!r} must be a host name or CIDR",
                field="allow_hosts",
            )
        text = entry.strip()
        try:
            networks.append(ipaddress.ip_network(text, strict=False))
            continue
        except ValueError:
            pass
        if "/" in text or ":" in text or "@" in text:
            raise InvalidRequest(
                f"ImagePolicy.allow_hosts entry {entry!r} is neither a host name nor a CIDR; "
                "write e.g. 'images.example.com' or '10.0.0.0/8'",
                field="allow_hosts",
            )
        hosts.add(_normalize_host(text))
    return _AllowList(frozenset(hosts), tuple(networks))


def _normalize_host(host: str) -> str:
    """Lower-case a host and drop IPv6 brackets and a trailing root dot."""
    return host.strip().strip("[]").rstrip(".").lower()


def _parse_ip(ip: str) -> IPAddress | None:
    """Parse an address, dropping any IPv6 zone id; None if it is not an IP address."""
    try:
        return ipaddress.ip_address(ip.strip().strip("[]").split("%", 1)[0])
    except ValueError:
        return None


def _embedded_ipv4(addr: ipaddress.IPv6Address) -> tuple[ipaddress.IPv4Address, bool] | None:
    """Return the IPv4 address an IPv6 form carries, and whether it *is* that IPv4 host."""
    if addr.ipv4_mapped is not None:
        return addr.ipv4_mapped, True
    packed_tail = ipaddress.IPv4Address(addr.packed[-4:])
    if addr in _NAT64:
        return packed_tail, True
    if addr in _IPV4_COMPAT and int(addr) > 1:
        return packed_tail, True
    if addr.sixtofour is not None:
        return addr.sixtofour, False
    if addr.teredo is not None:
        return addr.teredo[1], False
    return None


def _blocked_reason(addr: IPAddress) -> str | None:
    """Name the class of a non-public address, or None for a public one."""
    if isinstance(addr, ipaddress.IPv6Address):
        embedded = _embedded_ipv4(addr)
        if embedded is not None:
            v4, same_host = embedded
            reason = _blocked_reason(v4)
            if reason is not None or same_host:
                # A mapped/NAT64 form reaches exactly that IPv4 host: judge it as one.
                return None if reason is None else f"{reason} (embedded in IPv6)"
    if addr in _METADATA:
        return "cloud metadata"
    for network, reason in _BLOCKED_NETWORKS:
        if addr.version == network.version and addr in network:
            return reason
    flags = (
        ("unspecified", addr.is_unspecified),
        ("loopback", addr.is_loopback),
        ("link-local", addr.is_link_local),
        ("multicast", addr.is_multicast),
        ("private", addr.is_private),
        ("reserved", addr.is_reserved),
        ("non-public", not addr.is_global),
    )
    return next((reason for reason, hit in flags if hit), None)


def _address_allow_listed(addr: IPAddress, allow: _AllowList) -> bool:
    """Tell whether an address (or the IPv4 host its IPv6 form maps to) is allow-listed."""
    candidates: list[IPAddress] = [addr]
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        candidates.append(addr.ipv4_mapped)
    return any(c.version == net.version and c in net for c in candidates for net in allow.networks)


def _vet_address(ip: str, policy: ImagePolicy, host: str | None) -> None:
    """Raise ImageForbidden unless `ip` is public or allow-listed; name `host` if given."""
    addr = _parse_ip(ip)
    where = f"image host {host!r}" if host else "address"
    if addr is None:
        raise ImageForbidden(f"{where} did not resolve to an IP address ({ip!r}); {_HINT}")
    if _address_allow_listed(addr, _allow_list(policy.allow_hosts)):
        return
    reason = _blocked_reason(addr)
    if reason is not None:
        # The address itself stays out of the message: echoing internal DNS answers back
        # to a client would turn this check into a network-mapping oracle.
        target = f"{where} resolves to a" if host else "address is a"
        raise ImageForbidden(
            f"{target} {reason} address, which image URLs may not reach; use a publicly "
            f"reachable URL or {_HINT}"
        )


def check_address(ip: str, policy: ImagePolicy) -> None:
    """Raise ImageForbidden unless the image fetcher may connect to `ip` under `policy`."""
    _vet_address(ip, policy, None)


def _host_allow_listed(host: str, policy: ImagePolicy) -> bool:
    """Tell whether a URL host name is allow-listed by name."""
    return _normalize_host(host) in _allow_list(policy.allow_hosts).hosts


def _system_resolver(host: str, port: int) -> list[str]:
    """Resolve a host to its TCP addresses with the system resolver, in preference order."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def _resolve(resolver: Resolver, host: str, port: int, deadline: float) -> list[str]:
    """Resolve `host` within the deadline; an IP literal resolves to itself."""
    if _parse_ip(host) is not None:
        return [host.strip("[]")]
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["addresses"] = list(resolver(host, port))
        except BaseException as exc:  # handed to the waiting thread, which re-raises it
            box["error"] = exc

    # getaddrinfo cannot be interrupted and may take far longer than our deadline, so it
    # runs in a daemon thread that we simply stop waiting for.
    worker = threading.Thread(target=run, name="image-dns", daemon=True)
    worker.start()
    worker.join(max(0.0, deadline - time.monotonic()))
    if worker.is_alive():
        raise httpcore.ConnectTimeout(f"resolving {host} did not finish before the deadline")
    error = box.get("error")
    if isinstance(error, KitError):
        raise error
    if isinstance(error, OSError):
        raise ImageFetchError(
            f"could not resolve image host {host!r}; check the URL or {_HINT}"
        ) from None
    if error is not None:
        raise error
    addresses = [str(a) for a in box.get("addresses") or []]
    if not addresses:
        raise ImageFetchError(f"image host {host!r} has no addresses; check the URL or {_HINT}")
    if any(_parse_ip(a) is None for a in addresses):
        # Connecting to a name would let the OS resolve it again, behind our back.
        raise ImageFetchError(f"resolving image host {host!r} gave something not an IP address")
    return addresses


# --- pinned network backend -----------------------------------------------------------------


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
        addresses = _resolve(self._resolver, host, port, self._deadline)
        if not _host_allow_listed(host, self._policy):
            # All of them, not just the first: a host answering one public and one private
            # address could otherwise steer a retry onto the private one.
            for address in addresses:
                _vet_address(address, self._policy, host)
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


# --- reference parsing ------------------------------------------------------------------------


def _scheme_of(ref: str) -> str | None:
    """Return the lower-cased scheme of a reference, or None for bare base64."""
    # Base64 never contains ':', so anything with a scheme-shaped prefix is a URI.
    match = _SCHEME.match(ref)
    return match.group(1).lower() if match else None


def _clean(text: str, limit: int) -> str:
    """Keep only characters that are safe in a log line, and at most `limit` of them."""
    return re.sub(r"[^A-Za-z0-9.\-_:\[\]+/]", "", text[: limit * 4])[:limit]


def describe_ref(ref: str) -> str:
    """Describe an image reference for logs: scheme and host only, never path, query or data."""
    if not isinstance(ref, str):
        return "<non-string image reference>"
    text = ref.strip()
    if not text:
        return "<empty image reference>"
    scheme = _scheme_of(text)
    if scheme is None:
        return f"base64 ({len(text)} chars)"
    if scheme == "data":
        media = text[5:69].split(",", 1)[0].split(";", 1)[0]
        return f"data:{_clean(media, 32)} ({len(text)} chars)"
    if scheme in ("http", "https", "s3"):
        rest = text[len(scheme) + 1 : len(scheme) + 1 + 512].lstrip("/\\")
        authority = re.split(r"[/?#\\]", rest, maxsplit=1)[0]
        host = _clean(authority.rpartition("@")[2].lower(), 60) or "<no host>"
        return f"{scheme}://{host}"[:80]
    return f"{_clean(scheme, 32)}: reference (unsupported scheme)"


def _b64_limit(max_bytes: int) -> int:
    """Return the longest base64 text that can decode to at most `max_bytes`."""
    return 4 * ((max_bytes + 2) // 3)


def _decode_base64(text: str, max_bytes: int) -> bytes:
    """Decode standard or URL-safe base64 (whitespace and missing padding tolerated)."""
    limit = _b64_limit(max_bytes)
    # Two cheap bounds: the raw text (whitespace included) and the compacted payload.
    if len(text) > 2 * limit + 1024:
        raise _too_many_bytes("inline image", max_bytes)
    compact = "".join(text.split())
    if len(compact) > limit:
        raise _too_many_bytes("inline image", max_bytes)
    compact = compact.translate(str.maketrans("-_", "+/"))
    compact += "=" * (-len(compact) % 4)
    try:
        data = base64.b64decode(compact, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError(
            "image is not valid base64; send standard base64 of the image file's bytes, "
            "optionally as data:image/png;base64,..."
        ) from None
    if not data:
        raise ImageError("image data is empty; send the bytes of a PNG, JPEG, GIF or WebP file")
    if len(data) > max_bytes:
        raise _too_many_bytes("inline image", max_bytes)
    return data


def _decode_data_uri(ref: str, max_bytes: int) -> bytes:
    """Decode a `data:image/...;base64,` URI."""
    header, comma, payload = ref[5:].partition(",")
    if not comma or len(header) > 256:
        raise InvalidRequest("malformed data URI; write it as data:image/png;base64,<base64 bytes>")
    media, *params = (part.strip().lower() for part in header.split(";"))
    if not media.startswith("image/"):
        raise InvalidRequest(
            f"data URI has media type {_clean(media, 40)!r}; only image/* data URIs are accepted"
        )
    if "base64" not in params:
        raise InvalidRequest(
            "data URI is not base64-encoded; write it as data:image/png;base64,<base64 bytes>"
        )
    return _decode_base64(payload, max_bytes)


def _too_many_bytes(what: str, max_bytes: int) -> ImageTooLarge:
    """Build the error for an image over the byte limit."""
    return ImageTooLarge(
        f"{what} is larger than the {max_bytes}-byte limit; send a smaller or more "
        "compressed image",
        max_bytes=max_bytes,
    )


def _read_limited(chunks: Iterable[bytes], max_bytes: int, deadline: float, what: str) -> bytes:
    """Collect chunks, aborting as soon as they pass `max_bytes` or the deadline."""
    buffer = bytearray()
    for chunk in chunks:
        buffer += chunk
        if len(buffer) > max_bytes:
            raise _too_many_bytes(what, max_bytes)
        if time.monotonic() > deadline:
            raise ImageFetchError(
                f"fetching {what} did not finish within the total deadline; use a faster "
                f"host or {_HINT}"
            )
    return bytes(buffer)


# --- decoding and normalization -----------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _formats() -> tuple[str, ...]:
    """Return the accepted formats this Pillow build can actually open."""
    Image.init()
    return tuple(f for f in _WANTED_FORMATS if f in Image.OPEN)


def _open(data: bytes) -> Image.Image:
    """Open image bytes lazily (header only), mapping Pillow's failures to kit errors."""
    try:
        # Pillow only *warns* between 1x and 2x its bomb limit; make that band an error here
        # without touching Pillow's global limit. catch_warnings swaps process-wide state, so
        # our threads take turns; the section only parses a header, so the lock is brief.
        with _WARNINGS_LOCK, warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            return Image.open(io.BytesIO(data), formats=list(_formats()))
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise ImageTooLarge(
            "image dimensions exceed the decompression-bomb limit; send a smaller image"
        ) from None
    except Image.UnidentifiedImageError:
        raise ImageError(
            "data is not a supported image (PNG, JPEG, GIF, WebP, BMP or TIFF); check that "
            "the reference points at an image file"
        ) from None


def _check_pixels(size: tuple[int, int], max_pixels: int) -> None:
    """Refuse empty images and images over the pixel budget, using header dimensions."""
    width, height = size
    if width < 1 or height < 1:
        raise ImageError(f"image has no pixels ({width}x{height}); send a non-empty image")
    if width * height > max_pixels:
        raise ImageTooLarge(
            f"image is {width}x{height} = {width * height} pixels, over the {max_pixels}-pixel "
            "limit; downscale it before sending",
            max_pixels=max_pixels,
        )


def _upright(img: Image.Image) -> Image.Image:
    """Apply the EXIF orientation tag, if any."""
    try:
        return ImageOps.exif_transpose(img)
    except Exception:  # noqa: BLE001 - corrupt EXIF should not sink an otherwise good image
        return img


def _to_8bit(img: Image.Image) -> Image.Image:
    """Map 16-bit integer and float grayscale to 8-bit "L", keeping relative brightness."""
    wide = img.convert("I") if img.mode.startswith("I;16") else img
    low, high = wide.getextrema()
    if img.mode.startswith("I;16"):
        scale, offset = 255 / 65535, 0.0
    elif img.mode == "F" and low >= 0 and high <= 1:
        scale, offset = 255.0, 0.0
    elif low >= 0 and high <= 255:
        scale, offset = 1.0, 0.0
    elif img.mode == "I" and low >= 0 and high <= 65535:
        scale, offset = 255 / 65535, 0.0
    else:  # unknown range: stretch what is there
        span = (high - low) or 1
        scale, offset = 255 / span, -low * 255 / span
    return wide.point(lambda v: v * scale + offset).convert("L")


def _to_rgb(img: Image.Image) -> Image.Image:
    """Convert any Pillow mode to RGB, compositing transparency onto white."""
    if img.mode.startswith("I;16") or img.mode in ("I", "F"):
        img = _to_8bit(img)
    if "transparency" in img.info and img.mode in ("P", "L", "RGB"):
        img = img.convert("RGBA")
    if img.mode == "La":  # premultiplied; Pillow only converts it to LA
        img = img.convert("LA")
    if img.mode in ("RGBA", "LA", "PA", "RGBa"):
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return img if img.mode == "RGB" else img.convert("RGB")


def _parse(data: bytes, max_pixels: int) -> Image.Image:
    """Identify, size-check, verify and decode image bytes (first frame only)."""
    try:
        probe = _open(data)
        _check_pixels(probe.size, max_pixels)
        probe.verify()
        # verify() leaves the image unusable, so decode from a fresh open.
        img = _open(data)
        img.load()  # animated formats decode only the first frame here
        return img
    except KitError:
        raise
    except (Image.DecompressionBombError, MemoryError):
        raise ImageTooLarge(
            "image is too large to decode; send a smaller image", max_pixels=max_pixels
        ) from None
    except Exception:  # noqa: BLE001 - Pillow plugins raise many types on hostile input
        raise ImageError(
            "image data is corrupt or truncated; re-export the image and send it again"
        ) from None


def _decode_rgb(data: bytes, max_pixels: int) -> Image.Image:
    """Decode image bytes into an upright, fully loaded RGB image."""
    img = _parse(data, max_pixels)
    try:
        rgb = _to_rgb(_upright(img))
    except (ValueError, OSError):  # Pillow's "conversion not supported" and friends
        raise ImageError(
            f"image color mode {_clean(img.mode, 12)!r} is not supported; save the image as "
            "RGB (or grayscale) PNG/JPEG and send it again"
        ) from None
    rgb.load()
    return rgb


# --- loader ---------------------------------------------------------------------------------


def _failure(exc: Exception) -> str:
    """Say in a few words why a fetch failed, without echoing server-controlled text."""
    if "CERTIFICATE_VERIFY_FAILED" in str(exc):
        return "its TLS certificate did not verify"
    if isinstance(exc, httpx.ConnectError):
        return "could not connect"
    if isinstance(exc, httpx.ProtocolError):
        return "the server broke the HTTP protocol"
    return f"transfer failed ({type(exc).__name__})"


def _default_s3_client(policy: ImagePolicy) -> Any:
    """Build a boto3 S3 client with the policy's timeouts."""
    try:
        import boto3
        from botocore.config import Config
    except ImportError:
        raise ImageError(
            "s3:// image references need boto3 on the server (pip install "
            f"'llava-sessions[aws]'); or {_HINT}"
        ) from None
    config = Config(
        connect_timeout=policy.connect_timeout_s,
        read_timeout=policy.read_timeout_s,
        retries={"max_attempts": 2},
    )
    return boto3.client("s3", config=config)


def _s3_error_code(exc: Exception) -> str:
    """Pull the S3 error code (NoSuchKey, AccessDenied, ...) out of a botocore error."""
    response = getattr(exc, "response", None)
    error = response.get("Error") if isinstance(response, dict) else None
    if isinstance(error, dict) and error.get("Code"):
        return _clean(str(error["Code"]), 40)
    return type(exc).__name__


class ImageLoader:
    """Turn an image reference from a request into a normalized RGB PIL image."""

    def __init__(
        self,
        policy: ImagePolicy = ImagePolicy(),  # noqa: B008 - frozen, so sharing is safe
        *,
        resolver: Resolver | None = None,
        s3_client_factory: Callable[[], Any] | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        """Configure the loader; `transport` replaces the pinned one (then no IP pinning)."""
        self.policy = policy
        self._resolver: Resolver = resolver or _system_resolver
        self._s3_factory = s3_client_factory or functools.partial(_default_s3_client, policy)
        self._transport = transport
        self._lock = threading.Lock()
        self._s3_client: Any = None
        self._ssl_context: ssl.SSLContext | None = None

    def load(self, ref: str) -> Image.Image:
        """Fetch or decode `ref` and return a fully loaded RGB image."""
        return _decode_rgb(self._read_bytes(ref), self.policy.max_pixels)

    def _read_bytes(self, ref: str) -> bytes:
        """Return the raw bytes a reference names, within the policy's limits."""
        if not isinstance(ref, str):
            raise InvalidRequest(
                "image reference must be a string: an https URL, s3:// URI, data URI or base64"
            )
        text = ref.strip()
        if not text:
            raise InvalidRequest(
                "image reference is empty; send an https URL, s3:// URI, data URI or base64"
            )
        scheme = _scheme_of(text)
        if scheme is None:
            return _decode_base64(text, self.policy.max_bytes)
        if scheme == "data":
            return _decode_data_uri(text, self.policy.max_bytes)
        if scheme in ("http", "https"):
            return self._fetch_url(text)
        if scheme == "s3":
            return self._fetch_s3(text)
        raise InvalidRequest(
            f"unsupported image reference scheme {scheme!r}; send an https:// URL, "
            "s3://bucket/key, data:image/...;base64,... or raw base64"
        )

    # --- http(s) ---

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
                f"plain http image URLs are disabled ({where}); use https or {_HINT}"
            )
        if scheme not in ("http", "https"):
            what = "redirected to" if hop else "got"
            raise InvalidRequest(f"image fetch {what} unsupported scheme {_clean(scheme, 16)!r}")
        if not url.raw_host:
            raise InvalidRequest(f"image URL {where} has no host")
        if url.userinfo:
            raise InvalidRequest(
                f"image URL {where} contains credentials; image URLs must not carry them"
            )
        host = url.raw_host.decode("ascii")
        if _host_allow_listed(host, self.policy):
            return
        if _parse_ip(host) is not None:
            # Literal addresses are refused before any connection is attempted.
            _vet_address(host, self.policy, host)
        elif self._transport is not None:
            # A caller-supplied transport does its own connecting, so the best we can do
            # is vet what the name resolves to now (no pinning against DNS rebinding).
            port = url.port or (443 if scheme == "https" else 80)
            for address in _resolve(self._resolver, host, port, deadline):
                _vet_address(address, self.policy, host)

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
            f"read {p.read_timeout_s}s, total {p.total_timeout_s}s); use a faster host or {_HINT}"
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
                f"reachable over https with a valid certificate, or {_HINT}"
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
                f"image URL {where} sent a {_clean(encoding, 20)!r}-encoded body although "
                f"identity was requested; serve the image uncompressed or {_HINT}"
            )
        declared = response.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.policy.max_bytes:
            raise _too_many_bytes(f"image at {where}", self.policy.max_bytes)
        return _read_limited(
            response.iter_bytes(_CHUNK), self.policy.max_bytes, deadline, f"image at {where}"
        )

    # --- s3 ---

    def _s3(self) -> Any:
        """Return the S3 client, creating it once (boto3 clients are thread-safe)."""
        with self._lock:
            if self._s3_client is None:
                self._s3_client = self._s3_factory()
            return self._s3_client

    def _fetch_s3(self, text: str) -> bytes:
        """Download an s3://bucket/key object within the byte limit."""
        where = describe_ref(text)
        if not self.policy.allow_s3:
            raise ImageForbidden(f"s3:// image references are disabled here; {_HINT}")
        bucket, _, key = text[5:].partition("/")
        if not _BUCKET.fullmatch(bucket) or not key:
            raise InvalidRequest(
                f"malformed S3 reference {where}; write it as s3://bucket/path/to/image.png"
            )
        deadline = time.monotonic() + self.policy.total_timeout_s
        try:
            body = self._s3().get_object(Bucket=bucket, Key=key)
        except KitError:
            raise
        except Exception as exc:  # noqa: BLE001 - boto3 raises its own tree; report its code
            raise ImageFetchError(
                f"could not read {where}: {_s3_error_code(exc)}; check the bucket, key and "
                "that the endpoint's role may read it",
            ) from None
        stream = body.get("Body") if isinstance(body, dict) else None
        if stream is None:
            raise ImageFetchError(f"S3 returned no body for {where}")
        try:
            declared = body.get("ContentLength")
            if isinstance(declared, int) and declared > self.policy.max_bytes:
                raise _too_many_bytes(f"image at {where}", self.policy.max_bytes)
            return _read_limited(
                self._s3_chunks(stream), self.policy.max_bytes, deadline, f"image at {where}"
            )
        except KitError:
            raise
        except Exception as exc:  # noqa: BLE001 - connection errors mid-body, any flavour
            raise ImageFetchError(
                f"reading {where} failed midway ({_s3_error_code(exc)}); try again"
            ) from None
        finally:
            close = getattr(stream, "close", None)
            if callable(close):
                close()

    def _s3_chunks(self, stream: Any) -> Iterable[bytes]:
        """Yield body chunks, never asking for more than one byte past the limit."""
        remaining = self.policy.max_bytes + 1
        while remaining > 0:
            chunk = stream.read(min(_CHUNK, remaining))
            if not chunk:
                return
            remaining -= len(chunk)
            yield chunk
