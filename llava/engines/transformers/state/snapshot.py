"""A session's recoverable state as bytes: its conversation and image features, no cache.

What a snapshot holds is exactly what the FEATURES tier keeps: the system prompt, the opening's
token ids, the finished questions and answers, each image's token count and the projected image
features in their own dtype (and, for families that re-encode a conversation's images jointly,
the decoded images and the opening image's own features). A restored session starts in the
FEATURES tier: its next turn recomputes the prefix from the features and answers as the
undisturbed session would have.

The bytes are a safetensors file (tensors with a JSON header; nothing is unpickled), tagged with
the model's fingerprint so a snapshot is never restored into a different model. `capture`
runs on the step thread and only takes references (features are replaced, never written in
place; the history list is copied); the serialisation runs later, on the snapshot writer thread.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from PIL import Image
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from llava.core.config import ServerConfig
from llava.core.tiers import Tier
from llava.engines.checkpoint import snapshot_meta
from llava.engines.conversation import checks
from llava.engines.conversation.chat import Exchange
from llava.engines.transformers.state.imageset import ImageSet
from llava.engines.transformers.state.session import Replica, SessionState

FORMAT = "llava-session-snapshot/1"


def capture(state: SessionState, fingerprint: str, extra: dict[str, Any]) -> Callable[[], bytes]:
    """Take what rebuilds `state` (references only); return the serialiser for later."""
    images = state.images
    if images.processed is not None or images.pending is not None:
        raise ValueError("only an encoded kv-mode session can be snapshotted")
    meta = {
        "format": FORMAT,
        "model": fingerprint,
        "system_prompt": state.system_prompt,
        "prefix_ids": list(state.prefix_ids),
        "history": [[e.prompt, e.answer, e.added_images] for e in state.history],
        "tokens": list(images.tokens),
        "opening_tokens": list(images.opening.tokens) if images.opening is not None else None,
        "sources": len(images.sources),
        "extra": extra,
    }
    tensors: dict[str, torch.Tensor] = {}
    if images.features is not None:
        tensors["features"] = images.features
    if images.opening is not None and images.opening.features is not None:
        tensors["opening.features"] = images.opening.features
    sources = list(images.sources)

    def serialise() -> bytes:
        for i, source in enumerate(sources):
            tensors[f"source.{i}"] = torch.from_numpy(np.asarray(source.convert("RGB")).copy())
        plain = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
        return save_tensors(plain, metadata={"llava": json.dumps(meta)})

    return serialise


def restore(
    data: bytes, fingerprint: str, replica: Replica, limits: ServerConfig
) -> tuple[SessionState, dict[str, Any]]:
    """Rebuild a session's state (FEATURES tier) and the service's extra data from a snapshot;
    raise ValueError when the bytes are not a snapshot of this model, or hold more or larger
    pictures than `limits` let a client upload."""
    meta = snapshot_meta(data, FORMAT, fingerprint)
    try:
        tensors = load_tensors(data)
    except Exception as exc:  # safetensors raises its own error types
        raise ValueError(f"not a session snapshot: {exc}") from exc
    pixels = [tensors[f"source.{i}"] for i in range(meta["sources"])]  # joint families only
    sizes = [(int(p.shape[1]), int(p.shape[0])) for p in pixels]  # (width, height)
    checks.check_restored(sizes, limits.image_max_pixels, limits.max_images_per_session)
    if len(meta["tokens"]) > limits.max_images_per_session:
        raise ValueError("it holds more pictures than max_images_per_session")
    sources = [Image.fromarray(p.numpy()) for p in pixels]
    opening = None
    if meta["opening_tokens"] is not None:
        opening = ImageSet(meta["opening_tokens"], tensors.get("opening.features"))
    images = ImageSet(meta["tokens"], tensors.get("features"), None, sources, opening=opening)
    if images.features is None or images.features.shape[0] != sum(images.tokens):
        raise ValueError("the snapshot's image features do not match its image tokens")
    state = SessionState(
        replica,
        meta["system_prompt"],
        images,
        list(meta["prefix_ids"]),
        tier=Tier.FEATURES,
        history=[Exchange(p, a, n) for p, a, n in meta["history"]],
    )
    return state, meta["extra"]
