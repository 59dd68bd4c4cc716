"""One Ray Serve replica: an assembled instance and its own step loop, answering raw requests.

Each replica is its own process with its own engine, device budget and sessions. Its session ids
start with its rank (`r0-...`): the router reads the rank back, so routing needs no shared
table, and a replica that replaces a dead one takes its rank, its registry and its snapshots, so
the dead replica's sessions come back where the disk is the same.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

from llava.core.config import ServerConfig

log = logging.getLogger(__name__)


def rank_prefix(rank: int) -> str:
    """Return the session id prefix of the replica of that rank."""
    return f"r{rank}"


def rank_of(prefix: str | None) -> int | None:
    """Return the rank a session id prefix names, or None if it names none."""
    if prefix and prefix[0] == "r" and prefix[1:].isdigit():
        return int(prefix[1:])
    return None


class LlavaReplica:
    """Serve the kit's API on one device; the router pins each session to its replica."""

    def __init__(
        self, model_dir: str, model_name: str = "llava", settings: Mapping[str, Any] | None = None
    ) -> None:
        import ray
        from ray import serve

        from llava.fronts.assembly import assemble, freeze_startup_objects
        from llava.server.loop import StepLoop

        self.rank = int(serve.get_replica_context().rank.rank)
        self.name = rank_prefix(self.rank)
        # Images are prepared on threads: a Ray worker process hangs starting the kit's spawned
        # image processes (measured with Ray 2.55), and each replica has its own process anyway.
        # torch gets the CPUs Ray gave the replica, not the machine's: replicas side by side
        # that each spin a thread per core starve each other and Ray's own RPCs (measured: 40 s
        # per request with two replicas on two cores).
        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 1)
        defaults = {"image_processes": 0, "torch_threads": max(1, int(cpus))}
        config = ServerConfig.from_mapping({**defaults, **(settings or {})}, os.environ)
        self.instance = assemble(
            Path(model_dir),
            config,
            model_name=model_name,
            state_name=f"{model_name}-{self.name}",
            id_prefix=self.name,
        )
        self.instance.service.usage_extra["replica"] = self.name
        self.loop = StepLoop(self.instance.service)
        freeze_startup_objects()
        log.info("llava replica %s ready: %s", self.name, config)

    async def __call__(
        self, body: bytes, headers: dict[str, str], route: str | None = None
    ) -> AsyncIterator[dict[str, Any]]:
        """Answer one request: its replies, as plain dicts (a whole one, or stream chunks).

        `route` is the session id the router pins the request by; the replica needs nothing
        from it."""
        async for reply in self.loop.answer(body, headers):
            yield {
                "body": reply.body,
                "status": reply.status,
                "headers": reply.headers,
                "content_type": reply.content_type,
                "last": reply.last,
            }

    def record_routing_stats(self) -> dict[str, Any]:
        """Tell the router this replica's rank and load: device bytes and sessions held."""
        store = self.instance.service.store
        tiers = self.instance.memory.tiers(store.snapshot())
        return {
            "rank": self.rank,
            "device_bytes": sum(t["device_bytes"] for t in tiers.values()),
            "sessions": sum(t["sessions"] for t in tiers.values()),
        }

    def check_health(self) -> None:
        """Fail Ray's health check when the step loop has died (Ray then replaces the replica)."""
        if not self.loop.alive:
            raise RuntimeError(f"replica {self.name}: the step loop is not running")

    def __del__(self) -> None:
        """Graceful shutdown: stop stepping and flush the snapshots queued so far."""
        loop = getattr(self, "loop", None)
        if loop is not None:
            loop.stop()
            self.instance.service.close()
            if self.instance.service.snapshots is not None:
                self.instance.service.snapshots.close()
