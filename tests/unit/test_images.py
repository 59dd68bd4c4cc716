"""Tests for llava.images: address policy, fetch limits, decoding limits, RGB normalization.

No test resolves a real name or touches a non-loopback address: resolvers are stubs, and an
autouse guard refuses (without sending anything) any connection to a non-loopback address.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import io
import ipaddress
import socket
import ssl
import struct
import threading
import time
import warnings
import zlib
from collections.abc import Iterator
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from PIL import Image

from llava.core.errors import (
    ImageError,
    ImageFetchError,
    ImageForbidden,
    ImageTooLarge,
    InvalidRequest,
    KitError,
)
from llava.images import ImageLoader, ImagePolicy, check_address, describe_ref, to_rgb

# --- helpers ------------------------------------------------------------------------------


def png_bytes(img: Image.Image, **save: Any) -> bytes:
    """Encode an image as PNG."""
    out = io.BytesIO()
    img.save(out, "PNG", **save)
    return out.getvalue()


def encode(img: Image.Image, fmt: str = "PNG", **save: Any) -> str:
    """Encode an image as bare base64 in the given format."""
    out = io.BytesIO()
    img.save(out, fmt, **save)
    return base64.b64encode(out.getvalue()).decode()


def png_header_only(width: int, height: int) -> bytes:
    """Build a PNG with a valid IHDR claiming the given size and no pixel data at all."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


RED_PNG = png_bytes(Image.new("RGB", (4, 3), (255, 0, 0)))


class StubResolver:
    """Resolve fake names from a table and count lookups; unknown names fail like DNS does."""

    def __init__(self, table: dict[str, list[str]]) -> None:
        self.table = table
        self.calls: list[str] = []

    def __call__(self, host: str, port: int) -> list[str]:
        self.calls.append(host)
        if host not in self.table:
            raise socket.gaierror(f"stub resolver has no entry for {host}")
        return list(self.table[host])


class NetGuard:
    """Record connection attempts; refuse non-loopback ones before any packet is sent."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.external: list[tuple[str, int]] = []

    def create_connection(self, address: tuple[str, int], *args: Any, **kwargs: Any) -> Any:
        host, port = address[0], address[1]
        if not ipaddress.ip_address(host.split("%")[0]).is_loopback:
            self.external.append((host, port))
            raise ConnectionRefusedError(f"test guard: refusing non-loopback {host}")
        return self.real(address, *args, **kwargs)


@pytest.fixture(autouse=True)
def net(monkeypatch: pytest.MonkeyPatch) -> Iterator[NetGuard]:
    """Keep every test on loopback: no real DNS, no connections elsewhere."""
    guard = NetGuard(socket.create_connection)
    real_getaddrinfo = socket.getaddrinfo

    def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        text = host.decode() if isinstance(host, bytes) else str(host)
        try:
            ipaddress.ip_address(text.split("%")[0])
        except ValueError:
            raise AssertionError(f"test tried real DNS for {text!r}") from None
        return real_getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(socket, "create_connection", guard.create_connection)
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    yield guard
    assert guard.external == [], "a test tried to reach a non-loopback address"


# --- local servers ------------------------------------------------------------------------


class Handler(BaseHTTPRequestHandler):
    """Routes for the fetch tests."""

    def log_message(self, *args: Any) -> None:
        pass

    def send_body(self, body: bytes, ctype: str = "image/png", **headers: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for name, value in headers.items():
            self.send_header(name.replace("_", "-"), value)
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        url = urlsplit(self.path)
        query = parse_qs(url.query)
        with contextlib.suppress(BrokenPipeError, ConnectionResetError, ssl.SSLError):
            self.route(url.path, query)

    def route(self, path: str, query: dict[str, list[str]]) -> None:
        if path == "/png":
            self.send_body(RED_PNG)
        elif path == "/redirect":
            self.send_response(302)
            self.send_header("Location", query["to"][0])
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif path == "/loop":
            self.send_response(301)
            self.send_header("Location", "/loop")
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif path == "/html":
            self.send_body(b"<html><body>not an image</body></html>", "image/png")
        elif path == "/status":
            self.send_response(int(query["code"][0]))
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif path == "/gzip":
            self.send_body(RED_PNG, Content_Encoding="gzip")
        elif path == "/declared-huge":
            self.send_response(200)
            self.send_header("Content-Length", str(10**12))
            self.end_headers()
        elif path == "/forever":
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()  # no length: the body runs until the connection closes
            block = b"\0" * 65536
            while True:
                self.wfile.write(block)
        elif path == "/slow":
            self.send_response(200)
            self.send_header("Content-Length", "1000")
            self.end_headers()
            for _ in range(1000):  # each byte well within the read timeout
                self.wfile.write(b"x")
                self.wfile.flush()
                time.sleep(0.05)
        elif path == "/hang":
            time.sleep(3)
        else:
            self.send_response(404)
            self.end_headers()


class QuietServer(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # clients hanging up mid-stream is the point of several tests


class TLSServer(QuietServer):
    """HTTPS server; the handshake runs in the handler thread so a bad client cannot stall it."""

    context: ssl.SSLContext

    def get_request(self) -> tuple[Any, Any]:
        sock, addr = super().get_request()
        return self.context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False), addr


def serve(server: ThreadingHTTPServer) -> Iterator[int]:
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    yield from serve(QuietServer(("127.0.0.1", 0), Handler))


def self_signed(host: str) -> tuple[bytes, bytes]:
    """Return (cert PEM, key PEM) for a certificate valid for `host` only."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(host)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, bytes]]:
    cert_pem, key_pem = self_signed("images.test")
    folder = tmp_path_factory.mktemp("tls")
    (folder / "cert.pem").write_bytes(cert_pem)
    (folder / "key.pem").write_bytes(key_pem)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(folder / "cert.pem", folder / "key.pem")
    server = TLSServer(("127.0.0.1", 0), Handler)
    server.context = context
    for tls_port in serve(server):
        yield tls_port, cert_pem


