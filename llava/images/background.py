"""Load images on worker threads, so the step loop never waits on a download or a decode.

Every reference is loaded on a thread, whatever it is: a URL of any scheme in any spelling (the
one parser in `refs.py` decides) on the fetch threads, inline bytes (data URI, base64) on their
own threads, so an image stalled on a slow server never holds up one that is already here. The
caller's `prepare` (resizing and normalising: the model's processor) runs there too. The step
loop only polls the returned futures; a load that fails names the `image` field.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

from llava.errors import KitError
from llava.images.refs import is_inline

# Threads for inline images (decode and prepare only: CPU work, never waits on a remote server).
LOCAL_THREADS = 2
# Image threads run at a lower CPU priority than the step loop: on a host with few cores, decoding
# and resizing must not slow the forwards every stream is waiting on.
IMAGE_THREAD_NICENESS = 10


def _lower_priority() -> None:
    """Lower this thread's CPU priority (Linux schedules threads on their own)."""
    # Not Linux, or not permitted: the thread runs at normal priority.
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), IMAGE_THREAD_NICENESS)


class ImageSource(Protocol):
    """Turns an image reference into a decoded image (or raises a `KitError`)."""

    def load(self, ref: str) -> Any: ...


class BackgroundImages:
    """Submit image loads to a thread pool; each error names the `image` field."""

    def __init__(self, source: ImageSource, threads: int) -> None:
        self._source = source
        self._fetch = ThreadPoolExecutor(
            threads, thread_name_prefix="llava-image-fetch", initializer=_lower_priority
        )
        self._local = ThreadPoolExecutor(
            LOCAL_THREADS, thread_name_prefix="llava-image", initializer=_lower_priority
        )

    def submit(self, ref: str, prepare: Callable[[Any], Any]) -> Future:
        """Start loading one image and preparing it; the future holds the result or the error."""
        pool = self._local if is_inline(ref) else self._fetch
        return pool.submit(self._load, ref, prepare)

    def close(self) -> None:
        """Stop the threads, dropping loads not yet started."""
        for pool in (self._fetch, self._local):
            pool.shutdown(wait=False, cancel_futures=True)

    def _load(self, ref: str, prepare: Callable[[Any], Any]) -> Any:
        try:
            image = self._source.load(ref)
        except KitError as exc:
            if exc.field is None:
                exc.field = "image"
            raise
        return prepare(image)
