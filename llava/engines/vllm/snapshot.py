"""A vLLM session's snapshot: its conversation and its pictures, nothing of the device.

A safetensors file (arrays and a JSON header: nothing is unpickled) holding each picture's PNG,
the system prompt, the questions and answers, and the model's fingerprint, so it is never
restored into another model. Each picture's content id is recomputed from its pixels on restore
(and must match the recorded one): vLLM trusts ids, so a wrong one must never reach it. The
first format held each picture's raw RGB pixels; its snapshots are still read.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import numpy as np
from PIL import Image
from safetensors.numpy import load as load_arrays
from safetensors.numpy import save as save_arrays

from llava.core.config import ServerConfig
from llava.engines.checkpoint import snapshot_meta
from llava.engines.conversation import checks
from llava.engines.conversation.chat import Exchange
from llava.engines.vllm.images import MAX_PNG_PIXELS, VllmImage
from llava.engines.vllm.state import VllmSession

FORMAT = "llava-vllm-session/2"
RAW_PIXELS = "llava-vllm-session/1"  # the first format: each picture as RGB pixels


def capture(state: VllmSession, fingerprint: str, extra: dict[str, Any]) -> Callable[[], bytes]:
    """Take what rebuilds `state` (references only); return the serialiser for later."""
    meta = {
        "format": FORMAT,
        "model": fingerprint,
        "system_prompt": state.system_prompt,
        "history": [[e.prompt, e.answer, e.added_images] for e in state.history],
        "uuids": [image.uuid for image in state.images],
        "extra": extra,
    }
    images = list(state.images)

    def serialise() -> bytes:
        arrays = {f"image.{i}": np.frombuffer(im.png, np.uint8) for i, im in enumerate(images)}
        return bytes(save_arrays(arrays, metadata={"llava": json.dumps(meta)}))

    return serialise


def restore(
    data: bytes, fingerprint: str, limits: ServerConfig
) -> tuple[VllmSession, dict[str, Any]]:
    """Rebuild a session's conversation (its prefix ids are the engine's to fill in) and the
    service's extra data; raise ValueError when the bytes are not a snapshot of this model, or
    hold more or larger pictures than `limits` let a client upload."""
    meta = snapshot_meta(data, (FORMAT, RAW_PIXELS), fingerprint)
    try:
        arrays = load_arrays(data)
    except Exception as exc:  # safetensors raises its own error types
        raise ValueError(f"not a session snapshot: {exc}") from exc
    images = [
        _picture(arrays.get(f"image.{i}"), uuid, meta["format"] == RAW_PIXELS, i)
        for i, uuid in enumerate(meta["uuids"])
    ]
    checks.check_restored(
        [im.size for im in images], limits.image_max_pixels, limits.max_images_per_session
    )
    history = [Exchange(p, a, n) for p, a, n in meta["history"]]
    state = VllmSession(meta["system_prompt"], tuple(images), [], history)
    return state, meta["extra"]


def _picture(array: Any, uuid: str, raw: bool, i: int) -> VllmImage:
    """One picture of a snapshot, checked against its content id."""
    if array is None or array.dtype != np.uint8 or array.ndim != (3 if raw else 1):
        raise ValueError(f"the snapshot's picture {i} is missing or not a picture")
    if raw and array.shape[2] != 3:
        raise ValueError(f"the snapshot's picture {i} is not RGB pixels")
    if raw and array.shape[0] * array.shape[1] > MAX_PNG_PIXELS:
        raise ValueError(f"the snapshot's picture {i} is larger than any the kit keeps")
    try:
        if not raw:
            return VllmImage.restored(array.tobytes(), uuid)
        image = VllmImage.of(Image.fromarray(array))  # named and encoded from its pixels once
        image.processed()
        if image.uuid != uuid:
            raise ValueError("the picture does not match its content id")
        return image
    except ValueError as exc:
        raise ValueError(f"the snapshot's picture {i}: {exc}") from exc