LOCAL = {"images.test": ["127.0.0.1"], "evil.test": ["127.0.0.1"], "other.test": ["127.0.0.1"]}


def local_loader(**policy: Any) -> ImageLoader:
    """Loader that may fetch over http from images.test (127.0.0.1) only."""
    options: dict[str, Any] = {"allow_http": True, "allow_hosts": ("images.test",)}
    options.update(policy)
    return ImageLoader(ImagePolicy(**options), resolver=StubResolver(LOCAL))


# --- address policy -----------------------------------------------------------------------

BLOCKED = [
    "127.0.0.1",
    "127.255.0.9",
    "10.1.2.3",
    "172.16.0.1",
    "192.168.1.1",
    "169.254.169.254",  # cloud metadata
    "169.254.1.1",
    "100.64.0.1",  # shared address space
    "100.100.100.200",
    "0.0.0.0",
    "224.0.0.1",
    "239.255.255.250",
    "240.0.0.1",
    "255.255.255.255",
    "192.0.0.192",
    "198.18.0.1",
    "::1",
    "::",
    "fe80::1",
    "fe80::1%eth0",
    "fc00::1",
    "fd00:ec2::254",  # cloud metadata over IPv6
    "ff02::1",
    "fec0::1",
    "::ffff:127.0.0.1",  # IPv4-mapped forms
    "::ffff:169.254.169.254",
    "::ffff:10.0.0.1",
    "::ffff:0.0.0.0",
    "64:ff9b::a00:1",  # NAT64 form of 10.0.0.1
    "2002:7f00:1::1",  # 6to4 around 127.0.0.1
    "2002:808:808::1",  # 6to4 around 8.8.8.8: a relay's, not globally reachable (IANA)
    "2001:0:4136:e378:8000:63bf:f7f7:f7f7",  # Teredo around a public IPv4
    "::7f00:1",  # IPv4-compatible 127.0.0.1
    "2001:db8::1",
]

PUBLIC = ["8.8.8.8", "93.184.216.34", "2606:4700:4700::1111", "::ffff:8.8.8.8"]


@pytest.mark.parametrize("ip", BLOCKED)
def test_check_address_refuses_non_public(ip: str) -> None:
    with pytest.raises(ImageForbidden) as caught:
        check_address(ip, ImagePolicy())
    assert caught.value.code == "image_url_forbidden"
    assert "base64" in caught.value.message  # says what to do instead


def test_check_address_names_metadata() -> None:
    for ip in ("169.254.169.254", "fd00:ec2::254"):
        with pytest.raises(ImageForbidden, match="metadata"):
            check_address(ip, ImagePolicy())


@pytest.mark.parametrize("ip", PUBLIC)
def test_check_address_allows_public(ip: str) -> None:
    check_address(ip, ImagePolicy())


def test_check_address_refuses_non_ip() -> None:
    with pytest.raises(ImageForbidden):
        check_address("localhost", ImagePolicy())


def test_allow_list_cidr_bypasses_block() -> None:
    policy = ImagePolicy(allow_hosts=("127.0.0.1/32", "10.0.0.0/8", "fd00::/8"))
    for ip in ("127.0.0.1", "::ffff:127.0.0.1", "10.200.3.4", "fd00:ec2::254"):
        check_address(ip, policy)
    with pytest.raises(ImageForbidden):
        check_address("127.0.0.2", policy)
    with pytest.raises(ImageForbidden):
        check_address("169.254.169.254", policy)


def test_policy_validation() -> None:
    with pytest.raises(InvalidRequest, match="tuple"):
        ImagePolicy(allow_hosts="127.0.0.1/32")  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match="neither"):
        ImagePolicy(allow_hosts=("https://images.test/",))
    with pytest.raises(InvalidRequest):
        ImagePolicy(total_timeout_s=0)
    with pytest.raises(InvalidRequest):
        ImagePolicy(max_redirects=-1)
    assert ImagePolicy(allow_hosts=["a.test"]).allow_hosts == ("a.test",)  # type: ignore[arg-type]
    assert "http" not in ImagePolicy().allowed_schemes
    assert "http" in ImagePolicy(allow_http=True).allowed_schemes
    assert "s3" not in ImagePolicy().allowed_schemes
    assert "s3" in ImagePolicy(s3_allow=("b",)).allowed_schemes


