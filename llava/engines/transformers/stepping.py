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

from llava.engines.transformers.decoding.sampling import next_token
from llava.engines.transformers.model.cache import crop_to
from llava.engines.transformers.model.packed import Piece, packed_forward
from llava.engines.transformers.scheduling.scheduler import Pending, RoomFor, plan_step
from llava.engines.transformers.state.session import Turn

if TYPE_CHECKING:
    from llava.engines.transformers.runner import ModelRunner


@torch.inference_mode()
def run_step(runner: ModelRunner, turns: list[Turn]) -> dict[int, BaseException]:
    """Run one step over `turns`; return each failure by position."""
    costs = runner.pacer.costs() if runner.pacer is not None else runner.fixed_costs
    work = [_pending(i, t, costs.tower_ratio) for i, t in enumerate(turns) if not t.done]
    rider = costs.rider_cost if runner.packs else None
    plan = plan_step(work, costs.budget, costs.forward_cost, rider, _room_for(runner))
    tower_tokens = sum(turns[i].tower_tokens for i in plan.encode)
    errors: dict[int, BaseException] = {}
    started = _clock(runner)
    for i in plan.encode:
        try:
            _encode(runner, turns[i])
        except Exception as exc:  # one failing answer must not fail the others
            errors[i] = exc
    encoded = _clock(runner) if plan.encode else started
    if rider is not None and plan.prefill:  # one forward per replica: its time is the chunks'
        for replica_idx, positions in _by_replica(runner, turns, [*plan.prefill, *plan.decode]):
            errors.update(_packed(runner, replica_idx, turns, plan.prefill, positions))
        prefilled = _clock(runner)
    else:
        errors.update(_unpacked(runner, turns, plan.prefill, []))
        prefilled = _clock(runner) if plan.prefill else encoded
        errors.update(_unpacked(runner, turns, {}, plan.decode))
    if runner.pacer is not None and not errors:  # a failed piece's time says nothing
        runner.pacer.observe(
            plan,
            tower_tokens,
            tower_s=encoded - started,
            prefill_s=prefilled - encoded,
            decode_s=_clock(runner) - prefilled,
        )
    return errors


def _by_replica(
    runner: ModelRunner, turns: list[Turn], positions: list[int]
) -> list[tuple[int, list[int]]]:
    """Group turn positions by the replica their session lives on."""
    groups: dict[int, list[int]] = {}
    for i in positions:
        groups.setdefault(runner.replicas.index(turns[i].state.replica), []).append(i)
    return list(groups.items())


def _unpacked(
    runner: ModelRunner, turns: list[Turn], chunks: dict[int, int], decodes: list[int]
) -> dict[int, BaseException]:
    """Run each chunk in a forward of its own, then the decodes stacked per replica."""
    errors: dict[int, BaseException] = {}
    for i, tokens in chunks.items():
        try:
            _prefill(runner, turns[i], tokens)
        except Exception as exc:
            errors[i] = exc
    for replica_idx, positions in _by_replica(runner, turns, decodes):
        errors.update(runner.decoder.decode(replica_idx, [(i, turns[i]) for i in positions]))
    return errors


def _packed(
    runner: ModelRunner,
    replica_idx: int,
    turns: list[Turn],
    chunks: dict[int, int],
    positions: list[int],
) -> dict[int, BaseException]:
    """Run one replica's chunks and decodes in one forward; alone if it fails."""
    mine = {i: n for i, n in chunks.items() if i in positions}
    decodes = [i for i in positions if i not in mine]
    if len(positions) == 1:  # nothing to pack with
        return _unpacked(runner, turns, mine, decodes)
    stacked, alone = runner.decoder.stackable([(i, turns[i]) for i in decodes])
    if len(stacked) < 2:  # nothing to stack: each decode is a piece of its own
        stacked, alone = [], [*stacked, *alone]
    batch = None
    try:
        pieces = [_piece(runner, turns[i], n) for i, n in mine.items()]
        if stacked:  # their stacked cache, as one piece
            batch = runner.decoder.batch_for(replica_idx, [t for _, t in stacked])
            pieces.append(batch.piece())
        else:
            runner.decoder.split(replica_idx)
        pieces += [_piece(runner, turn, None) for _, turn in alone]
        logits = packed_forward(runner.replicas[replica_idx].model, pieces, runner.image_token_id)
    except Exception:  # every cache is as it was: run each piece alone, so only a culprit fails
        return _unpacked(runner, turns, mine, decodes)
    errors: dict[int, BaseException] = {}
    for row, (i, tokens) in enumerate(mine.items()):
        turn = turns[i]
        try:
            token = _sample(turn, logits[row], tokens) if _samples(turn, tokens) else None
            _chunk_fed(runner, turn, turn.pending[:tokens], token)
        except Exception as exc:
            errors[i] = exc
    rows = logits[len(mine) :]
    if batch is not None:
        batch.advance()
        failed = runner.decoder.accept_rows([t for _, t in stacked], rows[: len(stacked)])
        errors.update({stacked[row][0]: exc for row, exc in failed.items()})
    for (i, turn), row in zip(alone, rows[len(stacked) :], strict=True):
        try:
            token = _sample(turn, row, 1)
        except Exception as exc:
            errors[i] = exc
        else:
            turn.fed = turn.fed + turn.pending
            runner.decoder.accept(turn, token)
    return errors


