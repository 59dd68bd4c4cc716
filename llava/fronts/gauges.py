"""What a serving instance publishes as gauges, read after a step for whichever front publishes
them (TorchServe's metrics, Ray's): its sessions and their bytes per memory tier, its snapshots
on disk and in the shared store (writes, failures, lag), and the answer steps decoded outside
the stacked batch (no room for them, or the stacked forward failed). Only readings that changed
since the last read come back, and the sessions' caches are walked only when the store changed.

A front reads the gauges after every step, which on a stream is every token, so what is costly
to read is read at most once a second, and when the instance falls idle (no step follows to
publish what changed last): vLLM's own figures walk its whole Prometheus registry (about 2 ms;
read every step, that was most of one stream's gap to bare vLLM's decode rate on 2 cores).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

ENGINE_FIGURES_EVERY_S = 1.0

DESCRIPTIONS = {
    "LlavaSessions": "Sessions held, by memory tier",
    "LlavaSessionDeviceBytes": "Bytes sessions hold on the GPU, by memory tier",
    "LlavaSessionHostBytes": "Bytes sessions hold in host memory, by memory tier",
    "LlavaSnapshots": "Session snapshots on disk",
    "LlavaSnapshotBytes": "Bytes of session snapshots on disk",
    "LlavaDecodedAlone": "Answer steps decoded outside the stacked batch, by reason",
    "LlavaStoreWrites": "Session states written to the shared store, by outcome",
    "LlavaStorePending": "Session states waiting to be written to the shared store",
    "LlavaStoreLagMs": "Age of the oldest state waiting to be written to the shared store",
    "LlavaStoreResumes": "Sessions resumed from the shared store",
    "LlavaEngine": "The engine's own figures (vLLM: requests running and waiting, KV cache use "
    "in percent, prefix cache queries and hits in tokens, engine restarts; read at most once a "
    "second)",
}


def snake_case(name: str) -> str:
    """A gauge's name as Prometheus spells metrics (`LlavaSessions` -> `llava_sessions`)."""
    return "".join(f"_{c.lower()}" if c.isupper() else c for c in name).lstrip("_")


@dataclass(frozen=True)
class Reading:
    """One gauge's value under one dimension."""

    name: str
    value: int
    unit: str
    dimension: tuple[str, str]  # (name, value), e.g. ("Tier", "device")


class Gauges:
    """Read an instance's gauges: `changed()` after each step."""

    def __init__(self, instance: Any, clock: Callable[[], float] = time.monotonic) -> None:
        self.service, self.memory, self.decoder = (
            instance.service,
            instance.memory,
            instance.decoder,
        )
        self.snapshots, self.shared = instance.snapshots, instance.shared
        self.engine_stats = instance.engine_stats
        self._clock = clock
        self._engine_read_at: float | None = None
        self._engine_readings: list[Reading] = []
        self._store_version: int | None = None
        self._last: dict[tuple[str, tuple[str, str]], int] = {}
        # sessions and bytes per tier, as last counted (a router reads the load off them)
        self.tiers: dict[str, dict[str, int]] = {}

    def changed(self) -> list[Reading]:
        """Return the readings whose value changed since the last call (all of them, first)."""
        readings = [*self._decoded_alone(), *self._snapshots(), *self._shared()]
        store = self.service.store
        if store.version != self._store_version:  # else: skip walking every cache
            self._store_version = store.version
            self.tiers = self.memory.tiers(store.snapshot())
            readings += self._tiers(self.tiers)
        fresh = [r for r in readings if self._last.get((r.name, r.dimension)) != r.value]
        for reading in fresh:
            self._last[(reading.name, reading.dimension)] = reading.value
        return fresh

    @staticmethod
    def _tiers(tiers: dict[str, dict[str, int]]) -> list[Reading]:
        out = []
        for tier, figures in tiers.items():
            dimension = ("Tier", tier)
            out += [
                Reading("LlavaSessions", figures["sessions"], "count", dimension),
                Reading("LlavaSessionDeviceBytes", figures["device_bytes"], "B", dimension),
                Reading("LlavaSessionHostBytes", figures["host_bytes"], "B", dimension),
            ]
        return out

    def _shared(self) -> list[Reading]:
        if self.shared is None:
            return []
        stats = self.shared.stats()
        store = ("Store", "shared")
        return [
            Reading("LlavaSnapshots", int(stats["objects"]), "count", store),
            Reading("LlavaSnapshotBytes", int(stats["bytes"]), "B", store),
            Reading("LlavaStoreWrites", int(stats["writes"]), "count", ("Outcome", "written")),
            Reading("LlavaStoreWrites", int(stats["failures"]), "count", ("Outcome", "failed")),
            Reading("LlavaStoreWrites", int(stats["dropped"]), "count", ("Outcome", "dropped")),
            Reading("LlavaStoreWrites", int(stats["fenced"]), "count", ("Outcome", "fenced")),
            Reading("LlavaStorePending", int(stats["pending"]), "count", store),
            Reading("LlavaStoreLagMs", int(stats["lag_s"] * 1000), "ms", store),
            Reading("LlavaStoreResumes", int(stats["resumes"]), "count", store),
        ]

    def _snapshots(self) -> list[Reading]:
        snapshots = self.snapshots
        if snapshots is None:
            return []
        stats = snapshots.stats()
        return [
            Reading("LlavaSnapshots", stats["snapshots"], "count", ("Store", "disk")),
            Reading("LlavaSnapshotBytes", stats["bytes"], "B", ("Store", "disk")),
        ]

    def _decoded_alone(self) -> list[Reading]:
        if self.decoder is None:  # vLLM's engine: its own figures instead
            return self._engine_figures()
        return [
            Reading("LlavaDecodedAlone", self.decoder.alone_for_room, "count", ("Reason", "room")),
            Reading(
                "LlavaDecodedAlone", self.decoder.stack_failures, "count", ("Reason", "failure")
            ),
        ]

    def _engine_figures(self) -> list[Reading]:
        """The engine's own figures, as last read: read again once a second has passed, or when
        nothing is left in flight (the last step before the instance falls idle)."""
        now = self._clock()
        due = (
            self._engine_read_at is None
            or now - self._engine_read_at >= ENGINE_FIGURES_EVERY_S
            or not self.service.in_flight
        )
        if self.engine_stats is not None and due:
            self._engine_read_at = now
            self._engine_readings = [
                Reading("LlavaEngine", v, "count", ("Stat", k))
                for k, v in self.engine_stats().items()
            ]
        return self._engine_readings