@pytest.mark.parametrize(
    ("table", "url"),
    [
        ({"meta.test": ["169.254.169.254"]}, "https://meta.test/latest/meta-data/"),
        ({"v6.test": ["fd00:ec2::254"]}, "https://v6.test/latest/"),
        ({"mapped.test": ["::ffff:192.168.0.1"]}, "https://mapped.test/x.png"),
        ({"mixed.test": ["93.184.216.34", "10.0.0.5"]}, "https://mixed.test/x.png"),
        ({"mixed.test": ["2606:4700::1", "::1"]}, "https://mixed.test/x.png"),
        ({}, "https://169.254.169.254/latest/meta-data/"),
        ({}, "https://[fd00:ec2::254]/latest/"),
        ({}, "https://[::ffff:169.254.169.254]/"),
        ({}, "https://127.0.0.1:8443/x.png"),
    ],
)
def test_loader_refuses_forbidden_hosts_before_connecting(
    table: dict[str, list[str]], url: str, net: NetGuard
) -> None:
    loader = ImageLoader(resolver=StubResolver(table))
    with pytest.raises(ImageForbidden):
        loader.load(url)
    assert net.external == []


def test_connects_to_the_address_that_was_checked(net: NetGuard) -> None:
    """DNS rebinding: a second lookup would say loopback, but only one lookup is made."""
    answers = iter([["93.184.216.34"], ["127.0.0.1"]])
    calls: list[str] = []

    def rebinding(host: str, port: int) -> list[str]:
        calls.append(host)
        return next(answers)

    with pytest.raises(ImageFetchError):
        ImageLoader(resolver=rebinding).load("https://rebind.test/x.png")
    assert calls == ["rebind.test"]
    assert net.external == [("93.184.216.34", 443)]  # refused by the guard, nothing sent
    net.external.clear()


def test_http_refused_unless_allowed() -> None:
    with pytest.raises(ImageForbidden, match="https"):
        ImageLoader(resolver=StubResolver({})).load("http://images.test/x.png")


@pytest.mark.parametrize(
    ("ref", "error"),
    [
        ("ftp://images.test/x.png", InvalidRequest),
        ("file:///etc/passwd", InvalidRequest),
        ("gopher://127.0.0.1/", InvalidRequest),
        ("https://user:pw@images.test/x.png", InvalidRequest),
        ("https:///x.png", InvalidRequest),
        ("", InvalidRequest),
        ("   ", InvalidRequest),
    ],
)
def test_bad_references(ref: str, error: type[KitError]) -> None:
    with pytest.raises(error):
        ImageLoader(resolver=StubResolver({})).load(ref)


# --- fetching -----------------------------------------------------------------------------


def test_fetch_allow_listed_host(port: int) -> None:
    img = local_loader().load(f"http://images.test:{port}/png")
    assert (img.mode, img.size, img.getpixel((0, 0))) == ("RGB", (4, 3), (255, 0, 0))


def test_fetch_allow_listed_cidr(port: int) -> None:
    policy = ImagePolicy(allow_http=True, allow_hosts=("127.0.0.1/32",))
    img = ImageLoader(policy, resolver=StubResolver({})).load(f"http://127.0.0.1:{port}/png")
    assert img.size == (4, 3)


def test_same_host_relative_redirect_is_followed(port: int) -> None:
    img = local_loader().load(f"http://images.test:{port}/redirect?to=/png")
    assert img.size == (4, 3)


@pytest.mark.parametrize(
    "target",
    [
        "http://evil.test:{port}/png",  # not allow-listed, resolves to loopback
        "http://127.0.0.1:{port}/png",
        "http://[::ffff:127.0.0.1]:{port}/png",
        "http://169.254.169.254/latest/meta-data/",
        "http://[fd00:ec2::254]/latest/meta-data/",
    ],
)
def test_redirect_to_forbidden_address_refused(port: int, target: str, net: NetGuard) -> None:
    url = f"http://images.test:{port}/redirect?to={target.format(port=port)}"
    with pytest.raises(ImageForbidden):
        local_loader().load(url)
    assert net.external == []


def test_redirect_to_other_scheme_refused(port: int) -> None:
    with pytest.raises(InvalidRequest, match="scheme"):
        local_loader().load(f"http://images.test:{port}/redirect?to=file:///etc/passwd")


def test_too_many_redirects(port: int) -> None:
    with pytest.raises(ImageFetchError, match="redirected more than 2"):
        local_loader(max_redirects=2).load(f"http://images.test:{port}/loop")


def test_non_image_refused_despite_content_type(port: int) -> None:
    with pytest.raises(ImageError, match="not a supported image") as caught:
        local_loader().load(f"http://images.test:{port}/html")
    assert type(caught.value) is ImageError


