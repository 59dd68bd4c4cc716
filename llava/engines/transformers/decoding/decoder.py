"""Advance answers that are decoding by one token each: stacked per replica, alone on failure.

While the same answers decode on a replica, their caches stay stacked in one `DecodeBatch` and
one forward advances them all. If that shared forward fails (a fault in any layer, an
out-of-memory error), the batch is split back into each answer's own cache, cut to the steps it
completed, and each answer is retried alone: only an answer that fails on its own gets an error,
and the others go on exactly as if nothing had happened.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from llava.engines.conversation.text import finish_answer, show
from llava.engines.transformers.decoding.batch import DecodeBatch, batch_bytes
from llava.engines.transformers.decoding.sampling import next_token
from llava.engines.transformers.model.cache import crop_to
from llava.engines.transformers.model.workspace import Workspace
from llava.engines.transformers.state.session import Replica, Turn

Forward = Callable[[Replica, Any, list[int], Any, int], torch.Tensor]
log = logging.getLogger(__name__)


class Decoder:
    """Decode steps for every replica, and the bookkeeping of each sampled token."""

    def __init__(
        self, replicas: list[Replica], forward: Forward, eos_ids: set[int], workspace: Workspace
    ) -> None:
        self.replicas = replicas
        self.forward = forward
        self.eos_ids = eos_ids
        self.workspace = workspace
        self._batches: dict[int, DecodeBatch] = {}  # replica index -> stacked decode batch
        # What a stacked batch may allocate (its rows padded to the longest, with room for the
        # longest answer still to come): the device budget's half reserved for it (budget.py).
        # None: unbounded (a CPU, where sessions live in host memory).
        self.batch_budget: int | None = None
        # What one forward may allocate beyond the caches (`workspace.py`); the stacked
        # forward's rows, padded to the longest, stay within it too. None: unbounded.
        self.workspace_reserve: int | None = None
        self.alone_for_room = 0  # answers' steps decoded alone: the batch had no room for them
        self.stack_failures = 0  # stacked forwards that failed, their answers then run alone

    @property
    def stacked(self) -> bool:
        """Whether some answers are decoding in a stacked batch right now."""
        return bool(self._batches)

    def decode(self, replica_idx: int, group: list[tuple[int, Turn]]) -> dict[int, Exception]:
        """Advance each (position, turn) of one replica by a token; return errors by position."""
        stacked, alone = self.stackable(group)
        if len(stacked) < 2:
            self.split(replica_idx)
            return self._decode_alone(group)
        turns = [t for _, t in stacked]
        try:
            batch = self.batch_for(replica_idx, turns)  # gives the others their caches back
        except Exception:
            self.split(replica_idx)
            return self._decode_alone(group)
        errors = self._decode_alone(alone)
        try:
            logits = batch.forward(self.replicas[replica_idx].model)
        except Exception as exc:  # the shared forward failed: retry alone: only a culprit fails
            self.stack_failures += 1
            log.warning("stacked decode failed (%s); each answer decodes alone", exc)
            self.split(replica_idx)
            return {**errors, **self._decode_alone(stacked)}
        failed = self.accept_rows(turns, logits)
        return {**errors, **{stacked[row][0]: exc for row, exc in failed.items()}}

    def stackable(
        self, group: list[tuple[int, Turn]]
    ) -> tuple[list[tuple[int, Turn]], list[tuple[int, Turn]]]:
        """Split answers into those a stacked batch holds within `batch_budget` and its forward
        within `workspace_reserve` (the shortest first), and those that decode alone: one long
        conversation among short ones would pad every row to its length."""
        if (self.batch_budget is None and self.workspace_reserve is None) or len(group) < 2:
            return group, []
        ordered = sorted(group, key=lambda item: item[1].cache.get_seq_length())
        turns = [t for _, t in ordered]
        fit, over = 0, len(turns) + 1  # the most shortest rows that fit: each row costs more
        while over - fit > 1:
            middle = (fit + over) // 2
            fit, over = (middle, over) if self._fits(turns[:middle]) else (fit, middle)
        stacked = ordered[:fit]
        kept = {id(t) for _, t in stacked}
        alone = [item for item in group if id(item[1]) not in kept]
        if alone and len(stacked) > 1:
            self.alone_for_room += len(alone)
            log.debug(
                "%d answer(s) decode alone: no room for them in the stacked batch", len(alone)
            )
        return [item for item in group if id(item[1]) in kept], alone

    def _fits(self, turns: list[Turn]) -> bool:
        """Tell whether a stacked batch of `turns` and its forward fit their budgets."""
        if self.batch_budget is not None and batch_bytes(turns) > self.batch_budget:
            return False
        if self.workspace_reserve is not None:
            widths = [t.cache.get_seq_length() for t in turns]
            if self.workspace.stacked_bytes(widths) > self.workspace_reserve:
                return False
        return True

    def batch_for(self, replica_idx: int, turns: list[Turn]) -> DecodeBatch:
        """Return the replica's stacked batch of exactly `turns`, restacked if its members
        changed."""
        batch = self._batches.get(replica_idx)
        if batch is not None and batch.same_members(turns):
            return batch
        self.split(replica_idx)
        batch = self._batches[replica_idx] = DecodeBatch(turns)
        return batch

    def accept_rows(self, turns: list[Turn], logits: torch.Tensor) -> dict[int, Exception]:
        """Record the token each turn fed and the next one, sampled from its row of `logits`;
        return the rows whose choice failed (a NaN row), each failing its own answer alone."""
        failed: dict[int, Exception] = {}
        for row, turn in enumerate(turns):
            try:
                token = next_token(logits[row], turn.params, turn.generator)
            except Exception as exc:  # its answer is aborted: its cache is cut back then
                failed[row] = exc
                continue
            turn.fed = turn.fed + turn.pending
            self.accept(turn, token)
        return failed

    def _decode_alone(self, group: list[tuple[int, Turn]]) -> dict[int, Exception]:
        errors: dict[int, Exception] = {}
        for i, turn in group:
            try:
                token = self.feed(turn, turn.pending, None, 0, sample=True)
            except Exception as exc:
                errors[i] = exc
                continue
            turn.fed = turn.fed + turn.pending
            assert token is not None
            self.accept(turn, token)
        return errors

    def feed(
        self, turn: Turn, ids: list[int], features: Any, offset: int, *, sample: bool
    ) -> int | None:
        """Feed ids into the turn's cache and, if `sample`, choose the next token.

        A failure in either leaves the cache as it was (the forward cuts itself back; a
        failed choice cuts back what the forward added).
        """
        before = turn.cache.get_seq_length()
        logits = self.forward(turn.state.replica, turn.cache, ids, features, offset)
        if not sample:
            return None
        try:
            return next_token(logits, turn.params, turn.generator)
        except BaseException:
            crop_to(turn.cache, before)
            raise

    def accept(self, turn: Turn, token: int) -> None:
        """Record one sampled token: end the answer, or emit its text and feed it next."""
        turn.delta = ""
        if token in self.eos_ids:
            self._finish(turn, "stop")
            return
        turn.generated.append(token)
        turn.detokenizer.add(token)
        turn.pending = [token]
        if show(turn, final=False):
            self._finish(turn, "stop")
        elif len(turn.generated) >= turn.max_new_tokens:
            self._finish(turn, "length")

    def cut_short(self, turn: Turn) -> None:
        """End an answer now, with the text it has, as if it reached its length limit."""
        if not turn.done:
            self._finish(turn, "length")

    def _finish(self, turn: Turn, reason: str) -> None:
        finish_answer(turn, reason)

    def split(self, replica_idx: int) -> None:
        """Give the answers of a replica's stacked batch their own caches back."""
        batch = self._batches.get(replica_idx)
        if batch is not None:
            batch.unstack()  # all or nothing: if it fails the batch stays, whole
            del self._batches[replica_idx]

    def split_all(self) -> None:
        for replica_idx in list(self._batches):
            self.split(replica_idx)

    def drop(self, turn: Turn) -> None:
        """Take an abandoned answer out of its stacked batch without copying anything: its
        cache is rolled back, not brought up to date, so no copy can fail it (or the others,
        which keep their rows until the batch is restacked)."""
        for batch in self._batches.values():
            batch.forget(turn)

    def detach(self, turn: Turn) -> None:
        """Make sure a turn's own cache is current (it may live in a stacked batch)."""
        for replica_idx, batch in list(self._batches.items()):
            if any(t is turn for t in batch.turns):
                self.split(replica_idx)
