"""Session affinity for Ray Serve: a session's requests go to the replica that holds it.

A request carries its session id as `route` (None for anything that opens or needs no session).
The id starts with the rank of the replica that issued it (`r1-...`), and each replica reports
its rank and load in its routing stats, so the router needs no shared table. A new session goes
to the replica holding the fewest device bytes (not the fewest sessions: one long conversation
can outweigh many short ones).

A session whose replica is gone waits (with Ray's backoff) for a replica of that rank: Ray gives a
replacement the rank of the replica it replaces, and the replacement restores that replica's
sessions from their snapshots. After `ORPHAN_WAIT_S` with none, it goes to the least loaded
replica, which answers `session_not_found`.
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
from llava.fronts.ray.replica import rank_of

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
        rank = rank_of(id_prefix(route)) if route else None
        if rank is not None:
            holder = [r for r in candidate_replicas if r.routing_stats.get("rank") == rank]
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
        """Device bytes held, plus a session's average for each open routed since the stats."""
        stats: dict[str, Any] = dict(replica.routing_stats or {})
        if "device_bytes" not in stats:
            return float("inf")  # not reported yet: only if no other replica has
        seen, count = self._opens.get(replica.replica_id, (stats, 0))
        recent = count if seen == stats else 0
        average = stats["device_bytes"] / stats["sessions"] if stats.get("sessions") else 1.0
        return stats["device_bytes"] + recent * average


def _route(pending_request: PendingRequest | None) -> str | None:
    """Return the session id a request was sent with (the ingress's `route`)."""
    return pending_request.kwargs.get("route") if pending_request is not None else None
