"""Advance many answers with one forward pass: their caches stacked into one batch.

Each answer keeps its own KV cache between steps. While the set of answers decoding on a replica
stays the same, their caches live stacked in one `DecodeBatch` (left-padded to the longest, with
a 2-D attention mask and each row's true position in `position_ids`, without which RoPE would
give padded rows wrong positions). When the set changes the batch is split back into the
answers' own caches and restacked: a copy per membership change, not per step.
"""

from __future__ import annotations

import torch

from llava.engines.transformers.model.cache import assign, batch_cache
from llava.engines.transformers.model.packed import Piece
from llava.engines.transformers.state.session import Turn


class DecodeBatch:
    """Several turns' caches stacked so that one forward advances all of them by a token."""

    def __init__(self, turns: list[Turn]) -> None:
        self.turns = list(turns)
        self._lengths = [t.cache.get_seq_length() for t in turns]
        width, room = padded_room(turns)
        self._pad = [width - n for n in self._lengths]
        self._steps = 0
        self._forgotten: set[int] = set()  # rows of abandoned turns: never copied back
        self.cache = batch_cache(
            [
                (
                    self._stack([t.cache.layers[i].keys for t in turns], room),
                    self._stack([t.cache.layers[i].values for t in turns], room),
                )
                for i in range(len(turns[0].cache.layers))
            ],
            width,
        )
        device = turns[0].cache.layers[0].keys.device
        # 1 where a row has a key: its cached positions, then the token fed next
        self._mask = torch.zeros(len(turns), width + 1, dtype=torch.long, device=device)
        for row, pad in enumerate(self._pad):
            self._mask[row, pad:] = 1
        self._positions = torch.tensor(self._lengths, device=device)

    def _stack(self, tensors: list[torch.Tensor], room: int) -> torch.Tensor:
        """Left-pad each [1, heads, len, dim] tensor to the batch width, with spare room after."""
        first, width = tensors[0], max(self._lengths)
        out = first.new_zeros((len(tensors), first.shape[1], room, first.shape[3]))
        for row, tensor in enumerate(tensors):
            out[row, :, width - tensor.shape[2] : width] = tensor[0]
        return out

    def same_members(self, turns: list[Turn]) -> bool:
        """Tell whether this batch holds exactly `turns`, in order (none forgotten)."""
        return (
            not self._forgotten
            and len(turns) == len(self.turns)
            and all(a is b for a, b in zip(turns, self.turns, strict=True))
        )

    def forget(self, turn: Turn) -> None:
        """Leave an abandoned turn's row behind: it is never copied back to the turn's cache
        (which is rolled back instead), and the batch is restacked without it."""
        self._forgotten.update(row for row, t in enumerate(self.turns) if t is turn)

    def forward(self, model: torch.nn.Module) -> torch.Tensor:
        """Feed each turn's pending token; return next-token logits, one row per turn."""
        device = self._mask.device
        input_ids = torch.tensor([t.pending for t in self.turns], device=device)
        out = model(
            input_ids=input_ids,
            attention_mask=self._mask,
            position_ids=self._positions[:, None],
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        self.advance()
        return out.logits[:, -1]

    def piece(self) -> Piece:
        """Each turn's pending token as one piece of a packed forward (`packed.py`)."""
        ids = [t.pending[0] for t in self.turns]
        return Piece(self.cache, ids, positions=self._positions, mask=self._mask)

    def advance(self) -> None:
        """Account for a token fed to every row (by `forward`, or by a packed forward)."""
        self._mask = torch.cat([self._mask, self._mask.new_ones((len(self.turns), 1))], dim=1)
        self._positions = self._positions + 1
        self._steps += 1

    def unstack(self) -> None:
        """Give every turn its own cache back, without padding and with the steps taken here.

        All or nothing: every row of every layer is copied out before any turn's cache is
        switched, so a copy that fails (out of memory) leaves the batch whole and every turn as
        it was. Safe after a failed forward too: each row is cut to the length of the completed
        steps, whatever a half-finished forward appended to some layers.
        """
        copies = []
        for row, turn in enumerate(self.turns):
            if row in self._forgotten:
                continue
            start = self._pad[row]
            stop = start + self._lengths[row] + self._steps
            for batched, own in zip(self.cache.layers, turn.cache.layers, strict=True):
                copies.append(
                    (
                        own,
                        _row(batched.keys, row, start, stop),
                        _row(batched.values, row, start, stop),
                    )
                )
        for own, keys, values in copies:
            assign(own, keys, values)
        self.turns = []


def _row(tensor: torch.Tensor, row: int, start: int, stop: int) -> torch.Tensor:
    """Copy one row's positions out of a stacked cache tensor."""
    return tensor[row : row + 1, :, start:stop].clone()


def padded_room(turns: list[Turn]) -> tuple[int, int]:
    """Return the width a stack of turns pads every row to, and the positions it allocates per
    row: that width and room for the longest answer still to come."""
    width = max(t.cache.get_seq_length() for t in turns)
    return width, width + max(t.max_new_tokens - len(t.generated) for t in turns) + 1


def position_bytes(turn: Turn) -> int:
    """Return the bytes one position of a turn's cache takes, keys and values, in every layer."""
    return sum(
        layer.keys.shape[1] * layer.keys.shape[3] * layer.keys.element_size() * 2
        for layer in turn.cache.layers
    )


def batch_bytes(turns: list[Turn]) -> int:
    """Return what stacking `turns` allocates (as `DecodeBatch` preallocates)."""
    return len(turns) * padded_room(turns)[1] * position_bytes(turns[0])
