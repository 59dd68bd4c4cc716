"""Moving a session's state between the memory tiers: device cache, host cache, features only.

Each step down frees memory at a price paid only if the session comes back: a copy back to the
device, or recomputing its prefix from the kept image features (the answers stay the same).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from llava.engine.cache import assign, move_cache, new_cache
from llava.engine.loading import HOST
from llava.engine.state import SessionState, Tier


@torch.inference_mode()  # the caches are inference tensors: edit them in this mode
def offload(state: SessionState) -> int:
    """Move a session's cache to host memory (pinned under CUDA); return the device bytes freed."""
    if state.tier is not Tier.DEVICE or state.cache is None:
        return 0
    freed = state.device_bytes
    move_cache(state.cache, HOST, pin=state.replica.device.type == "cuda")
    state.tier = Tier.HOST
    return freed


def drop_cache(state: SessionState) -> int:
    """Keep only the image features of a session; return the bytes freed."""
    freed = state.cache_bytes
    state.cache, state.cache_ids, state.tier = None, [], Tier.FEATURES
    return freed


@torch.inference_mode()
def restore(state: SessionState, num_layers: int, *, keeps_kv: bool) -> Tier:
    """Bring a session's cache back to its device (or empty, to be recomputed); return the
    tier it was found in."""
    found = state.tier
    if state.tier is Tier.HOST and state.cache is not None:
        move_cache(state.cache, state.replica.device)
    elif state.cache is None and keeps_kv:
        state.cache, state.cache_ids = new_cache(num_layers), []
    state.tier = Tier.DEVICE
    return found


def prefix_copy(cache: DynamicCache | None, length: int, num_layers: int) -> DynamicCache:
    """Return a new cache holding the first `length` positions of `cache` (shares nothing)."""
    branch = new_cache(num_layers)
    if cache is not None and length and cache.get_seq_length() >= length:
        for own, layer in zip(branch.layers, cache.layers, strict=True):
            assign(own, layer.keys[..., :length, :], layer.values[..., :length, :])
    return branch
