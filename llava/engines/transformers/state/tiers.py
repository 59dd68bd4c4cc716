"""Moving a session's state between the memory tiers (device cache, host cache, features only),
and cutting it back for a turn or a rollback.

Each step down frees memory at a price paid only if the session comes back: a copy back to the
device, or recomputing its prefix from the kept image features (the answers stay the same).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from llava.core.errors import InvalidRequest
from llava.core.tiers import Tier
from llava.engines.conversation.chat import ChatFormatter, common_prefix
from llava.engines.transformers.model.cache import assign, crop_to, move_cache, new_cache, settle
from llava.engines.transformers.model.loading import HOST
from llava.engines.transformers.state.session import SessionState


@torch.inference_mode()  # the caches are inference tensors: edit them in this mode
def offload(state: SessionState) -> int:
    """Move a session's cache to host memory (pinned under CUDA, copied on a side stream while
    the step goes on); return the device bytes freed."""
    if state.tier is not Tier.DEVICE or state.cache is None:
        return 0
    freed = state.device_bytes
    move_cache(state.cache, HOST)
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


def for_turn(
    state: SessionState, common: int, num_layers: int, keeps_kv: bool, history: bool
) -> tuple[DynamicCache, Tier]:
    """Return the cache a turn extends, holding the session's first `common` ids, and the tier
    the session was found in: its own cache (cut back), or a copy for a branch."""
    found = restore(state, num_layers, keeps_kv=keeps_kv)
    if not keeps_kv:
        return new_cache(num_layers), found
    if not history:
        return prefix_copy(state.cache, common, num_layers), found
    assert state.cache is not None
    crop_to(state.cache, common)  # drop what re-tokenization no longer matches
    state.cache_ids = state.cache_ids[:common]
    return state.cache, found


def prefix_copy(cache: DynamicCache | None, length: int, num_layers: int) -> DynamicCache:
    """Return a new cache holding the first `length` positions of `cache` (shares nothing)."""
    branch = new_cache(num_layers)
    settle(cache)  # a cache still being copied to host memory is read once the copy is done
    if cache is not None and length and cache.get_seq_length() >= length:
        for own, layer in zip(branch.layers, cache.layers, strict=True):
            assign(own, layer.keys[..., :length, :], layer.values[..., :length, :])
    return branch


@torch.inference_mode()
def rollback(state: SessionState, chat: ChatFormatter) -> int:
    """Undo a session's last question and answer, keeping its cache (in whatever tier) up to the
    end of that question, so asking it again costs only the new answer; return the questions
    left."""
    if not state.history:
        raise InvalidRequest("the session has no answered question to roll back", field="type")
    last = state.history[-1]
    if last.added_images:
        raise InvalidRequest(
            "the last question added an image, which cannot be rolled back; open a new "
            "session to ask it differently",
            field="type",
        )
    state.history = state.history[:-1]
    if state.cache is not None:
        messages = chat.messages(
            state.system_prompt, state.history, last.prompt, 0, state.opening_images
        )
        ids = chat.tokenize(chat.render(messages), state.images.tokens)
        keep = common_prefix(state.cache_ids, ids)
        crop_to(state.cache, keep)
        state.cache_ids = state.cache_ids[:keep]
    return len(state.history)
