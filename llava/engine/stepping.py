"""One engine step: run what the scheduler planned, piece by piece, and time it for the pacer.

The scheduler (`scheduler.py`) chooses the step's pieces under the budget the pacer
(`pacing.py`) derives from earlier steps: vision-tower runs, prefill chunks, and one token for
every answer decoding (answers on the same replica share one stacked forward). Each piece fails
alone and leaves its cache as it was (`forward.py`). The time of each kind of piece goes back to
the pacer, so the next step's budget follows what steps really cost.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from llava.engine.scheduler import Pending, plan_step
from llava.engine.state import Turn

if TYPE_CHECKING:
    from llava.engine.engine import LlavaEngine


@torch.inference_mode()
def run_step(engine: LlavaEngine, turns: list[Turn]) -> dict[int, BaseException]:
    """Run one step over `turns`; return each failure by position."""
    costs = engine.pacer.costs() if engine.pacer is not None else engine.fixed_costs
    work = [_pending(i, t, costs.tower_ratio) for i, t in enumerate(turns) if not t.done]
    plan = plan_step(work, costs.budget, costs.forward_cost)
    tower_tokens = sum(turns[i].tower_tokens for i in plan.encode)
    errors: dict[int, BaseException] = {}
    started = _clock(engine)
    for i in plan.encode:
        try:
            _encode(engine, turns[i])
        except Exception as exc:  # one failing answer must not fail the others
            errors[i] = exc
    encoded = _clock(engine) if plan.encode else started
    for i, tokens in plan.prefill.items():
        try:
            _prefill(engine, turns[i], tokens)
        except Exception as exc:
            errors[i] = exc
    prefilled = _clock(engine) if plan.prefill else encoded
    decoding: dict[int, list[tuple[int, Turn]]] = {}
    for i in plan.decode:
        turn = turns[i]
        decoding.setdefault(engine.replicas.index(turn.state.replica), []).append((i, turn))
    for replica_idx, group in decoding.items():
        errors.update(engine.decoder.decode(replica_idx, group))
    if engine.pacer is not None and not errors:  # a failed piece's time says nothing
        engine.pacer.observe(
            plan,
            tower_tokens,
            tower_s=encoded - started,
            prefill_s=prefilled - encoded,
            decode_s=_clock(engine) - prefilled,
        )
    return errors


def _clock(engine: LlavaEngine) -> float:
    """Read the time once the devices are done (GPU work is asynchronous), for the pacer."""
    if engine.pacer is not None:
        for replica in engine.replicas:
            if replica.device.type == "cuda":
                torch.cuda.synchronize(replica.device)
    return time.perf_counter()


def _pending(index: int, turn: Turn, tower_ratio: float) -> Pending:
    tower = turn.tower_tokens
    return Pending(
        index=index,
        decoding=not turn.prefilling,
        tower_cost=max(1, round(tower * tower_ratio)) if tower else 0,
        prefill=len(turn.pending),
        follow_up=turn.start_len > 0,
    )


def _encode(engine: LlavaEngine, turn: Turn) -> None:
    """Run the vision tower over the turn's new images (all of them, in pixels mode)."""
    replica = turn.state.replica
    if turn.images.pending is not None:
        turn.images = engine.images.encode_pending(replica.model, replica.device, turn.images)
    turn.features = engine.images.features(replica.model, replica.device, turn.images)
    turn.tower_tokens = 0


def _prefill(engine: LlavaEngine, turn: Turn, tokens: int) -> None:
    """Feed the next `tokens` pending ids; after the last chunk, choose the first token."""
    chunk, rest = turn.pending[:tokens], turn.pending[tokens:]
    offset = sum(1 for i in turn.fed if i == engine.image_token_id)
    last = not rest and not turn.opening
    token = engine.decoder.feed(turn, chunk, turn.features, offset, sample=last)
    turn.fed, turn.pending = turn.fed + chunk, rest
    if rest:
        return
    turn.first_token_at = time.perf_counter()
    if token is None:  # an open: its prefix is cached, nothing to generate
        turn.done, turn.finished_at = True, turn.first_token_at
        return
    engine.decoder.accept(turn, token)
