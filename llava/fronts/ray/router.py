"""Session affinity for Ray Serve: a session's requests go to the replica that holds it.

A request carries its session id as `route` (None for anything that opens or needs no session).
The id starts with the name of the replica that issued it (`r1xab12cd34-...`: its rank and Ray's
id for it), so the router needs no shared table. A new session goes to the replica holding the
fewest device bytes (not the fewest sessions: one long conversation can outweigh many short
ones), then the fewest sessions (on vLLM's engine, whose sessions hold no device bytes of their
own, the only figure), as its routing stats report them, counting the opens sent since.

A session whose replica is gone waits (with Ray's backoff) for a replica of the same rank: Ray
gives a replacement the rank of the replica it replaces, the replacement reports it in its
routing stats, and it restores that replica's sessions from their snapshots. After
`ORPHAN_WAIT_S` with none, it goes to the least loaded replica, which answers
`session_not_found`. With a shared session store (`resume_anywhere`: a replica scaled in, or
its node drained or lost, gets no replacement) such a session goes at once to one replica
chosen by rendezvous hashing of its id over those running, the same one for every request
while they run, which resumes it from the store.

Ray 2.55's routing tasks assume a FIFO router (any task may hand its replica to the oldest
request); a router that answers one request at a time, as this one must, loses two things there
(ray-project/ray#66325): a task with no request left spins without yielding (measured: the
ingress's router loop at 100% CPU, probe replies unread, follow-ups waiting 10-70 s), and a
task over the target count drops the request it took. `_fulfill_pending_requests` is replaced
by one that routes each request it takes to the end and stops when none is left.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from typing import Any

from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    ReplicaResult,
    RequestRouter,
    RunningReplica,
)

from llava.core.ids import id_prefix
from llava.fronts.ray.replica import holder_of

log = logging.getLogger(__name__)

ORPHAN_WAIT_S = 60.0


class SessionAffinityRouter(RequestRouter):
    """Route by the rank in the session id; open new sessions where the fewest bytes are."""

    def initialize_state(self, **kwargs: Any) -> None:
        """Count the opens placed on each replica since its last stats (by request id), so a
        burst of opens spreads instead of all going to the replica that was emptiest a second
        ago: routed or still being routed, as concurrent routing tasks choose at once."""
        self._opens: dict[ReplicaID, tuple[dict[str, Any], set[str]]] = {}
        self._resume_anywhere = bool(kwargs.get("resume_anywhere"))

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        """Return the replica that holds the request's session, or the least loaded first."""
        route = _route(pending_request)
        named = holder_of(id_prefix(route)) if route else None
        if named is not None:
            rank, unique = named
            holder = [r for r in candidate_replicas if r.replica_id.unique_id == unique]
            holder = holder or [r for r in candidate_replicas if _stats(r).get("rank") == rank]
            if holder:
                return [holder]
            if self._resume_anywhere and candidate_replicas:
                return [[rendezvous(route, candidate_replicas)]]  # type: ignore[arg-type]
            waited = time.time() - pending_request.created_at if pending_request else 0.0
            if waited < ORPHAN_WAIT_S:
                pending_request.routing_context.should_backoff = True  # type: ignore[union-attr]
                return []  # its replica (or its replacement) is starting: wait for it
        ranked = sorted(candidate_replicas, key=self._load)
        if ranked and pending_request is not None:
            self._place(pending_request, ranked[0].replica_id)
        return [[replica] for replica in ranked]

    async def _fulfill_pending_requests(self) -> None:
        """Route the waiting requests one by one, each to the end; stop when none is left.

        Replaces Ray's loop (same name, run as a routing task) for the reasons above."""
        try:
            while (request := self._get_next_pending_request_to_route()) is not None:
                await self._route(request)
        except Exception:
            log.exception("session affinity router: routing task failed")
        finally:
            self._routing_tasks.discard(asyncio.current_task(loop=self._event_loop))
            self.num_routing_tasks_gauge.set(self.curr_num_routing_tasks)

    async def _route(self, request: PendingRequest) -> None:
        """Hand one request the replica `choose_replicas` names, once it accepts (Ray's probe
        and backoff), unless its caller gave up first."""
        attempt = 0
        choices = self._choose_replicas_with_backoff(request)
        try:
            async for candidates in choices:
                self._forget_answered()
                if request.future.done():  # cancelled while it waited
                    return
                replica = await self._select_from_candidate_replicas(candidates, attempt)
                if replica is not None:
                    self._fulfill_next_pending_request(replica, request.metadata)
                    return
                attempt += 1
        finally:
            await choices.aclose()

    def _forget_answered(self) -> None:
        """Drop answered and cancelled requests from the front of Ray's queue, which counts
        the routing tasks Ray starts."""
        queue = self._pending_requests_to_fulfill
        while queue and queue[0].future.done():
            queue.popleft()

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult
    ) -> None:
        """Count an open (a request with no session to follow) where it was actually sent."""
        if _route(pending_request) is None:
            self._place(pending_request, replica_id)

    def _place(self, request: PendingRequest, replica_id: ReplicaID) -> None:
        """Count one open on a replica (and on no other) until the replica's stats change."""
        opened = request.metadata.internal_request_id
        for _, placed in self._opens.values():
            placed.discard(opened)
        self._recent(replica_id).add(opened)

    def _recent(self, replica_id: ReplicaID) -> set[str]:
        """Return the opens placed on a replica since its current stats (new stats: none)."""
        replica = self.curr_replicas.get(replica_id)
        stats = _stats(replica) if replica is not None else {}
        seen, placed = self._opens.get(replica_id, (stats, set()))
        if seen != stats:
            placed = set()
        self._opens[replica_id] = (stats, placed)
        return placed

    def _load(self, replica: RunningReplica) -> tuple[float, int]:
        """Device bytes held, then sessions held (what tells replicas apart on vLLM, whose
        sessions hold no device bytes of their own), each counting the opens placed since the
        stats at a session's average (Ray refreshes the stats it hands a router every second
        or so, or not yet at all)."""
        stats = _stats(replica)
        used, held = stats.get("device_bytes", 0), stats.get("sessions", 0)
        recent = len(self._recent(replica.replica_id))
        average = used / held if held else 0.0
        return used + recent * average, held + recent


def rendezvous(sid: str, replicas: list[RunningReplica]) -> RunningReplica:
    """Pick the replica with the highest hash of (session id, replica id): stable while the
    replicas stay, and only the sessions of a replica that goes move when the set changes."""

    def weight(replica: RunningReplica) -> bytes:
        return hashlib.sha256(f"{sid}/{replica.replica_id.unique_id}".encode()).digest()

    return max(replicas, key=weight)


def _stats(replica: RunningReplica) -> dict[str, Any]:
    """Return the routing stats a replica last reported ({} before its first report)."""
    return dict(replica.routing_stats or {})


def _route(pending_request: PendingRequest | None) -> str | None:
    """Return the session id a request was sent with (the ingress's `route`)."""
    return pending_request.kwargs.get("route") if pending_request is not None else None
