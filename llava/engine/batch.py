"""Advance many answers with one forward pass: their caches stacked into one batch.

Each answer keeps its own KV cache between steps. While the set of answers decoding on a replica
stays the same, their caches live stacked in one `DecodeBatch` (left-padded to the longest, with
a 2-D attention mask and each row's true position in `position_ids`, without which RoPE would
give padded rows wrong positions). When the set changes the batch is split back into the
answers' own caches and restacked: a copy per membership change, not per step.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from llava.engine.state import Turn


class _PreallocatedLayer(DynamicLayer):
    """A cache layer with spare room: each step writes its keys/values in place.

    The stock layer concatenates the whole cache on every step, a full copy per token; here the
    copy happens only when the spare room runs out (and then grows by half).
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        super().__init__()
        self.lazy_initialization(keys, values)
        self._keys, self._values, self._length = keys, values, length
        self._expose()

    def _expose(self) -> None:
        self.keys = self._keys[:, :, : self._length]
        self.values = self._values[:, :, : self._length]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        new = key_states.shape[-2]
        if self._length + new > self._keys.shape[2]:
            room = max(new, self._keys.shape[2] // 2)
            self._keys = _widen(self._keys, room)
            self._values = _widen(self._values, room)
        end = self._length + new
        self._keys[:, :, self._length : end] = key_states
        self._values[:, :, self._length : end] = value_states
        self._length = end
        self._expose()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self._length


def _widen(tensor: torch.Tensor, extra: int) -> torch.Tensor:
    shape = list(tensor.shape)
    shape[2] = extra
    return torch.cat([tensor, tensor.new_zeros(shape)], dim=2)


class DecodeBatch:
    """Several turns' caches stacked so that one forward advances all of them by a token."""

    def __init__(self, turns: list[Turn]) -> None:
        self.turns = list(turns)
        self._lengths = [t.cache.get_seq_length() for t in turns]
        width = max(self._lengths)
        self._pad = [width - n for n in self._lengths]
        self._steps = 0
        room = width + max((t.max_new_tokens - len(t.generated) for t in turns), default=0) + 1
        self.cache = DynamicCache()
        for layer_idx in range(len(turns[0].cache.layers)):
            keys = self._stack([t.cache.layers[layer_idx].keys for t in turns], room)
            values = self._stack([t.cache.layers[layer_idx].values for t in turns], room)
            self.cache.layers.append(_PreallocatedLayer(keys, values, width))
        device = turns[0].cache.layers[0].keys.device
        self._mask = torch.zeros(len(turns), width, dtype=torch.long, device=device)
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
        """Tell whether this batch holds exactly `turns`, in order."""
        return len(turns) == len(self.turns) and all(
            a is b for a, b in zip(turns, self.turns, strict=True)
        )

    def forward(self, model: torch.nn.Module) -> torch.Tensor:
        """Feed each turn's pending token; return next-token logits, one row per turn."""
        device = self._mask.device
        input_ids = torch.tensor([t.pending for t in self.turns], device=device)
        mask = torch.cat([self._mask, self._mask.new_ones((len(self.turns), 1))], dim=1)
        out = model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=self._positions[:, None],
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        self._mask = mask
        self._positions = self._positions + 1
        self._steps += 1
        return out.logits[:, -1]

    def unstack(self) -> None:
        """Give every turn its own cache back, without padding and with the steps taken here.

        Safe after a failed forward too: each row is cut to the length of the completed steps,
        whatever a half-finished forward appended to some layers.
        """
        for row, turn in enumerate(self.turns):
            start = self._pad[row]
            stop = start + self._lengths[row] + self._steps
            for batched, own in zip(self.cache.layers, turn.cache.layers, strict=True):
                own.keys = batched.keys[row : row + 1, :, start:stop].clone()
                own.values = batched.values[row : row + 1, :, start:stop].clone()
        self.turns = []
