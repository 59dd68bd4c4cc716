"""Keep a step's prefill work at its target cost, as measured on the steps actually run.

Calibration (`calibrate.py`) times a decode step, prefill chunks and the vision tower once, at
start, each alone. Steps in service cost more than that: a chunk that follows another session's
forward finds the processor's caches cold, image tokens are embedded, caches grow, and other
processes share the cores (measured on 2 cores: 16-token chunks took 20 ms in service against
14.7 ms calibrated, so the stream's longest gap went past its target). The pacer keeps running
averages of what the steps really take - a quiet step (decodes only), prefill against the cost
model's prediction, the tower against its own - and re-derives the budget before every step, so
a step's prefill work keeps costing about `GAP_FACTOR` quiet steps whatever the load. Where the
engine packs a step into one forward (`packed.py`), a chunk beside a decode costs only what it
adds to that forward: the step's time less a quiet step's.

Pure: no torch, so the policy is tested on its own with made-up timings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from llava.engines.transformers.scheduling.scheduler import StepPlan

GAP_FACTOR = 1.5  # a step's prefill work may cost this many quiet steps (the stream waits 2.5)
MIN_BUDGET, MAX_BUDGET = 16, 4096
SMOOTHING = 0.2  # the weight of the newest step in each running average
# A quiet step slower than the average counts this little, so the average follows the pace of
# a step with nothing beside it: decode steps slow down while opens are prepared beside them
# (image processes, TorchServe re-sending the waiting bodies: 20-60% on 2 cores, for hundreds of
# steps), and a budget grown from those steps made the chunks that followed a third longer than
# the stream's quiet pace allows. A lasting change (more answers decoding) still moves it,
# within about a thousand steps; a faster step moves it at once.
RISE_SMOOTHING = 0.002
# One step's surprise moves an average by at most this factor: a pause (garbage collection,
# a page fault storm) must not throw the budget off for many steps.
MAX_SURPRISE = 4.0


class StepCosts(NamedTuple):
    """What the scheduler spends, in prefill tokens of this machine's model."""

    budget: int  # tokens a step's prefill work may cost
    tower_ratio: float  # the vision tower's cost per image token it produces
    forward_cost: int  # the fixed cost of one more forward (a prefill chunk)
    # the fixed cost of a chunk packed into a forward that runs anyway (None: no packing)
    rider_cost: int | None = None


def _average(old: float, sample: float, rise: float = SMOOTHING) -> float:
    sample = min(max(sample, old / MAX_SURPRISE), old * MAX_SURPRISE)
    return old + (rise if sample > old else SMOOTHING) * (sample - old)


@dataclass
class StepPacer:
    """Running averages of step costs, and the budget they imply.

    pacer = StepPacer(quiet_s=0.006, token_s=0.0004, forward_s=0.008, tower_s=0.00004)
    costs = pacer.costs()           # before the step: plan it with these
    pacer.observe(plan, ...)        # after it: what each part took
    """

    quiet_s: float  # a step that only decodes, as measured (running average)
    token_s: float  # calibrated: prefill seconds per token
    forward_s: float  # calibrated: a prefill forward's fixed seconds, whatever its length
    tower_s: float  # calibrated: vision-tower seconds per image token it produces
    rider_s: float | None = None  # calibrated: a chunk packed beside a decode, fixed seconds
    prefill_scale: float = 1.0  # measured / calibrated prefill time (running average)
    tower_scale: float = 1.0  # measured / calibrated tower time (running average)

    def costs(self) -> StepCosts:
        """Return the budget and piece costs for the next step."""
        token_s = self.token_s * self.prefill_scale
        budget = int(min(MAX_BUDGET, max(MIN_BUDGET, GAP_FACTOR * self.quiet_s / token_s)))
        return StepCosts(
            budget=budget,
            tower_ratio=self.tower_s * self.tower_scale / token_s,
            # A chunk always pays its forward, at its full price: where that is most of the
            # budget (a CPU), the scheduler still gives the oldest piece a share of it.
            forward_cost=round(self.forward_s / self.token_s),
            rider_cost=None if self.rider_s is None else round(self.rider_s / self.token_s),
        )

    def observe(
        self,
        plan: StepPlan,
        tower_tokens: int,
        *,
        tower_s: float,
        prefill_s: float,
        decode_s: float,
    ) -> None:
        """Fold one step's measured parts into the averages."""
        if plan.encode and tower_tokens:
            expected = tower_tokens * self.tower_s
            self.tower_scale = _average(self.tower_scale, tower_s / expected)
        if plan.prefill and self.rider_s is not None and plan.decode:
            # Packed: the chunks ran inside the decode forward; what they added is the excess
            # over a quiet step.
            expected = sum(self.rider_s + n * self.token_s for n in plan.prefill.values())
            added = prefill_s + decode_s - self.quiet_s
            self.prefill_scale = _average(self.prefill_scale, added / expected)
        elif plan.prefill:
            # Unpacked, a forward per chunk; packed, the first chunk's forward carries the rest.
            chunks = len(plan.prefill)
            expected = self.token_s * sum(plan.prefill.values()) + (
                chunks * self.forward_s
                if self.rider_s is None
                else self.forward_s + (chunks - 1) * self.rider_s
            )
            self.prefill_scale = _average(self.prefill_scale, prefill_s / expected)
        elif plan.decode and not plan.encode:
            self.quiet_s = _average(self.quiet_s, decode_s, rise=RISE_SMOOTHING)
