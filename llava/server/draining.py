"""Drain an instance that is being stopped (SIGTERM: scale-in, a deployment update) losing nothing.

SageMaker and Ray stop an instance with SIGTERM, then SIGKILL after a grace period. `drain`
runs beside the step loop (never on it):
1. the service stops admitting new sessions (`open_session`, one-shot answers, header-less
   chats answer 503 `draining`: a router sends them elsewhere); held sessions keep answering;
2. answers and opens in flight finish, for at most `grace_s`;
3. past the grace, whatever still runs is ended and rolled back (503 `draining`), and nothing
   more is admitted;
4. every session's latest state is flushed to the shared store (and local snapshots to disk),
   so another instance resumes each conversation at its last finished turn.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from llava.api.headers import NEW_SESSION
from llava.api.openai import ChatCompletion
from llava.api.replies import Reply, error_reply
from llava.api.session_api import Generate, OpenSession
from llava.core.errors import Draining
from llava.server.inflight import Answering

log = logging.getLogger(__name__)

POLL_S = 0.05


def session_of(request: Any) -> str | None:
    """Return the existing session a request names (a resume's too), if any."""
    if isinstance(request, OpenSession):
        return request.resume
    if isinstance(request, ChatCompletion):
        return None if request.session in (None, NEW_SESSION) else request.session
    return getattr(request, "session_id", None)


def refuse_if_draining(request: Any, draining: bool, stopping: bool) -> None:
    """Refuse a new session while draining, and anything once the drain's grace is over."""
    opens = isinstance(request, (OpenSession, Generate, ChatCompletion))
    if stopping or (draining and opens and session_of(request) is None):
        raise Draining(
            "this instance is shutting down and takes no new sessions; send the request "
            "again: another instance serves it (sessions resume from the shared store)"
        )


def stopped_replies(running: list[tuple[str, Any]]) -> dict[str, Reply]:
    """The replies of the opens and answers still running when the drain's grace ends."""
    error = Draining("this instance stopped before the answer finished; ask again")
    return {
        request_id: work.failed(error) if isinstance(work, Answering) else error_reply(error)
        for request_id, work in running
    }


def drain(
    service: Any,
    grace_s: float,
    *,
    flush: Callable[[float], bool],
    flush_timeout_s: float = 60.0,
    clock: Callable[[], float] = time.monotonic,
) -> dict[str, Any]:
    """Drain `service` (its step loop keeps running elsewhere); return what happened."""
    started = clock()
    service.draining = True
    log.info("draining: no new sessions; %d answers in flight", service.answering)
    while service.answering and clock() - started < grace_s:
        time.sleep(POLL_S)  # the step loop runs on another thread; this only watches it
    cut = service.answering
    if cut:
        log.warning("drain grace (%.0f s) over: ending %d answers still running", grace_s, cut)
    service.stopping = True
    deadline = clock() + 10.0
    while service.in_flight and clock() < deadline:
        time.sleep(POLL_S)
    flushed = flush(flush_timeout_s)
    seconds = round(clock() - started, 3)
    log.info("drained in %.1f s (%d answers cut, stores flushed: %s)", seconds, cut, flushed)
    return {"seconds": seconds, "cut": cut, "flushed": flushed}
