"""ImageLoader: route an image reference to its fetcher or decoder and return RGB."""

from __future__ import annotations

import functools
import ssl
import threading
from collections.abc import Callable
from typing import Any

import httpx
from PIL import Image

from llava.errors import InvalidRequest
from llava.images.decode import _decode_rgb
from llava.images.fetch import _HttpFetch
from llava.images.inline import _decode_base64, _decode_data_uri
from llava.images.policy import ImagePolicy
from llava.images.refs import _scheme_of
from llava.images.resolve import Resolver, _system_resolver
from llava.images.s3 import _default_s3_client, _S3Fetch


class ImageLoader(_HttpFetch, _S3Fetch):
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