@pytest.mark.parametrize("code", [404, 403, 500])
def test_upstream_status_reported(port: int, code: int) -> None:
    with pytest.raises(ImageFetchError, match=f"HTTP {code}") as caught:
        local_loader().load(f"http://images.test:{port}/status?code={code}")
    assert caught.value.details["upstream_status"] == code
    assert caught.value.code == "image_fetch_failed"


def test_compressed_body_refused(port: int) -> None:
    with pytest.raises(ImageFetchError, match="gzip"):
        local_loader().load(f"http://images.test:{port}/gzip")


def test_declared_length_over_limit_refused(port: int) -> None:
    with pytest.raises(ImageTooLarge):
        local_loader(max_bytes=1000).load(f"http://images.test:{port}/declared-huge")


def test_byte_limit_aborts_endless_stream(port: int) -> None:
    start = time.monotonic()
    with pytest.raises(ImageTooLarge) as caught:
        local_loader(max_bytes=200_000).load(f"http://images.test:{port}/forever")
    assert time.monotonic() - start < 3
    assert caught.value.status == 413


def test_total_deadline_stops_slow_body(port: int) -> None:
    loader = local_loader(total_timeout_s=0.5, read_timeout_s=5)
    start = time.monotonic()
    with pytest.raises(ImageFetchError, match="timed out") as caught:
        loader.load(f"http://images.test:{port}/slow")
    assert time.monotonic() - start < 2
    assert caught.value.code == "image_fetch_failed"


def test_read_timeout(port: int) -> None:
    loader = local_loader(read_timeout_s=0.3)
    start = time.monotonic()
    with pytest.raises(ImageFetchError, match="timed out"):
        loader.load(f"http://images.test:{port}/hang")
    assert time.monotonic() - start < 2


def test_total_deadline_covers_dns() -> None:
    def stuck(host: str, port: int) -> list[str]:
        time.sleep(2)
        return ["93.184.216.34"]

    loader = ImageLoader(ImagePolicy(total_timeout_s=0.3), resolver=stuck)
    start = time.monotonic()
    with pytest.raises(ImageFetchError, match="timed out"):
        loader.load("https://slow-dns.test/x.png")
    assert time.monotonic() - start < 1.5


def test_unresolvable_host() -> None:
    with pytest.raises(ImageFetchError, match="resolve"):
        ImageLoader(resolver=StubResolver({})).load("https://nowhere.test/x.png")


def test_tls_verifies_host_name_while_pinned(tls: tuple[int, bytes]) -> None:
    tls_port, cert_pem = tls
    policy = ImagePolicy(allow_hosts=("images.test", "other.test"))
    loader = ImageLoader(policy, resolver=StubResolver(LOCAL))
    loader._ssl_context = ssl.create_default_context(cadata=cert_pem.decode())
    img = loader.load(f"https://images.test:{tls_port}/png")
    assert img.size == (4, 3)
    # Same IP, but the certificate does not name other.test: verification must fail.
    with pytest.raises(ImageFetchError, match="certificate did not verify"):
        loader.load(f"https://other.test:{tls_port}/png")
    # And a redirect from https down to plain http is refused.
    with pytest.raises(ImageForbidden, match="https"):
        loader.load(f"https://images.test:{tls_port}/redirect?to=http://images.test/png")


def test_custom_transport_still_checks_addresses() -> None:
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(str(request.url))
        return httpx.Response(200, content=RED_PNG)

    table = {"cdn.test": ["93.184.216.34"], "internal.test": ["10.0.0.8"]}
    loader = ImageLoader(resolver=StubResolver(table), transport=httpx.MockTransport(handler))
    assert loader.load("https://cdn.test/a.png").size == (4, 3)
    with pytest.raises(ImageForbidden):
        loader.load("https://internal.test/a.png")
    assert seen == ["https://cdn.test/a.png"]


# --- inline images ------------------------------------------------------------------------


def test_data_uri_and_bare_base64() -> None:
    b64 = base64.b64encode(RED_PNG).decode()
    loader = ImageLoader()
    for ref in (
        f"data:image/png;base64,{b64}",
        f"DATA:IMAGE/JPEG;BASE64,{b64}",  # declared type is ignored; bytes decide
        b64,
        "\n".join(b64[i : i + 76] for i in range(0, len(b64), 76)),  # MIME line breaks
        base64.urlsafe_b64encode(RED_PNG).decode().rstrip("="),  # url-safe, unpadded
    ):
        img = loader.load(ref)
        assert (img.mode, img.size) == ("RGB", (4, 3))


@pytest.mark.parametrize(
    ("ref", "error", "match"),
    [
        ("data:text/plain;base64,aGVsbG8=", InvalidRequest, "image/"),
        ("data:image/png,rawbytes", InvalidRequest, "base64"),
        ("data:image/png;base64", InvalidRequest, "malformed"),
        ("data:image/png;base64,!!!!", ImageError, "base64"),
        ("not base64 at all!", ImageError, "base64"),
        ("aGVsbG8gd29ybGQ=", ImageError, "not a supported image"),
        ("data:image/svg+xml;base64," + base64.b64encode(b"<svg/>").decode(), ImageError, None),
    ],
)
def test_bad_inline_images(ref: str, error: type[KitError], match: str | None) -> None:
    with pytest.raises(error, match=match):
        ImageLoader().load(ref)