def _piece(runner: ModelRunner, turn: Turn, tokens: int | None) -> Piece:
    """A turn's share of a packed forward: its next chunk, or its pending token."""
    if tokens is None:
        return Piece(turn.cache, turn.pending)
    offset = sum(1 for i in turn.fed if i == runner.image_token_id)
    return Piece(turn.cache, turn.pending[:tokens], turn.features, offset)


def _sample(turn: Turn, logits: torch.Tensor, fed: int) -> int:
    """Choose the turn's next token; on failure cut back the `fed` positions just added."""
    try:
        return next_token(logits, turn.params, turn.generator)
    except BaseException:
        crop_to(turn.cache, turn.cache.get_seq_length() - fed)
        raise


def _clock(runner: ModelRunner) -> float:
    """Read the time once the devices are done (GPU work is asynchronous), for the pacer."""
    if runner.pacer is not None:
        for replica in runner.replicas:
            if replica.device.type == "cuda":
                torch.cuda.synchronize(replica.device)
    return time.perf_counter()


def _room_for(runner: ModelRunner) -> RoomFor | None:
    """What bounds a chunk's tokens by the bytes its forward may allocate (`workspace.py`):
    packed, beside every piece planned so far (on one replica or not: an upper bound);
    unpacked, its forward runs alone."""
    reserve, workspace = runner.workspace_reserve, runner.workspace
    if reserve is None:
        return None

    def room(context: int, planned: list[tuple[int, int]]) -> int:
        return workspace.room(context, planned if runner.packs else [], reserve)

    return room


def _pending(index: int, turn: Turn, tower_ratio: float) -> Pending:
    tower = turn.tower_tokens
    return Pending(
        index=index,
        decoding=not turn.prefilling,
        tower_cost=max(1, round(tower * tower_ratio)) if tower else 0,
        prefill=len(turn.pending),
        follow_up=turn.start_len > 0,
        context=len(turn.fed),
    )


def _encode(runner: ModelRunner, turn: Turn) -> None:
    """Run the vision tower over the turn's new images (all of them, in pixels mode)."""
    replica = turn.state.replica
    if turn.images.pending is not None:
        turn.images = runner.images.encode_pending(replica.model, replica.device, turn.images)
    turn.features = runner.images.features(replica.model, replica.device, turn.images)
    turn.tower_tokens = 0


def _prefill(runner: ModelRunner, turn: Turn, tokens: int) -> None:
    """Feed the next `tokens` pending ids; after the last chunk, choose the first token."""
    piece = _piece(runner, turn, tokens)
    sample = _samples(turn, tokens)
    token = runner.decoder.feed(turn, piece.ids, piece.features, piece.offset, sample=sample)
    _chunk_fed(runner, turn, piece.ids, token)


def _samples(turn: Turn, tokens: int) -> bool:
    """Whether feeding `tokens` more ends the prompt of an answer (an open generates nothing)."""
    return tokens == len(turn.pending) and not turn.opening


def _chunk_fed(runner: ModelRunner, turn: Turn, chunk: list[int], token: int | None) -> None:
    """Record a fed chunk; after the last, the first token (`token`), or an open's end."""
    turn.fed, turn.pending = turn.fed + chunk, turn.pending[len(chunk) :]
    if turn.pending:
        return
    turn.first_token_at = time.perf_counter()
    if token is None:  # an open: its prefix is cached, nothing to generate
        turn.done, turn.finished_at = True, turn.first_token_at
        return
    runner.decoder.accept(turn, token)
