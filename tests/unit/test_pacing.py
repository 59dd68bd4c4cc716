"""The pacer: a step's prefill work stays at its target cost as measured on real steps."""

from __future__ import annotations

import pytest

from llava.engines.transformers.scheduling.pacing import (
    MAX_BUDGET,
    MAX_SURPRISE,
    MIN_BUDGET,
    StepPacer,
)
from llava.engines.transformers.scheduling.scheduler import StepPlan

MS = 0.001


def pacer() -> StepPacer:
    # A CPU-like model: a 12 ms decode step, 8 ms + 0.4 ms a token per prefill chunk.
    return StepPacer(quiet_s=12 * MS, token_s=0.4 * MS, forward_s=8 * MS, tower_s=0.04 * MS)


def prefill_step(p: StepPacer, chunk: int, seconds_per_predicted: float) -> None:
    """Observe a step that decoded one answer and prefilled one chunk, `x` times slower than
    calibrated."""
    plan = StepPlan(decode=[0], prefill={1: chunk})
    predicted = p.forward_s + chunk * p.token_s
    p.observe(plan, 0, tower_s=0.0, prefill_s=predicted * seconds_per_predicted, decode_s=p.quiet_s)


def test_the_calibrated_budget_prices_prefill_at_the_gap_factor() -> None:
    costs = pacer().costs()
    assert costs.budget == 45  # 1.5 quiet steps of 12 ms, at 0.4 ms a token
    assert costs.forward_cost == 20  # 8 ms of fixed cost = 20 tokens, at its full price
    assert costs.tower_ratio == pytest.approx(0.1)


def test_prefill_slower_than_calibrated_shrinks_the_budget_to_match() -> None:
    p = pacer()
    for _ in range(60):
        prefill_step(p, 10, 1.5)
    assert p.prefill_scale == pytest.approx(1.5, rel=1e-3)
    assert p.costs().budget == 30  # 18 ms of prefill at 0.6 ms a token, was 45
    # the tower is priced in prefill tokens: a slower prefill makes the tower cheaper in them
    assert p.costs().tower_ratio == pytest.approx(0.1 / 1.5, rel=1e-3)


def test_a_slower_machine_keeps_the_budget_a_faster_one_grows_it() -> None:
    slow = pacer()
    for _ in range(4000):  # everything twice as slow, for good: quiet steps and prefill alike
        slow.observe(StepPlan(decode=[0]), 0, tower_s=0.0, prefill_s=0.0, decode_s=24 * MS)
        prefill_step(slow, 10, 2.0)
    assert slow.costs().budget == pytest.approx(45, abs=1)  # as before: both twice as slow
    fast = pacer()  # named for what it shows: the prefill is fast against a slow decode
    for _ in range(4000):  # quiet steps take longer, prefill as calibrated: more room per step
        fast.observe(StepPlan(decode=[0]), 0, tower_s=0.0, prefill_s=0.0, decode_s=24 * MS)
    assert fast.costs().budget == pytest.approx(90, abs=1)  # 36 ms of prefill at 0.4 ms a token


def test_a_burst_of_slow_quiet_steps_barely_grows_the_budget_a_fast_one_shrinks_it() -> None:
    p = pacer()
    before = p.costs().budget
    for _ in range(150):  # opens prepared beside the stream slow its decode steps by half
        p.observe(StepPlan(decode=[0]), 0, tower_s=0.0, prefill_s=0.0, decode_s=18 * MS)
    assert p.quiet_s < 12 * MS * 1.2  # a running average of all steps would be near 18 ms
    assert p.costs().budget <= before * 1.2
    for _ in range(10):
        p.observe(StepPlan(decode=[0]), 0, tower_s=0.0, prefill_s=0.0, decode_s=6 * MS)
    assert p.quiet_s < 12 * MS * 0.6  # the quiet pace follows a faster step at once


def test_one_odd_step_moves_the_averages_by_a_bounded_amount() -> None:
    p = pacer()
    prefill_step(p, 10, 1000.0)  # a pause: a thousand times the prediction
    assert p.prefill_scale <= 1 + 0.2 * (MAX_SURPRISE - 1) + 1e-9
    p.observe(StepPlan(decode=[0]), 0, tower_s=0.0, prefill_s=0.0, decode_s=0.0)
    assert p.quiet_s >= 12 * MS * (1 - 0.2 * (1 - 1 / MAX_SURPRISE)) - 1e-12


def test_steps_with_prefill_do_not_count_as_quiet_and_a_tower_run_prices_the_tower() -> None:
    p = pacer()
    prefill_step(p, 10, 1.0)
    assert p.quiet_s == 12 * MS  # the decode of a step with prefill is not a quiet step
    for _ in range(60):
        p.observe(
            StepPlan(decode=[0], encode=[1]), 500, tower_s=40 * MS, prefill_s=0.0, decode_s=30 * MS
        )
    assert p.tower_scale == pytest.approx(2.0, rel=1e-3)  # 40 ms against 500 x 0.04 ms
    assert p.quiet_s == 12 * MS


def test_the_budget_stays_within_its_bounds() -> None:
    crawling = StepPacer(quiet_s=1 * MS, token_s=10 * MS, forward_s=0.0, tower_s=0.0)
    assert crawling.costs().budget == MIN_BUDGET
    racing = StepPacer(quiet_s=1.0, token_s=0.001 * MS, forward_s=0.0, tower_s=0.0)
    assert racing.costs().budget == MAX_BUDGET


def packed_pacer() -> StepPacer:
    # The same model, packing: a chunk beside a decode adds 2 ms + 0.4 ms a token to its forward.
    return StepPacer(
        quiet_s=12 * MS, token_s=0.4 * MS, forward_s=8 * MS, tower_s=0.04 * MS, rider_s=2 * MS
    )


def test_a_packed_chunk_is_priced_by_what_it_adds_to_the_decode_forward() -> None:
    p = packed_pacer()
    costs = p.costs()
    assert costs.rider_cost == 5 and costs.forward_cost == 20
    assert pacer().costs().rider_cost is None  # an engine that does not pack
    plan = StepPlan(decode=[0], prefill={1: 10})
    for _ in range(60):  # the packed step: a quiet step plus twice the chunk's predicted 6 ms
        p.observe(plan, 0, tower_s=0.0, prefill_s=24 * MS, decode_s=0.0)
    assert p.prefill_scale == pytest.approx(2.0, rel=1e-3)
    assert p.quiet_s == 12 * MS
    for _ in range(60):  # nothing decoding: one forward for both chunks, 8 + 2 + 20 x 0.4 ms
        p.observe(StepPlan(prefill={1: 10, 2: 10}), 0, tower_s=0.0, prefill_s=18 * MS, decode_s=0.0)
    assert p.prefill_scale == pytest.approx(1.0, rel=1e-3)