def test_inline_byte_limit() -> None:
    b64 = base64.b64encode(RED_PNG).decode()
    with pytest.raises(ImageTooLarge):
        ImageLoader(ImagePolicy(max_bytes=len(RED_PNG) - 1)).load(b64)


# --- decoding limits ----------------------------------------------------------------------


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def test_decompression_bomb_refused_from_header() -> None:
    with pytest.raises(ImageTooLarge):
        ImageLoader().load(b64(png_header_only(100_000, 100_000)))


def test_pixel_limit_checked_before_decoding() -> None:
    # The file has no pixel data: an attempt to decode would fail as corrupt, not too large.
    with pytest.raises(ImageTooLarge, match="8000x6000"):
        ImageLoader().load(b64(png_header_only(8000, 6000)))
    with pytest.raises(ImageTooLarge, match="pixel"):
        ImageLoader(ImagePolicy(max_pixels=100)).load(b64(png_header_only(20, 20)))
    with pytest.raises(ImageError, match="corrupt"):
        ImageLoader().load(b64(png_header_only(20, 20)))


def test_pillow_warning_band_is_an_error_without_leaking() -> None:
    """Between 1x and 2x Pillow's own limit it only warns; that must still refuse."""
    filters_before = list(warnings.filters)
    limit_before = Image.MAX_IMAGE_PIXELS
    loader = ImageLoader(ImagePolicy(max_pixels=10**9))
    with pytest.raises(ImageTooLarge):
        loader.load(b64(png_header_only(10_000, 10_000)))
    assert limit_before == Image.MAX_IMAGE_PIXELS
    assert warnings.filters == filters_before


def test_concurrent_loads_leave_warning_filters_alone() -> None:
    """The service loads images from a thread pool; the bomb guard must hold up under it."""
    from concurrent.futures import ThreadPoolExecutor

    filters_before = list(warnings.filters)
    loader = ImageLoader(ImagePolicy(max_pixels=10**9))
    refs = [b64(RED_PNG), b64(png_header_only(10_000, 10_000))] * 40

    def outcome(ref: str) -> str:
        try:
            return loader.load(ref).mode
        except ImageTooLarge:
            return "too large"

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(outcome, refs))
    assert results == ["RGB", "too large"] * 40
    assert warnings.filters == filters_before


def test_truncated_image() -> None:
    with pytest.raises(ImageError, match="corrupt"):
        ImageLoader().load(b64(RED_PNG[:-20]))


# --- normalization ------------------------------------------------------------------------


def paletted_with_transparency() -> Image.Image:
    img = Image.new("P", (4, 3), 0)
    img.putpalette([255, 0, 0, 0, 0, 255] + [0] * (256 * 3 - 6))
    img.putpixel((1, 0), 1)
    img.info["transparency"] = 0
    return img


def with_orientation(img: Image.Image, orientation: int) -> dict[str, Any]:
    exif = img.getexif()
    exif[0x0112] = orientation
    return {"exif": exif.tobytes()}


def animated_gif() -> str:
    first = Image.new("RGB", (4, 3), (255, 0, 0))
    second = Image.new("RGB", (4, 3), (0, 0, 255))
    out = io.BytesIO()
    first.save(out, "GIF", save_all=True, append_images=[second], duration=100, loop=0)
    return b64(out.getvalue())


CASES = [
    # (name, base64 ref, expected size, expected pixel at (0, 0))
    ("rgb", encode(Image.new("RGB", (4, 3), (1, 2, 3))), (4, 3), (1, 2, 3)),
    ("L", encode(Image.new("L", (4, 3), 7)), (4, 3), (7, 7, 7)),
    ("1-bit", encode(Image.new("1", (4, 3), 1)), (4, 3), (255, 255, 255)),
    ("P", encode(Image.new("RGB", (4, 3), (10, 20, 30)).quantize()), (4, 3), (10, 20, 30)),
    ("P+transparency", encode(paletted_with_transparency()), (4, 3), (255, 255, 255)),
    ("RGBA clear", encode(Image.new("RGBA", (4, 3), (0, 0, 0, 0))), (4, 3), (255, 255, 255)),
    ("RGBA half", encode(Image.new("RGBA", (4, 3), (0, 0, 0, 128))), (4, 3), (127, 127, 127)),
    ("LA", encode(Image.new("LA", (4, 3), (0, 255))), (4, 3), (0, 0, 0)),
    (
        "webp alpha",
        encode(Image.new("RGBA", (4, 3), (255, 0, 0, 0)), "WEBP", lossless=True),
        (4, 3),
        (255, 255, 255),
    ),
    ("CMYK", encode(Image.new("CMYK", (4, 3), (0, 255, 255, 0)), "TIFF"), (4, 3), (255, 0, 0)),
    ("CMYK jpeg", encode(Image.new("CMYK", (8, 8), (0, 0, 0, 0)), "JPEG"), (8, 8), None),
    ("I;16", encode(Image.new("I;16", (4, 3), 65535)), (4, 3), (255, 255, 255)),
    ("I;16 mid", encode(Image.new("I;16", (4, 3), 32896)), (4, 3), (128, 128, 128)),
    ("I", encode(Image.new("I", (4, 3), 65535), "TIFF"), (4, 3), (255, 255, 255)),
    ("F", encode(Image.new("F", (4, 3), 0.5), "TIFF"), (4, 3), (127, 127, 127)),
    ("gif first frame", animated_gif(), (4, 3), (255, 0, 0)),
    ("bmp", encode(Image.new("RGB", (4, 3), (9, 9, 9)), "BMP"), (4, 3), (9, 9, 9)),
]


