"""One forward for many sessions' pieces: prefill chunks and decode tokens packed in one row.

On a CPU or a GPU a forward's cost is mostly reading the weights, whatever its length: a step
that runs a prefill chunk beside a decode in two forwards pays that twice. vLLM and SGLang feed
every piece of a step through one forward, the tokens of all sequences packed in one row, each
sequence attending only to its own cache. This is that forward over transformers' models: the
pieces' tokens go in one row with their own positions; a packed cache appends each piece's new
keys and values to its own session's cache; and a registered attention function attends each
piece's queries to its own cache, causally. The keys and values are never copied together. The
answers decoding in a stacked batch (`batch.py`) are one piece: a token per row of their stacked
cache, attended in one call, so a step costs a few attention calls per layer, not one per answer.

All or nothing, as `forward.py`: a failure in any layer cuts every piece's cache back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
from transformers import AttentionInterface, DynamicCache
from transformers.cache_utils import DynamicLayer
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from llava.engines.transformers.model.cache import crop_to
from llava.engines.transformers.model.vision import embed

PACKING = "llava_packs"  # marks an attention function wrapped by `enable_packing`
_NO_MASK = torch.zeros(1, 1, 1, 1, dtype=torch.bool)  # a 4-D mask: transformers builds none


@dataclass(frozen=True)
class Piece:
    """A piece of a packed forward: a session's prefill chunk or decode token, or one token for
    each row of a stacked decode batch (`positions` and `mask` given)."""

    cache: DynamicCache
    ids: list[int]
    features: torch.Tensor | None = None  # the session's image features (prefill chunks)
    offset: int = 0  # the first image token's row in `features`
    positions: torch.Tensor | None = None  # stacked: each row's position
    mask: torch.Tensor | None = None  # stacked: [rows, keys] 1 where a row has a key (fed too)


def enable_packing(model: Any) -> bool:
    """Route the language model's attention through the packing attention, if it runs on an
    attention function transformers registers (sdpa, flash attention; not the per-model eager
    one, which unpacked forwards would then lose).

    The packing attention replaces the registered function under its own name, delegating to
    it for every forward that is not packed: transformers decides things by that name (which
    flash-attention library, which mask), so `flash_attention_2` stays `flash_attention_2`.
    """
    base = model.config.get_text_config()._attn_implementation
    if base not in ALL_ATTENTION_FUNCTIONS or base not in ALL_MASK_ATTENTION_FUNCTIONS:
        return False
    unpacked = ALL_ATTENTION_FUNCTIONS[base]
    if getattr(unpacked, PACKING, False):
        return True

    def attention(
        module: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Any,
        packing: list[tuple[Piece, torch.Tensor | None]] | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, Any]:
        if packing is None:  # every other forward: the attention the model was loaded with
            return unpacked(module, query, key, value, attention_mask, **kwargs)
        return _attend(module, query, packing, kwargs.get("scaling"), kwargs.get("sliding_window"))

    setattr(attention, PACKING, True)
    AttentionInterface.register(base, attention)
    return True


def _attend(
    module: Any,
    query: torch.Tensor,
    packing: list[tuple[Piece, torch.Tensor | None]],
    scaling: float | None,
    window: int | None,
) -> tuple[torch.Tensor, None]:
    """Attend each piece's queries to its own cache (its new keys already appended) under its
    mask and, for a sliding-window layer, to the last `window` positions only."""
    outputs, start = [], 0
    for piece, mask in packing:
        layer = piece.cache.layers[module.layer_idx]
        keys, values = layer.keys, layer.values
        count = len(piece.ids)
        q = query[:, :, start : start + count]
        start += count
        stacked = piece.mask is not None
        if stacked:  # a row per token: [rows, heads, 1, dim]
            q = q.transpose(0, 2)
        total = keys.shape[2]
        attn_mask: Any = mask
        if window is not None and total > window:
            attn_mask = _within(mask, stacked, count, total, window, q.device)
        elif count > 1 and not stacked:  # a chunk: causal, aligned to the end of its cache
            attn_mask = causal_lower_right(count, total)  # no dense mask: the fused kernels run
        if stacked and keys.shape[1] != q.shape[1]:
            out = _grouped_rows(q, keys, values, attn_mask, scaling).transpose(0, 2)
        else:
            if count > 1 and keys.shape[1] != q.shape[1]:
                # A chunk's mask with grouped-query heads runs only in SDPA's math kernel, which
                # would materialise the whole [heads, chunk, cache] matrix: repeat the KV heads.
                groups = q.shape[1] // keys.shape[1]
                keys = keys.repeat_interleave(groups, 1)
                values = values.repeat_interleave(groups, 1)
            out = F.scaled_dot_product_attention(
                q,
                keys,
                values,
                attn_mask=attn_mask,
                scale=scaling,
                enable_gqa=keys.shape[1] != q.shape[1],
            )
            out = out.transpose(0, 2) if stacked else out
        outputs.append(out)
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous(), None


def _grouped_rows(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float | None,
) -> torch.Tensor:
    """Attend a stacked decode's rows over grouped-query heads without repeating a key: each
    row has one query per head, so the query heads sharing a key head are that head's queries
    (no order among them). SDPA then needs no GQA support, and its fused kernels take the
    padding mask (with `enable_gqa` and a mask only its math kernel runs, repeating every key).
    """
    rows, heads, _, dim = q.shape
    grouped = q.reshape(rows, keys.shape[1], heads // keys.shape[1], dim)
    out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask, scale=scaling)
    return out.reshape(rows, heads, 1, dim)


def _masks(pieces: list[Piece], device: torch.device) -> list[torch.Tensor | None]:
    """Each piece's attention mask, built once per forward (every layer uses it): a stacked
    piece's padding; none for a chunk (causal, aligned to the end of its cache: `_attend` asks
    the kernel for that, and a sliding-window layer builds its own) or for one token."""
    return [
        piece.mask.to(device).bool()[:, None, None, :] if piece.mask is not None else None
        for piece in pieces
    ]


def _within(
    mask: torch.Tensor | None,
    stacked: bool,
    count: int,
    total: int,
    window: int,
    device: torch.device,
) -> torch.Tensor:
    """Narrow a piece's mask to the last `window` positions before each query."""
    if stacked and mask is not None:  # every row's query is at the last position
        narrowed = mask.clone()
        narrowed[..., : total - window] = False
        return narrowed
    # query i is at position total - count + i: it sees the keys up to there, and `window` back
    causal = torch.ones(count, total, dtype=torch.bool, device=device).tril(total - count)
    return causal & ~causal.tril(total - count - window)


