"""One forward over a session's cache, all or nothing: a failure cuts every layer back.

A CUDA out-of-memory error (or any exception) can arrive in any decoder layer, after the layers
before it have appended their keys and values. Cutting the cache back to its length before the
forward leaves the session exactly as it was, so the turn can be retried or failed alone.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache

from llava.engines.transformers.model.cache import crop_to
from llava.engines.transformers.model.vision import embed


def forward(
    model: Any,
    cache: DynamicCache,
    ids: list[int],
    image_token_id: int,
    features: torch.Tensor | None,
    offset: int,
) -> torch.Tensor:
    """Feed `ids` (image tokens from `features[offset:]`); return the last logits row."""
    before = cache.get_seq_length()
    try:
        embeds = embed(model, ids, image_token_id, features, offset)
        out = model(inputs_embeds=embeds, past_key_values=cache, use_cache=True, logits_to_keep=1)
    except BaseException:
        crop_to(cache, before)
        raise
    return out.logits[0, -1]