@pytest.mark.parametrize(("name", "ref", "size", "pixel"), CASES, ids=[c[0] for c in CASES])
def test_modes_become_rgb(name: str, ref: str, size: tuple[int, int], pixel: Any) -> None:
    img = ImageLoader().load(ref)
    assert img.mode == "RGB"
    assert img.size == size
    if pixel is not None:
        assert img.getpixel((0, 0)) == pytest.approx(pixel, abs=1)
    img.tobytes()  # fully loaded, no lazy file behind it


@pytest.mark.parametrize(
    ("mode", "color", "expected"),
    [
        ("PA", (1, 0), (255, 255, 255)),
        ("La", (0, 0), (255, 255, 255)),
        ("RGBa", (0, 0, 0, 255), (0, 0, 0)),
        ("LAB", (100, 128, 128), None),
        ("YCbCr", (76, 85, 255), (254, 0, 0)),
        ("HSV", (0, 255, 255), (255, 0, 0)),
        ("I;16B", 65535, (255, 255, 255)),
        ("F", -3.0, (0, 0, 0)),
    ],
)
def test_in_memory_modes_become_rgb(mode: str, color: Any, expected: Any) -> None:
    """Modes no accepted file format stores directly still normalize (decoders may yield them)."""
    img = Image.new(mode, (3, 2), color)
    if mode == "PA":
        img.putpalette([0, 0, 0] * 256)
    out = to_rgb(img)
    assert (out.mode, out.size) == ("RGB", (3, 2))
    if expected is not None:
        assert out.getpixel((0, 0)) == pytest.approx(expected, abs=2)


def test_exif_orientation_applied() -> None:
    # 4x2, left half red, right half blue; orientation 6 means "rotate 90 degrees clockwise".
    img = Image.new("RGB", (4, 2), (255, 0, 0))
    img.paste((0, 0, 255), (2, 0, 4, 2))
    out = ImageLoader().load(b64(png_bytes(img, **with_orientation(img, 6))))
    assert out.size == (2, 4)
    assert out.getpixel((0, 0)) == (255, 0, 0)  # the left half is now on top
    assert out.getpixel((0, 3)) == (0, 0, 255)


# --- s3 -----------------------------------------------------------------------------------


class FakeBody:
    """S3 body stream; `data=None` streams zeros forever."""

    def __init__(self, data: bytes | None) -> None:
        self.data = data
        self.offset = 0
        self.read_total = 0
        self.closed = False

    def read(self, amt: int | None = None) -> bytes:
        assert amt is not None, "the loader must read in bounded chunks"
        if self.data is None:
            chunk = b"\0" * amt
        else:
            chunk = self.data[self.offset : self.offset + amt]
            self.offset += len(chunk)
        self.read_total += len(chunk)
        return chunk

    def close(self) -> None:
        self.closed = True


class FakeClientError(Exception):
    def __init__(self, code: str) -> None:
        super().__init__(code)
        self.response = {"Error": {"Code": code}}


class FakeS3:
    def __init__(self, data: bytes | None = RED_PNG, length: int | None = None) -> None:
        self.calls: list[tuple[str, str]] = []
        self.data = data
        self.bodies: list[FakeBody] = []
        self.length = length

    @property
    def body(self) -> FakeBody:
        return self.bodies[-1]

    def get_object(self, *, Bucket: str, Key: str) -> dict[str, Any]:  # noqa: N803 - boto3's names
        self.calls.append((Bucket, Key))
        if Key.startswith("missing"):
            raise FakeClientError("NoSuchKey")
        if Key.startswith("secret"):
            raise FakeClientError("AccessDenied")
        self.bodies.append(FakeBody(self.data))
        response: dict[str, Any] = {"Body": self.body}
        if self.length is not None:
            response["ContentLength"] = self.length
        return response


def s3_loader(client: FakeS3, **policy: Any) -> tuple[ImageLoader, list[int]]:
    made: list[int] = []

    def factory() -> FakeS3:
        made.append(1)
        return client

    policy.setdefault("s3_allow", ("my-bucket",))
    return ImageLoader(ImagePolicy(**policy), s3_client_factory=factory), made


