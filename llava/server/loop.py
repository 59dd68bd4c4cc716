"""Drive the service from an asyncio front: one thread steps every request in flight.

TorchServe's frontend batches requests and calls the worker once per step. A front without
such a frontend (Ray Serve) submits each request here instead; the loop thread calls
`SessionService.step` with every request in flight, as TorchServe would, and hands each reply
to the coroutine waiting for it. A request whose caller goes away is left out of the next step,
which is how the service learns to roll it back.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from llava.api.replies import Reply, error_reply, internal_error
from llava.server.service import Incoming, SessionService

log = logging.getLogger(__name__)


@dataclass
class _Request:
    """One request in flight: what the service is given each step, and where replies go."""

    incoming: Incoming
    loop: asyncio.AbstractEventLoop
    replies: asyncio.Queue[Reply] = field(default_factory=asyncio.Queue)


def merge_queued(reply: Reply, queued: asyncio.Queue[Reply]) -> Reply:
    """Join a stream's chunks that queued while its caller was slow into one reply (the first's
    status and headers, every line in order), so a slow front sends fewer, larger chunks and
    never falls further behind the engine; a chunk that finds nothing queued goes at once."""
    while reply.last is False and not queued.empty():
        later = queued.get_nowait()
        reply = replace(reply, body=reply.body + later.body, last=later.last)
    return reply


class StepLoop:
    """Step a service over every submitted request on one thread, until each is answered."""

    def __init__(
        self, service: SessionService[Any, Any], after_step: Callable[[], None] = lambda: None
    ) -> None:
        self.service = service
        self._after_step = after_step  # runs on the loop thread: what a front reads off it
        self._requests: dict[str, _Request] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._run, name="llava-steps", daemon=True)
        self._thread.start()

    async def answer(self, body: bytes, headers: Mapping[str, Any]) -> AsyncIterator[Reply]:
        """Submit a request and yield its replies: one whole reply, or a stream's chunks."""
        request = _Request(
            Incoming(f"req-{next(self._ids)}", body, dict(headers)), asyncio.get_running_loop()
        )
        with self._lock:
            self._requests[request.incoming.request_id] = request
        self._wake.set()
        try:
            while True:
                reply = merge_queued(await request.replies.get(), request.replies)
                yield reply
                if reply.last is not False:
                    return
        finally:  # answered, or the caller went away: the next step leaves it out
            with self._lock:
                self._requests.pop(request.incoming.request_id, None)

    @property
    def alive(self) -> bool:
        """Tell whether the loop thread is stepping (a health check reads it)."""
        return self._thread.is_alive() and not self._stopping

    def stop(self) -> None:
        """End the loop thread after its current step."""
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stopping:
            with self._lock:
                batch = list(self._requests.values())
            if not batch:  # nothing to answer: roll back what callers left, then sleep
                if self.service.in_flight:
                    self.service.step([])
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                replies = self.service.step([r.incoming for r in batch])
            except Exception as exc:  # step never raises; if it did, still answer each one
                log.exception("service step failed")
                replies = [error_reply(internal_error(exc))] * len(batch)
            for request, reply in zip(batch, replies, strict=True):
                if reply is not None:
                    request.loop.call_soon_threadsafe(request.replies.put_nowait, reply)
                    if reply.last is not False:
                        with self._lock:  # answered: never stepped again
                            self._requests.pop(request.incoming.request_id, None)
            try:
                self._after_step()
            except Exception:
                log.exception("after-step hook failed")
