"""ImageLoader: route an image reference to its fetcher or decoder and return RGB."""

from __future__ import annotations

import functools
import ssl
import threading
from collections.abc import Callable
from typing import Any

import httpx
from PIL import Image

from llava.core.errors import InvalidRequest
from llava.images.decode import ImageDecoder
from llava.images.fetch import HttpFetch
from llava.images.policy import ImagePolicy
from llava.images.refs import scheme_of
from llava.images.resolve import Resolver, system_resolver
from llava.images.s3 import S3Fetch, default_s3_client


class ImageLoader(HttpFetch, S3Fetch):
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
        self._resolver: Resolver = resolver or system_resolver
        self._s3_factory = s3_client_factory or functools.partial(default_s3_client, policy)
        self._transport = transport
        self._lock = threading.Lock()
        self._s3_client: Any = None
        self._ssl_context: ssl.SSLContext | None = None
        # Inline text and file bytes to pixels: CPU work that servers run in image processes.
        self.decoder = ImageDecoder(policy.max_pixels, policy.max_bytes)

    def load(self, ref: str) -> Image.Image:
        """Fetch or decode `ref` and return a fully loaded RGB image."""
        return self.decoder(self.read(ref))

    def read(self, ref: str) -> bytes | str:
        """Return the encoded image a reference names: the bytes fetched from a URL, or the
        inline reference itself (the decoder reads base64, off the worker's threads)."""
        if not isinstance(ref, str):
            raise InvalidRequest(
                "image reference must be a string: an https URL, s3:// URI, data URI or base64"
            )
        text = ref.strip()
        if not text:
            raise InvalidRequest(
                "image reference is empty; send an https URL, s3:// URI, data URI or base64"
            )
        scheme = scheme_of(text)
        if scheme in (None, "data"):
            return text
        if scheme in ("http", "https"):
            return self._fetch_url(text)
        if scheme == "s3":
            return self._fetch_s3(text)
        raise InvalidRequest(
            f"unsupported image reference scheme {scheme!r}; send an https:// URL, "
            "s3://bucket/key, data:image/...;base64,... or raw base64"
        )