def test_s3_reads_object() -> None:
    client = FakeS3()
    loader, made = s3_loader(client)
    assert loader.load("s3://my-bucket/path/to/red image.png").size == (4, 3)
    assert loader.load("s3://my-bucket/again.png").size == (4, 3)
    assert client.calls == [("my-bucket", "path/to/red image.png"), ("my-bucket", "again.png")]
    assert made == [1]  # one client, reused
    assert all(body.closed for body in client.bodies)


def test_s3_byte_limit_while_streaming() -> None:
    client = FakeS3(data=None)  # endless body, no declared length
    loader, _ = s3_loader(client, max_bytes=100_000)
    with pytest.raises(ImageTooLarge):
        loader.load("s3://my-bucket/huge.png")
    assert client.body.read_total == 100_001
    assert client.body.closed


def test_s3_declared_length_over_limit() -> None:
    client = FakeS3(length=10**9)
    loader, _ = s3_loader(client, max_bytes=1000)
    with pytest.raises(ImageTooLarge):
        loader.load("s3://my-bucket/huge.png")
    assert client.body.read_total == 0


def test_s3_errors() -> None:
    loader, _ = s3_loader(FakeS3())
    errors = []
    for ref in ("s3://my-bucket/missing.png", "s3://my-bucket/secret.png"):
        with pytest.raises(ImageFetchError) as info:
            loader.load(ref)
        errors.append(info.value.to_body())
    # NoSuchKey and AccessDenied answer alike: a caller cannot learn which objects exist
    assert errors[0] == errors[1]
    assert "does not exist or this endpoint may not read it" in errors[0]["error"]["message"]
    for ref in ("s3://my-bucket", "s3://my-bucket/", "s3:///key.png", "s3://Bad_Bucket/k.png"):
        with pytest.raises(InvalidRequest):
            loader.load(ref)


def test_s3_is_off_unless_buckets_are_allowed() -> None:
    loader, made = s3_loader(FakeS3(), s3_allow=())
    with pytest.raises(ImageForbidden, match="image_s3_allow"):
        loader.load("s3://my-bucket/red.png")
    assert made == []  # not even a client was built
    assert "s3" not in ImagePolicy().allowed_schemes


@pytest.mark.parametrize(
    ("allowed", "ref", "read"),
    [
        (("my-bucket",), "s3://my-bucket/any/key.png", True),
        (("my-bucket/images/",), "s3://my-bucket/images/red.png", True),
        (("my-bucket/images/",), "s3://my-bucket/models/weights.png", False),
        (("my-bucket",), "s3://my-bucket-2/red.png", False),
        (("my-bucket/images",), "s3://my-bucket/images-private/red.png", True),  # a prefix
    ],
)
def test_s3_reads_only_under_the_allowed_buckets_and_prefixes(
    allowed: tuple[str, ...], ref: str, read: bool
) -> None:
    client = FakeS3()
    loader, _ = s3_loader(client, s3_allow=allowed)
    if read:
        assert loader.load(ref).size == (4, 3)
    else:
        with pytest.raises(ImageForbidden, match="not under the buckets"):
            loader.load(ref)
        assert client.calls == []  # refused before S3 is asked