class _PackedLayer(DynamicLayer):
    """One layer of the packed cache: appends each piece's keys and values to its own cache."""

    def __init__(self, index: int, pieces: list[Piece]) -> None:
        super().__init__()
        self.index, self.pieces = index, pieces

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        start = 0
        for piece in self.pieces:
            end = start + len(piece.ids)
            keys, values = key_states[:, :, start:end], value_states[:, :, start:end]
            if piece.mask is not None:  # a token per row: [rows, heads, 1, dim]
                keys, values = keys.transpose(0, 2), values.transpose(0, 2)
            piece.cache.layers[self.index].update(keys, values)
            start = end
        return key_states, value_states


def packed_forward(model: Any, pieces: list[Piece], image_token_id: int) -> torch.Tensor:
    """Feed every piece in one forward; return the logits of each piece's last token (of each
    row, for a stacked piece), in order [rows, vocab]."""
    before = [p.cache.get_seq_length() for p in pieces]
    try:
        embeds = torch.cat(
            [embed(model, p.ids, image_token_id, p.features, p.offset) for p in pieces], dim=1
        )
        device = embeds.device
        positions: list[torch.Tensor] = []
        ends: list[int] = []
        start = 0
        for piece, length in zip(pieces, before, strict=True):
            count = len(piece.ids)
            if piece.positions is not None:
                positions.append(piece.positions.to(device))
                ends.extend(range(start, start + count))
            else:
                positions.append(torch.arange(length, length + count, device=device))
                ends.append(start + count - 1)
            start += count
        packed = DynamicCache()
        packed.layers = [_PackedLayer(i, pieces) for i in range(len(pieces[0].cache.layers))]
        out = model(
            inputs_embeds=embeds,
            attention_mask=_NO_MASK.to(device),
            position_ids=torch.cat(positions)[None],
            past_key_values=packed,
            use_cache=True,
            logits_to_keep=torch.tensor(ends, device=device),
            packing=list(zip(pieces, _masks(pieces, device), strict=True)),
        )
    except BaseException:
        for piece, length in zip(pieces, before, strict=True):
            crop_to(piece.cache, length)
        raise
    return out.logits[0]
