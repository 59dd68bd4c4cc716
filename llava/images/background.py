"""Load images off the step loop, so it never waits on a download, a decode or a processor.

Every reference is read on a thread, whatever it is: a URL of any scheme in any spelling (the
one parser in `refs.py` decides) on the fetch threads, inline bytes (data URI, base64) on their
own threads, so an image stalled on a slow server never holds up one that is already here. The
CPU work that follows - decoding, and the engine's preparer (the model's processor: resizing
and normalising) - runs in image processes (`processes.py`), off the worker's interpreter lock,
or, with no processes configured, on the same threads. The step loop only polls the returned
futures; a load that fails names the `image` field.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

from llava.core.errors import SEND_PICTURE_AGAIN, KitError, UnknownImageHandle
from llava.images.digest import content_digest
from llava.images.processes import ImageProcesses
from llava.images.refs import is_inline

# Threads for inline images (they hand the text to the image processes, or decode it without
# them: never waiting on a remote server).
LOCAL_THREADS = 2
# Image threads run at a lower CPU priority than the step loop: on a host with few cores,
# reading and (without processes) decoding must not slow the forwards every stream waits on.
IMAGE_THREAD_NICENESS = 10


def _lower_priority() -> None:
    """Lower this thread's CPU priority (Linux schedules threads on their own)."""
    # Not Linux, or not permitted: the thread runs at normal priority.
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), IMAGE_THREAD_NICENESS)


class ImageSource(Protocol):
    """Reads an image reference (I/O: fetch, base64) and decodes what it read (CPU)."""

    def read(self, ref: str) -> Any:
        """Return the encoded image `ref` names, or raise a `KitError`."""
        ...

    @property
    def decoder(self) -> Callable[[Any], Any]:
        """Turn what `read` returned into a decoded image (picklable: image processes run it)."""
        ...


# Turns a decoded image, and the conversation's earlier images it is processed with, into the
# engine's input (picklable: image processes run it).
Preparer = Callable[[Any, list[Any]], Any]


class BackgroundImages:
    """Read images on threads, decode and prepare them in processes; errors name `image`."""

    def __init__(
        self, source: ImageSource, prepare: Preparer, *, threads: int, processes: int = 0
    ) -> None:
        self._source = source
        self._prepare = prepare
        self._fetch = ThreadPoolExecutor(
            threads, thread_name_prefix="llava-image-fetch", initializer=_lower_priority
        )
        self._local = ThreadPoolExecutor(
            LOCAL_THREADS, thread_name_prefix="llava-image", initializer=_lower_priority
        )
        self.processes = ImageProcesses(source.decoder, prepare, processes) if processes else None

    def submit(self, ref: str, earlier: Sequence[Any] = ()) -> Future:
        """Start loading one image and preparing it (with the conversation's `earlier` images).
        The future holds the result or the error."""
        pool = self._local if is_inline(ref) else self._fetch
        return pool.submit(self._load, ref, list(earlier))

    def submit_all(
        self,
        refs: Sequence[str],
        known: Callable[[str], bool] | None = None,
        named: Mapping[int, str] | None = None,
    ) -> Future:
        """Load a conversation's images (any number) and prepare them together.

        The future holds (prepared images or None, content digest). Given `known`, the digest
        identifies the images by their files' bytes, however they were sent, and the images
        are not prepared (no processor, no vision tower) when `known(digest)` says a session
        holds them already; without it nothing is hashed and the digest is "". `named` gives
        the digests of images sent without bytes (by their index): those are never read, and
        if no session holds them the future fails with `UnknownImageHandle`.
        """
        if not refs:
            ready: Future = Future()
            ready.set_result((None, ""))
            return ready
        named = dict(named or {})
        local = all(is_inline(r) or i in named for i, r in enumerate(refs))
        pool = self._local if local else self._fetch
        return pool.submit(self._load_all, list(refs), known, named)

    def close(self) -> None:
        """Stop the threads and processes, dropping loads not yet started."""
        for pool in (self._fetch, self._local):
            pool.shutdown(wait=False, cancel_futures=True)
        if self.processes is not None:
            self.processes.close()

    def _load(self, ref: str, earlier: list[Any]) -> Any:
        with _naming_image():
            return self._prepared(self._source.read(ref), earlier)

    def _load_all(
        self, refs: list[str], known: Callable[[str], bool] | None, named: dict[int, str]
    ) -> tuple[Any, str]:
        with _naming_image():
            data = [None if i in named else self._source.read(ref) for i, ref in enumerate(refs)]
            digest = ""
            if known is not None:
                digest = "+".join(named.get(i) or content_digest(d) for i, d in enumerate(data))
            if known is not None and known(digest):
                return None, digest
            if named:  # chats.py words it as every other handle it cannot resolve
                raise UnknownImageHandle(SEND_PICTURE_AGAIN, field="messages")
            earlier = [self._source.decoder(d) for d in data[:-1]]  # processed with the last
            return self._prepared(data[-1], earlier), digest

    def _prepared(self, data: Any, earlier: list[Any]) -> Any:
        if self.processes is not None:
            return self.processes.run(data, earlier)
        return self._prepare(self._source.decoder(data), earlier)


@contextlib.contextmanager
def _naming_image() -> Iterator[None]:
    """Name the `image` field in an image error that names none."""
    try:
        yield
    except KitError as exc:
        if exc.field is None:
            exc.field = "image"
        raise