def test_s3_with_real_boto3_client(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default factory and a real botocore body stream, with S3 emulated in-process."""
    moto = pytest.importorskip("moto")
    boto3 = pytest.importorskip("boto3")
    for name, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_CONFIG_FILE": "/nonexistent",
        "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
    }.items():
        monkeypatch.setenv(name, value)
    with moto.mock_aws():
        s3 = boto3.client("s3")
        s3.create_bucket(Bucket="kit-images")
        s3.put_object(Bucket="kit-images", Key="red.png", Body=RED_PNG)
        s3.put_object(Bucket="kit-images", Key="big.bin", Body=b"\0" * 5000)
        allowed = ImagePolicy(s3_allow=("kit-images",))
        assert ImageLoader(allowed).load("s3://kit-images/red.png").size == (4, 3)
        with pytest.raises(ImageTooLarge):
            ImageLoader(replace(allowed, max_bytes=1000)).load("s3://kit-images/big.bin")
        with pytest.raises(ImageFetchError, match="does not exist or this endpoint may not"):
            ImageLoader(allowed).load("s3://kit-images/missing.png")


# --- describe_ref -------------------------------------------------------------------------


def test_describe_ref_examples() -> None:
    url = "https://user:pw@Images.Example.com:8443/a/b.png?X-Amz-Signature=SECRET#frag"
    assert describe_ref(url) == "https://images.example.com:8443"
    assert describe_ref("s3://bucket/private/key.png") == "s3://bucket"
    b64_ref = b64(RED_PNG)
    assert describe_ref(f"data:image/png;base64,{b64_ref}").startswith("data:image/png (")
    assert b64_ref[:20] not in describe_ref(b64_ref)
    assert describe_ref("") == "<empty image reference>"


# --- properties ---------------------------------------------------------------------------

_NO_NETWORK = ("http", "https", "s3")

inline_refs = st.one_of(
    st.text(max_size=300),
    st.text(alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/=-_ \n"),
    st.binary(max_size=300).map(b64),
    st.builds(
        lambda head, body: f"data:{head},{body}",
        st.text(max_size=40),
        st.text(max_size=200),
    ),
    st.binary(max_size=200).map(lambda junk: "data:image/png;base64," + b64(junk)),
    # Real PNG bytes with a corrupted stretch: exercises Pillow's parsers, not just base64.
    st.tuples(st.integers(0, len(RED_PNG) - 1), st.binary(min_size=1, max_size=16)).map(
        lambda cut: b64(RED_PNG[: cut[0]] + cut[1] + RED_PNG[cut[0] + len(cut[1]) :])
    ),
)


def refuse_resolver(host: str, port: int) -> list[str]:
    raise AssertionError("property tests must not reach for the network")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(inline_refs)
def test_load_raises_only_kit_errors(ref: str) -> None:
    prefix = ref.strip()[:8].lower()
    assume(not any(prefix.startswith(scheme + ":") for scheme in _NO_NETWORK))
    loader = ImageLoader(resolver=refuse_resolver, s3_client_factory=lambda: refuse_resolver("", 0))
    try:
        img = loader.load(ref)
    except KitError:
        return
    assert img.mode == "RGB"


hosts = st.from_regex(r"[a-z0-9][a-z0-9.-]{0,70}", fullmatch=True)


@given(
    scheme=st.sampled_from(["http", "https", "s3", "HTTPS"]),
    userinfo=st.sampled_from(["", "user:s3cr_t@", "s3cr_t@"]),
    host=hosts,
    path=st.text(max_size=50).filter(lambda p: "?" not in p and "#" not in p),
    token=st.text(alphabet="abcdefghijklmnop0123456789", min_size=1, max_size=100),
)
def test_describe_ref_hides_query(
    scheme: str, userinfo: str, host: str, path: str, token: str
) -> None:
    url = f"{scheme}://{userinfo}{host}/{path}?SECRETQ={token}&sig={token}"
    text = describe_ref(url)
    assert "SECRETQ" not in text
    assert "s3cr_t" not in text.lower()
    assert len(text) <= 80


@given(st.text(max_size=500))
def test_describe_ref_is_short_and_never_raises(ref: str) -> None:
    text = describe_ref(ref)
    assert len(text) <= 80
    assert "?" not in text


# Blocked networks, each as an address drawn from inside it: every URL naming one (as an IPv4
# literal, a bracketed IPv6 literal, an IPv4-mapped IPv6 literal, or a legacy numeric IPv4 form
# that the system resolver turns into the address) is refused, and nothing is connected.
_BLOCKED_NETS = [
    ipaddress.ip_network(n)
    for n in (
        "0.0.0.0/8",
        "10.0.0.0/8",
        "100.64.0.0/10",
        "127.0.0.0/8",
        "169.254.0.0/16",
        "172.16.0.0/12",
        "192.168.0.0/16",
        "224.0.0.0/4",
        "240.0.0.0/4",
        "::1/128",
        "fc00::/7",
        "fe80::/10",
        "ff00::/8",
    )
]


@st.composite
def blocked_urls(draw: Any) -> str:
    net = draw(st.sampled_from(_BLOCKED_NETS))
    addr = net[draw(st.integers(0, net.num_addresses - 1))]
    scheme = draw(st.sampled_from(["https", "HTTPS"]))
    path = draw(st.sampled_from(["/", "/x.png", "/latest/meta-data/?a=1"]))
    port = draw(st.sampled_from(["", ":443", ":8081"]))
    if addr.version == 6:
        host = f"[{addr.compressed}]" if draw(st.booleans()) else f"[{addr.exploded}]"
    else:
        host = draw(
            st.sampled_from(
                [
                    str(addr),
                    f"[::ffff:{addr}]",
                    str(int(addr)),  # 2130706433: resolved like 127.0.0.1
                    ".".join(hex(int(o)) for o in str(addr).split(".")),  # 0x7f.0x0.0x0.0x1
                ]
            )
        )
    return f"{scheme}://{host}{port}{path}"


def inet_aton_resolver(host: str, port: int) -> list[str]:
    """Resolve numeric IPv4 forms the way the C library does, without any DNS."""
    return [socket.inet_ntoa(socket.inet_aton(host))]


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(blocked_urls())
def test_urls_to_blocked_addresses_are_refused_without_connecting(url: str) -> None:
    def trap(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"connected for {url}")

    loader = ImageLoader(resolver=inet_aton_resolver)
    original = socket.socket.connect
    socket.socket.connect = trap  # type: ignore[method-assign]
    try:
        with pytest.raises(ImageForbidden):
            loader.load(url)
    finally:
        socket.socket.connect = original  # type: ignore[method-assign]
