"""One engine step: run what the scheduler planned, piece by piece, and time it for the pacer.

The scheduler (`scheduler.py`) chooses the step's pieces under the budget the pacer
(`pacing.py`) derives from earlier steps: vision-tower runs, prefill chunks, and one token for
every answer decoding. Where the engine packs (`packed.py`), a replica's chunks and decodes run
in one forward; otherwise each chunk runs its own and the decodes share a stacked one
(`batch.py`). A failed packed forward leaves every cache as it was and its pieces run again
alone, so each piece fails alone and leaves its cache as it was (`forward.py`). The time of each
kind of piece goes back to the pacer, so the next step's budget follows what steps really cost.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from llava.engine.decoding.sampling import next_token
from llava.engine.model.cache import crop_to
from llava.engine.model.packed import Piece, packed_forward
from llava.engine.scheduling.scheduler import Pending, plan_step
from llava.engine.state.session import Turn

if TYPE_CHECKING:
    from llava.engine.engine import LlavaEngine


@torch.inference_mode()
def run_step(engine: LlavaEngine, turns: list[Turn]) -> dict[int, BaseException]:
    """Run one step over `turns`; return each failure by position."""
    costs = engine.pacer.costs() if engine.pacer is not None else engine.fixed_costs
    work = [_pending(i, t, costs.tower_ratio) for i, t in enumerate(turns) if not t.done]
    rider = costs.rider_cost if engine.packs else None
    plan = plan_step(work, costs.budget, costs.forward_cost, rider)
    tower_tokens = sum(turns[i].tower_tokens for i in plan.encode)
    errors: dict[int, BaseException] = {}
    started = _clock(engine)
    for i in plan.encode:
        try:
            _encode(engine, turns[i])
        except Exception as exc:  # one failing answer must not fail the others
            errors[i] = exc
    encoded = _clock(engine) if plan.encode else started
    if rider is not None and plan.prefill:  # one forward per replica: its time is the chunks'
        for replica_idx, positions in _by_replica(engine, turns, [*plan.prefill, *plan.decode]):
            errors.update(_packed(engine, replica_idx, turns, plan.prefill, positions))
        prefilled = _clock(engine)
    else:
        errors.update(_unpacked(engine, turns, plan.prefill, []))
        prefilled = _clock(engine) if plan.prefill else encoded
        errors.update(_unpacked(engine, turns, {}, plan.decode))
    if engine.pacer is not None and not errors:  # a failed piece's time says nothing
        engine.pacer.observe(
            plan,
            tower_tokens,
            tower_s=encoded - started,
            prefill_s=prefilled - encoded,
            decode_s=_clock(engine) - prefilled,
        )
    return errors


def _by_replica(
    engine: LlavaEngine, turns: list[Turn], positions: list[int]
) -> list[tuple[int, list[int]]]:
    """Group turn positions by the replica their session lives on."""
    groups: dict[int, list[int]] = {}
    for i in positions:
        groups.setdefault(engine.replicas.index(turns[i].state.replica), []).append(i)
    return list(groups.items())


def _unpacked(
    engine: LlavaEngine, turns: list[Turn], chunks: dict[int, int], decodes: list[int]
) -> dict[int, BaseException]:
    """Run each chunk in a forward of its own, then the decodes stacked per replica."""
    errors: dict[int, BaseException] = {}
    for i, tokens in chunks.items():
        try:
            _prefill(engine, turns[i], tokens)
        except Exception as exc:
            errors[i] = exc
    for replica_idx, positions in _by_replica(engine, turns, decodes):
        errors.update(engine.decoder.decode(replica_idx, [(i, turns[i]) for i in positions]))
    return errors


def _packed(
    engine: LlavaEngine,
    replica_idx: int,
    turns: list[Turn],
    chunks: dict[int, int],
    positions: list[int],
) -> dict[int, BaseException]:
    """Run one replica's chunks and decodes in one forward; alone if it fails."""
    mine = {i: n for i, n in chunks.items() if i in positions}
    decodes = [i for i in positions if i not in mine]
    if len(positions) == 1:  # nothing to pack with
        return _unpacked(engine, turns, mine, decodes)
    decoding = [turns[i] for i in decodes]
    batch = None
    try:
        pieces = [_piece(engine, turns[i], n) for i, n in mine.items()]
        if len(decoding) > 1:  # their stacked cache, as one piece
            batch = engine.decoder.batch_for(replica_idx, decoding)
            pieces.append(batch.piece())
        elif decoding:
            engine.decoder.split(replica_idx)
            pieces.append(_piece(engine, decoding[0], None))
        logits = packed_forward(engine.replicas[replica_idx].model, pieces, engine.image_token_id)
    except Exception:  # every cache is as it was: run each piece alone, so only a culprit fails
        return _unpacked(engine, turns, mine, decodes)
    errors: dict[int, BaseException] = {}
    for row, (i, tokens) in enumerate(mine.items()):
        turn = turns[i]
        try:
            token = _sample(turn, logits[row], tokens) if _samples(turn, tokens) else None
            _chunk_fed(engine, turn, turn.pending[:tokens], token)
        except Exception as exc:
            errors[i] = exc
    rows = logits[len(mine) :]
    if batch is not None:
        batch.advance()
        engine.decoder.accept_rows(decoding, rows)
    elif decoding:
        turn = decoding[0]
        try:
            token = _sample(turn, rows[0], 1)
        except Exception as exc:
            errors[decodes[0]] = exc
        else:
            turn.fed = turn.fed + turn.pending
            engine.decoder.accept(turn, token)
    return errors


def _piece(engine: LlavaEngine, turn: Turn, tokens: int | None) -> Piece:
    """A turn's share of a packed forward: its next chunk, or its pending token."""
    if tokens is None:
        return Piece(turn.cache, turn.pending)
    offset = sum(1 for i in turn.fed if i == engine.image_token_id)
    return Piece(turn.cache, turn.pending[:tokens], turn.features, offset)


def _sample(turn: Turn, logits: torch.Tensor, fed: int) -> int:
    """Choose the turn's next token; on failure cut back the `fed` positions just added."""
    try:
        return next_token(logits, turn.params, turn.generator)
    except BaseException:
        crop_to(turn.cache, turn.cache.get_seq_length() - fed)
        raise


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
    piece = _piece(engine, turn, tokens)
    sample = _samples(turn, tokens)
    token = engine.decoder.feed(turn, piece.ids, piece.features, piece.offset, sample=sample)
    _chunk_fed(engine, turn, piece.ids, token)


def _samples(turn: Turn, tokens: int) -> bool:
    """Whether feeding `tokens` more ends the prompt of an answer (an open generates nothing)."""
    return tokens == len(turn.pending) and not turn.opening


def _chunk_fed(engine: LlavaEngine, turn: Turn, chunk: list[int], token: int | None) -> None:
    """Record a fed chunk; after the last, the first token (`token`), or an open's end."""
    turn.fed, turn.pending = turn.fed + chunk, turn.pending[len(chunk) :]
    if turn.pending:
        return
    turn.first_token_at = time.perf_counter()
    if token is None:  # an open: its prefix is cached, nothing to generate
        turn.done, turn.finished_at = True, turn.first_token_at
        return
    engine.decoder.accept(turn, token)
