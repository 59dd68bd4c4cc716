"""Image processes: decode images and run the model's processor outside the worker's interpreter.

Decoding an image and running the processor over it (resize, rescale, normalise) is CPU work
in Python. On threads of the worker it holds the interpreter lock against the step loop, so
every stream's step waits on it (measured on 2 cores: decode steps of 25-39 ms against 15 ms
quiet while 4 images were prepared on threads). A process has its own interpreter. Processes
are forked by a fork server, never by the worker (which holds CUDA and threads): a fresh
process that imports the processor's libraries once (seconds of CPU), so each image process
starts at once and shares them; they run at a lower CPU priority with one torch thread each,
and each gets its own copy of the decoder and the preparer at start.

A process that dies (a decoder crashing on a hostile file, the out-of-memory killer) breaks the
whole pool: the pool is replaced, and each image that was in it is tried once more on the new
one. An image that breaks the pool twice is refused.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from llava.core.errors import ImageError, KitError

log = logging.getLogger(__name__)

# Image processes run at a lower CPU priority than the worker: on a host with few cores,
# decoding and resizing must not slow the forwards every stream is waiting on.
CHILD_NICENESS = 19

# What this process decodes and prepares with, when it is an image process (set at its start).
_decode: Callable[[Any], Any] | None = None
_prepare: Callable[[Any, list[Any]], Any] | None = None


def _exit_with_parent() -> None:
    """Exit this image process as soon as the worker that started it is gone.

    A worker killed outright (TorchServe restarting it, `kill -9`) cannot stop its pool, and
    the pool's processes would otherwise live on, each holding the processor's libraries.
    """
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(0)

    threading.Thread(target=watch, name="llava-image-parent-watch", daemon=True).start()


def _start_child(payload: bytes, niceness: int) -> None:
    """Set up an image process: low priority, one torch thread, its decoder and preparer."""
    global _decode, _prepare
    _exit_with_parent()
    # Read by torch when unpickling the preparer imports it; one core's worth of work each.
    os.environ["OMP_NUM_THREADS"] = "1"
    with contextlib.suppress(OSError):  # not permitted: the process runs at normal priority
        os.nice(niceness)
    _decode, _prepare = pickle.loads(payload)
    torch = sys.modules.get("torch")  # imported by the preparer, if it uses it
    if torch is not None:  # imported before OMP_NUM_THREADS was set (by the main module)
        torch.set_num_threads(1)


def process_context(*run: Callable[..., Any]) -> multiprocessing.context.BaseContext:
    """The fork server's context, which imports the worker's main module (as `spawn` would in
    each process) and the modules of what the processes `run` before it forks any; `spawn`
    where there is no fork server (not POSIX)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    modules = {getattr(f, "__module__", None) or type(f).__module__ for f in run}
    context.set_forkserver_preload(["__main__", __name__, *sorted(modules)])
    _fit_forkserver_socket()
    return context


# A Unix socket's path holds at most 107 bytes; the fork server's is multiprocessing's temporary
# folder (pymp-XXXXXXXX, made in tempfile's) and listener-XXXXXXXX in it.
UNIX_PATH_MAX = 107
FORKSERVER_SOCKET_CHARS = len("/pymp-XXXXXXXX/listener-XXXXXXXX")
SHORT_TEMP_DIRS = ("/tmp", "/var/tmp", "/dev/shm")


def _fit_forkserver_socket() -> None:
    """Make multiprocessing's temporary folder in a short one where TMPDIR is too long for the
    fork server's socket (`make serve` points TMPDIR into the checkout; a deep checkout would
    otherwise fail every worker's start with `AF_UNIX path too long`)."""
    from multiprocessing import util

    if len(tempfile.gettempdir()) + FORKSERVER_SOCKET_CHARS <= UNIX_PATH_MAX:
        return
    short = next((d for d in SHORT_TEMP_DIRS if os.access(d, os.W_OK | os.X_OK)), None)
    if short is None:
        return  # nowhere shorter: the fork server says why it cannot start
    saved = tempfile.tempdir
    tempfile.tempdir = short
    try:
        util.get_temp_dir()  # made now, kept by multiprocessing for this process
    finally:
        tempfile.tempdir = saved


def _decode_and_prepare(data: Any, earlier: list[Any]) -> Any:
    """Turn an encoded image into the model's inputs (in an image process)."""
    if _decode is None or _prepare is None:
        raise RuntimeError("an image process was not started by ImageProcesses")
    return _prepare(_decode(data), earlier)


def _started() -> int:
    return os.getpid()


class ImageProcesses:
    """A pool of image processes that decode and prepare images; replaced when one dies."""

    def __init__(
        self, decode: Callable[[Any], Any], prepare: Callable[[Any, list[Any]], Any], count: int
    ) -> None:
        if count < 1:
            raise ValueError("ImageProcesses needs at least one process")
        try:
            self._payload = pickle.dumps((decode, prepare))
        except Exception as exc:
            raise TypeError(
                f"the image decoder and preparer must be picklable to run in image processes "
                f"({exc}); set image_processes: 0 to prepare images on threads instead"
            ) from exc
        self.count = count
        self._context = process_context(decode, prepare)
        self._lock = threading.Lock()
        self._closed = False
        self._pool = self._new_pool()

    def _new_pool(self) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(
            self.count,
            mp_context=self._context,
            initializer=_start_child,
            initargs=(self._payload, CHILD_NICENESS),
        )

    def start(self, timeout_s: float = 120.0) -> list[int]:
        """Start every process now and wait for them (each imports the processor's libraries:
        seconds), so the first images do not wait; return their process ids."""
        futures = [self._pool.submit(_started) for _ in range(self.count)]
        try:
            return [future.result(timeout_s) for future in futures]
        except Exception as exc:
            raise RuntimeError(
                f"the image processes did not start ({exc!r}); the worker log shows the first "
                "error. Set image_processes: 0 to prepare images on threads instead"
            ) from exc

    def run(self, data: Any, earlier: Sequence[Any] = ()) -> Any:
        """Decode and prepare one image in a process; blocks the calling image thread."""
        for _attempt in range(2):
            pool = self._pool
            future = self._submit(pool, data, list(earlier))
            if future is None:
                continue
            try:
                return future.result()
            except BrokenProcessPool:
                self._replace(pool)
        raise ImageError(
            "decoding this image stopped the process decoding it, twice; check that it is a "
            "valid PNG, JPEG, GIF or WebP file and send it again"
        )

    def _submit(self, pool: ProcessPoolExecutor, data: Any, earlier: list[Any]) -> Future | None:
        """Submit to `pool`; None when it broke or was replaced meanwhile (then try the new one)."""
        try:
            return pool.submit(_decode_and_prepare, data, earlier)
        except RuntimeError:  # BrokenProcessPool, or shut down by a replacement or close()
            if self._closed:
                raise KitError("the server is shutting down; send the request again") from None
            self._replace(pool)
            return None

    def _replace(self, broken: ProcessPoolExecutor) -> None:
        """Put a new pool in place of a broken one (once, however many threads saw it break)."""
        with self._lock:
            if self._closed or self._pool is not broken:
                return
            log.warning("an image process died; starting %d new image processes", self.count)
            broken.shutdown(wait=False, cancel_futures=True)
            self._pool = self._new_pool()

    def close(self) -> None:
        """Stop the processes, dropping images not yet started."""
        with self._lock:
            self._closed = True
            self._pool.shutdown(wait=False, cancel_futures=True)
