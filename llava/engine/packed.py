"""One forward for many sessions' pieces: prefill chunks and decode tokens packed in one row.

On a CPU or a GPU a forward's cost is mostly reading the weights, whatever its length: a step
that runs a prefill chunk beside a decode in two forwards pays that twice. vLLM and SGLang feed
every piece of a step through one forward, the tokens of all sequences packed in one row, each
sequence attending only to its own cache. This is that forward over transformers' models: the
pieces' tokens go in one row with their own positions; a packed cache appends each piece's new
keys and values to its own session's cache; and a registered attention function attends each
piece's queries to its own cache, causally. The keys and values are never copied together.

All or nothing, as `forward.py`: a failure in any layer cuts every piece's cache back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, DynamicCache
from transformers.cache_utils import DynamicLayer
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from llava.engine.cache import crop_to
from llava.engine.vision import embed

PREFIX = "llava_packed_"  # + the attention the model was loaded with: what unpacked calls use
_NO_MASK = torch.zeros(1, 1, 1, 1, dtype=torch.bool)  # a 4-D mask: transformers builds none


@dataclass(frozen=True)
class Piece:
    """A session's tokens in a packed forward: a prefill chunk or a decode token."""

    cache: DynamicCache
    ids: list[int]
    features: torch.Tensor | None = None  # the session's image features (prefill chunks)
    offset: int = 0  # the first image token's row in `features`


def enable_packing(model: Any) -> bool:
    """Route the language model's attention through the packing attention, if it runs on an
    attention function transformers registers (sdpa, flash attention; not the per-model eager
    one, which unpacked forwards would then lose)."""
    text = model.config.get_text_config()
    base = text._attn_implementation
    if base.startswith(PREFIX):
        return True
    if base not in ALL_ATTENTION_FUNCTIONS or base not in ALL_MASK_ATTENTION_FUNCTIONS:
        return False
    name = PREFIX + base
    if name not in ALL_ATTENTION_FUNCTIONS:
        unpacked = ALL_ATTENTION_FUNCTIONS[base]

        def attention(
            module: Any,
            query: torch.Tensor,
            key: torch.Tensor,
            value: torch.Tensor,
            attention_mask: Any,
            packing: list[tuple[DynamicCache, int]] | None = None,
            **kwargs: Any,
        ) -> tuple[torch.Tensor, Any]:
            if packing is None:  # every other forward: the attention the model was loaded with
                return unpacked(module, query, key, value, attention_mask, **kwargs)
            return _attend(
                module, query, packing, kwargs.get("scaling"), kwargs.get("sliding_window")
            )

        AttentionInterface.register(name, attention)
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base])
    model.set_attn_implementation({"text_config": name})
    return True


def _attend(
    module: Any,
    query: torch.Tensor,
    pieces: list[tuple[DynamicCache, int]],
    scaling: float | None,
    window: int | None,
) -> tuple[torch.Tensor, None]:
    """Attend each piece's queries to its own cache (its new keys already appended), causally
    and, for a sliding-window layer, to the last `window` positions only."""
    outputs, start = [], 0
    for cache, count in pieces:
        layer = cache.layers[module.layer_idx]
        keys, values = layer.keys, layer.values
        q = query[:, :, start : start + count]
        start += count
        total = keys.shape[2]
        mask = None
        if count > 1 or (window is not None and total > window):
            # query i is at position total - count + i: it sees the keys up to there
            mask = torch.ones(count, total, dtype=torch.bool, device=q.device).tril(total - count)
            if window is not None:
                mask &= ~mask.tril(total - count - window)
        outputs.append(
            F.scaled_dot_product_attention(
                q,
                keys,
                values,
                attn_mask=mask,
                scale=scaling,
                enable_gqa=keys.shape[1] != q.shape[1],
            )
        )
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous(), None


class _PackedLayer(DynamicLayer):
    """One layer of the packed cache: appends each piece's keys and values to its own cache."""

    def __init__(self, index: int, caches: list[DynamicCache], counts: list[int]) -> None:
        super().__init__()
        self.index, self.caches, self.counts = index, caches, counts

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        start = 0
        for cache, count in zip(self.caches, self.counts, strict=True):
            layer = cache.layers[self.index]
            layer.update(
                key_states[:, :, start : start + count], value_states[:, :, start : start + count]
            )
            start += count
        return key_states, value_states


def packed_forward(model: Any, pieces: list[Piece], image_token_id: int) -> torch.Tensor:
    """Feed every piece in one forward; return each piece's last logits row [pieces, vocab]."""
    before = [p.cache.get_seq_length() for p in pieces]
    counts = [len(p.ids) for p in pieces]
    caches = [p.cache for p in pieces]
    try:
        embeds = torch.cat(
            [embed(model, p.ids, image_token_id, p.features, p.offset) for p in pieces], dim=1
        )
        device = embeds.device
        positions = torch.cat(
            [torch.arange(b, b + n, device=device) for b, n in zip(before, counts, strict=True)]
        )[None]
        ends = torch.tensor(counts, device=device).cumsum(0) - 1
        packed = DynamicCache()
        packed.layers = [_PackedLayer(i, caches, counts) for i in range(len(caches[0].layers))]
        out = model(
            inputs_embeds=embeds,
            attention_mask=_NO_MASK.to(device),
            position_ids=positions,
            past_key_values=packed,
            use_cache=True,
            logits_to_keep=ends,
            packing=list(zip(caches, counts, strict=True)),
        )
    except BaseException:
        for cache, length in zip(caches, before, strict=True):
            crop_to(cache, length)
        raise
    return out.logits[0]
