"""Session affinity for Ray Serve: a session's requests go to the replica that holds it.

A request carries its session id as `route` (None for anything that opens or needs no session).
The id starts with the name of the replica that issued it (`r1xab12cd34-...`: its rank and Ray's
id for it), so the router needs no shared table. A new session goes to the replica holding the
fewest device bytes (not the fewest sessions: one long conversation can outweigh many short
ones), as its routing stats report them, counting the opens sent since.

A session whose replica is gone waits (with Ray's backoff) for a replica of the same rank: Ray
gives a replacement the rank of the replica it replaces, the replacement reports it in its
routing stats, and it restores that replica's sessions from their snapshots. After
`ORPHAN_WAIT_S` with none, it goes to the least loaded replica, which answers
`session_not_found`.
"""

from __future__ import annotations

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

ORPHAN_WAIT_S = 60.0


class SessionAffinityRouter(RequestRouter):
    """Route by the rank in the session id; open new sessions where the fewest bytes are."""

    def initialize_state(self, **kwargs: Any) -> None:
        """Count the opens sent to each replica since its last stats, so a burst of opens
        spreads instead of all going to the replica that was emptiest a second ago."""
        self._opens: dict[ReplicaID, tuple[dict[str, Any], int]] = {}

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
            waited = time.time() - pending_request.created_at if pending_request else 0.0
            if waited < ORPHAN_WAIT_S:
                pending_request.routing_context.should_backoff = True  # type: ignore[union-attr]
                return []  # its replica (or its replacement) is starting: wait for it
        return [[replica] for replica in sorted(candidate_replicas, key=self._load)]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult
    ) -> None:
        """Count an open (a request with no session to follow) against its replica."""
        if _route(pending_request) is None:
            replica = self.curr_replicas.get(replica_id)
            stats = dict(replica.routing_stats) if replica is not None else {}
            seen, count = self._opens.get(replica_id, (stats, 0))
            self._opens[replica_id] = (stats, (count if seen == stats else 0) + 1)

    def _load(self, replica: RunningReplica) -> float:
        """Device bytes held, plus a session's average for each open routed since the stats
        (Ray refreshes the stats it hands a router every few seconds, or not yet at all)."""
        stats = _stats(replica)
        seen, count = self._opens.get(replica.replica_id, (stats, 0))
        recent = count if seen == stats else 0
        used = stats.get("device_bytes", 0)
        average = used / stats["sessions"] if stats.get("sessions") else 1.0
        return used + recent * average


def _stats(replica: RunningReplica) -> dict[str, Any]:
    """Return the routing stats a replica last reported ({} before its first report)."""
    return dict(replica.routing_stats or {})


def _route(pending_request: PendingRequest | None) -> str | None:
    """Return the session id a request was sent with (the ingress's `route`)."""
    return pending_request.kwargs.get("route") if pending_request is not None else None
