"""A vLLM session's snapshot: its conversation and its pictures, nothing of the device.

A safetensors file (arrays and a JSON header: nothing is unpickled) holding each picture's kept
bytes (the client's JPEG, or a PNG), the system prompt, the questions and answers, and the
model's fingerprint, so it is never restored into another model. Each picture's content id is
recomputed from its pixels on restore, never taken from the snapshot: vLLM trusts ids, so a
wrong one must never reach it (and a build whose decoder gives a lossy picture slightly other
pixels names them anew rather than losing the session). A snapshot whose pictures are all PNGs
is written in the second format, which kits before the third read too (a rollback keeps those
sessions). Earlier formats are still read: PNGs only, and before that raw RGB pixels.
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
from llava.engines.vllm.images import VllmImage, check_kept_size
from llava.engines.vllm.state import VllmSession

FORMAT = "llava-vllm-session/3"
PNGS = "llava-vllm-session/2"  # the second format: each picture as PNG
RAW_PIXELS = "llava-vllm-session/1"  # the first format: each picture as RGB pixels
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def capture(state: VllmSession, fingerprint: str, extra: dict[str, Any]) -> Callable[[], bytes]:
    """Take what rebuilds `state` (references only); return the serialiser for later."""
    pngs_only = all(image.encoded.startswith(PNG_SIGNATURE) for image in state.images)
    meta = {
        "format": PNGS if pngs_only else FORMAT,  # what a kit before format 3 still reads
        "model": fingerprint,
        "system_prompt": state.system_prompt,
        "history": [[e.prompt, e.answer, e.added_images] for e in state.history],
        "uuids": [image.uuid for image in state.images],
        "extra": extra,
    }
    images = list(state.images)

    def serialise() -> bytes:
        arrays = {f"image.{i}": np.frombuffer(im.encoded, np.uint8) for i, im in enumerate(images)}
        return bytes(save_arrays(arrays, metadata={"llava": json.dumps(meta)}))

    return serialise


def restore(
    data: bytes, fingerprint: str, limits: ServerConfig
) -> tuple[VllmSession, dict[str, Any]]:
    """Rebuild a session's conversation (its prefix ids are the engine's to fill in) and the
    service's extra data; raise ValueError when the bytes are not a snapshot of this model, or
    hold more or larger pictures than `limits` let a client upload (each checked before it is
    decoded)."""
    meta = snapshot_meta(data, (FORMAT, PNGS, RAW_PIXELS), fingerprint)
    checks.check_restored_count(len(meta["uuids"]), limits.max_images_per_session)
    try:
        arrays = load_arrays(data)
    except Exception as exc:  # safetensors raises its own error types
        raise ValueError(f"not a session snapshot: {exc}") from exc
    raw = meta["format"] == RAW_PIXELS
    images = [
        _picture(arrays.get(f"image.{i}"), raw, i, limits.image_max_pixels)
        for i in range(len(meta["uuids"]))
    ]
    history = [Exchange(p, a, n) for p, a, n in meta["history"]]
    state = VllmSession(meta["system_prompt"], tuple(images), [], history)
    return state, meta["extra"]


def _picture(array: Any, raw: bool, i: int, max_pixels: int) -> VllmImage:
    """One picture of a snapshot, named by its pixels; over `max_pixels` (image_max_pixels),
    refused from its header or shape before it is decoded."""
    if array is None or array.dtype != np.uint8 or array.ndim != (3 if raw else 1):
        raise ValueError(f"the snapshot's picture {i} is missing or not a picture")
    if raw and array.shape[2] != 3:
        raise ValueError(f"the snapshot's picture {i} is not RGB pixels")
    try:
        if not raw:
            return VllmImage.restored(array.tobytes(), max_pixels)
        height, width = array.shape[:2]
        check_kept_size(width, height, max_pixels)
        image = VllmImage.of(Image.fromarray(array))  # named and encoded from its pixels once
        image.processed()
        return image
    except ValueError as exc:
        raise ValueError(f"the snapshot's picture {i}: {exc}") from exc
