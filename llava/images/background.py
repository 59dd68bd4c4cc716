"""Load images on worker threads, so the step loop never waits on a download or a decode.

A reference that names an image elsewhere (a URL of any scheme, in any spelling: the one parser
in `refs.py` decides) is loaded on the pool; one that carries its bytes (data URI, base64) is
decoded at once, its body being already here. The step loop only polls the returned futures.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

from llava.errors import KitError
from llava.images.refs import is_inline


class ImageSource(Protocol):
    """Turns an image reference into a decoded image (or raises a `KitError`)."""

    def load(self, ref: str) -> Any: ...


class BackgroundImages:
    """Submit image loads to a thread pool; each error names the `image` field."""

    def __init__(self, source: ImageSource, threads: int) -> None:
        self._source = source
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="llava-image")

    def submit(self, ref: str) -> Future:
        """Start loading one image (the future holds it or its error); a broken inline one
        raises at once."""
        if not is_inline(ref):
            return self._pool.submit(self._load, ref)
        done: Future = Future()
        done.set_result(self._load(ref))
        return done

    def close(self) -> None:
        """Stop the threads, dropping loads not yet started."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _load(self, ref: str) -> Any:
        try:
            return self._source.load(ref)
        except KitError as exc:
            if exc.field is None:
                exc.field = "image"
            raise
