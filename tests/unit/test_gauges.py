"""The gauges a front reads after every step: what is costly to read (vLLM's own figures, a walk
of its Prometheus registry) is read at most once a second and when the instance falls idle, and
only changed readings come back."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from llava.fronts.gauges import ENGINE_FIGURES_EVERY_S, Gauges


class EngineFigures:
    """The engine's figures as its stats reader returns them, counting each read."""

    def __init__(self) -> None:
        self.figures = {"requests_running": 1, "prefix_cache_hits": 0}
        self.reads = 0

    def __call__(self) -> dict[str, int]:
        self.reads += 1
        return dict(self.figures)


def vllm_instance(stats: EngineFigures) -> Any:
    """An instance as `assemble` makes one on vLLM's engine: no decoder, the engine's figures."""
    store = SimpleNamespace(version=0, snapshot=list)
    memory = SimpleNamespace(tiers=lambda sessions: {})
    return SimpleNamespace(
        service=SimpleNamespace(store=store, in_flight=1),
        memory=memory,
        decoder=None,
        snapshots=None,
        shared=None,
        engine_stats=stats,
    )


def engine_readings(gauges: Gauges) -> dict[str, int]:
    """What one read of the gauges published of the engine's figures, by stat."""
    return {r.dimension[1]: r.value for r in gauges.changed() if r.name == "LlavaEngine"}


def test_the_engines_figures_are_read_once_a_second_however_many_steps() -> None:
    now = [100.0]
    stats = EngineFigures()
    gauges = Gauges(vllm_instance(stats), clock=lambda: now[0])
    assert engine_readings(gauges) == {"requests_running": 1, "prefix_cache_hits": 0}
    stats.figures["prefix_cache_hits"] = 64
    for _ in range(50):  # fifty tokens' steps within the second: no read, nothing new
        now[0] += ENGINE_FIGURES_EVERY_S / 60
        assert engine_readings(gauges) == {}
    assert stats.reads == 1
    now[0] += ENGINE_FIGURES_EVERY_S / 5  # the second has passed: read again, only what changed
    assert engine_readings(gauges) == {"prefix_cache_hits": 64}
    assert stats.reads == 2
    assert engine_readings(gauges) == {}
    assert stats.reads == 2


def test_the_last_step_before_idle_publishes_the_engines_final_figures() -> None:
    """No step follows the last one of a burst, so that one reads, within the second or not."""
    now = [100.0]
    stats = EngineFigures()
    instance = vllm_instance(stats)
    gauges = Gauges(instance, clock=lambda: now[0])
    engine_readings(gauges)
    stats.figures |= {"requests_running": 0, "prefix_cache_hits": 32}
    now[0] += ENGINE_FIGURES_EVERY_S / 10
    assert engine_readings(gauges) == {}  # still answering: held back
    instance.service.in_flight = 0  # the answer's last step
    assert engine_readings(gauges) == {"requests_running": 0, "prefix_cache_hits": 32}
    assert stats.reads == 2
