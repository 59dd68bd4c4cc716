"""One Ray Serve replica: an assembled instance and its own step loop, answering raw requests.

Each replica is its own process with its own engine, device budget and sessions. Its session ids
start with its name, its rank and Ray's id for it (`r0xab12cd34-...`): the router reads the id
back and finds the replica with no shared table. A replica that replaces a dead one takes its
rank, and with it its registry and snapshots, so the dead replica's sessions come back where the
disk is the same; the router finds it by that rank.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

from llava.core.config import ServerConfig
from llava.fronts.gauges import DESCRIPTIONS, Gauges, Reading, snake_case

log = logging.getLogger(__name__)


def replica_name(rank: int, unique_id: str) -> str:
    """Return a replica's name, which starts its session ids: its rank and Ray's id for it."""
    return f"r{rank}x{unique_id}"


def holder_of(prefix: str | None) -> tuple[int, str] | None:
    """Return the (rank, Ray id) a session id prefix names, or None if it names none."""
    rank, sep, unique = (prefix or "").partition("x")
    if prefix and sep and rank[:1] == "r" and rank[1:].isdigit() and unique.isalnum():
        return int(rank[1:]), unique
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

        context = serve.get_replica_context()
        self.rank = int(context.rank.rank)
        self.name = replica_name(self.rank, context.replica_id.unique_id)
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
            state_name=f"{model_name}-r{self.rank}",
            id_prefix=self.name,
        )
        self.instance.service.usage_extra["replica"] = self.name
        self.instance.service.usage_extra["node"] = ray.get_runtime_context().get_node_id()[:12]
        self.gauges = Gauges(self.instance)
        self._metrics: dict[str, Any] = {}  # Ray's gauges, by name
        self.loop = StepLoop(self.instance.service, after_step=self._after_step)
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
        """Tell the router this replica's rank and load: device bytes and sessions held.

        Ray calls it on the replica's event loop, which also answers the router's queue-length
        probes: it returns what the step loop last counted and never waits on the sessions'
        lock (measured: waiting on it made probes miss their deadline and requests wait 30 s)."""
        tiers = self.gauges.tiers.values()  # replaced whole by the loop thread, never changed
        return {
            "rank": self.rank,
            "device_bytes": sum(t["device_bytes"] for t in tiers),
            "sessions": sum(t["sessions"] for t in tiers),
        }

    def _after_step(self) -> None:
        """Count the load the router reads and publish the gauges that changed (loop thread)."""
        readings = self.gauges.changed()
        try:
            self._publish(readings)
        except Exception:  # metrics must never cost a request its answer
            log.warning("could not publish metrics", exc_info=True)

    def _publish(self, readings: list[Reading]) -> None:
        """Set Ray's gauges (each node's metrics port: `ray_llava_sessions{Tier,Replica}`)."""
        from ray.util.metrics import Gauge

        for reading in readings:
            key, value = reading.dimension
            gauge = self._metrics.get(reading.name)
            if gauge is None:
                gauge = self._metrics[reading.name] = Gauge(
                    snake_case(reading.name), DESCRIPTIONS[reading.name], tag_keys=(key, "Replica")
                )
            gauge.set(reading.value, tags={key: value, "Replica": f"r{self.rank}"})

    def ready(self) -> bool:
        """Answered once this replica's engine is loaded (its constructor has returned): the
        ingress's /ping waits for one."""
        return True

    def check_health(self) -> None:
        """Fail Ray's health check when the step loop has died or the engine has failed for good
        (Ray then replaces the replica; its sessions resume from snapshots or the store)."""
        if not self.loop.alive:
            raise RuntimeError(f"replica {self.name}: the step loop is not running")
        failure = self.instance.service.engine.failure
        if failure is not None:
            raise RuntimeError(f"replica {self.name}: {failure}")

    def __del__(self) -> None:
        """Graceful shutdown (Ray has let the requests in flight finish): take nothing new,
        flush every session's latest state to the shared store and to disk, stop stepping."""
        loop = getattr(self, "loop", None)
        if loop is not None:
            self.instance.drain(0.0)
            loop.stop()
            self.instance.service.close()
            for store in (self.instance.snapshots, self.instance.shared):
                if store is not None:
                    store.close()
