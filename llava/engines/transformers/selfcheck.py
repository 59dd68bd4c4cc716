"""The start-up check: this transformers takes the input embeddings the engine builds.

An older `LlavaModel.forward` silently ignores features it does not know how to take; the check
compares the engine's path with the model's own on the same input, on a blank image. It then
compares a packed forward (`packed.py`) with the pieces' own forwards, and stops packing if they
differ.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from llava.engines.transformers.model.cache import new_cache
from llava.engines.transformers.model.loading import transformers_version
from llava.engines.transformers.model.packed import Piece, packed_forward
from llava.engines.transformers.model.vision import image_features, model_inputs, process_images

if TYPE_CHECKING:
    from llava.engines.transformers.runner import ModelRunner

log = logging.getLogger(__name__)


@torch.inference_mode()
def self_check(runner: ModelRunner) -> None:
    """Fail, naming the transformers version, if the engine's forward differs from the model's."""
    from PIL import Image

    replica = runner.replicas[0]
    image = Image.new("RGB", (40, 30), (120, 60, 200))
    try:
        processed = process_images(runner.processor, [image], runner.image_token_id)
        ids = runner.chat.tokenize(runner.chat.prefix_text(None), processed.tokens)
        features = image_features(replica.model, processed, replica.device)
        ours = runner.forward(replica, new_cache(runner.num_layers), ids, features, 0)
        theirs = replica.model(
            input_ids=torch.tensor([ids], device=replica.device),
            logits_to_keep=1,
            **model_inputs(replica.model, processed, replica.device),
        ).logits[0, -1]
    except Exception as exc:
        raise RuntimeError(
            f"transformers {transformers_version()} cannot serve this checkpoint the way the "
            f"engine does ({exc}); install the version range in pyproject.toml"
        ) from exc
    if not _close(ours, theirs, replica.model.dtype):
        raise RuntimeError(
            f"transformers {transformers_version()} answers differently when the engine "
            "passes image features itself; install the version range in pyproject.toml"
        )
    if runner.packs and not _packs_alike(runner, ids, features):
        runner.packs = False
        log.warning(
            "transformers %s answers differently when a step's pieces share one forward: "
            "each prefill chunk runs a forward of its own (slower steps beside streams)",
            transformers_version(),
        )


def _close(ours: torch.Tensor, theirs: torch.Tensor, dtype: torch.dtype) -> bool:
    tolerance = 1e-3 if dtype == torch.float32 else 5e-2
    scale = float(theirs.abs().max()) or 1.0
    return float((ours.float() - theirs.float()).abs().max()) <= tolerance * scale


def _packs_alike(runner: ModelRunner, ids: list[int], features: torch.Tensor) -> bool:
    """Compare a packed forward (a decode beside a chunk with image tokens) with each piece's
    own forward: what the packing attention gives this transformers' models."""
    replica = runner.replicas[0]
    split = len(ids) // 2
    caches = [new_cache(runner.num_layers) for _ in range(4)]
    for cache in caches:  # the same first half, so each piece has a cache to extend
        runner.forward(replica, cache, ids[:split], features, 0)
    offset = sum(1 for i in ids[:split] if i == runner.image_token_id)
    token = next(i for i in reversed(ids) if i != runner.image_token_id)
    alone = [
        runner.forward(replica, caches[0], [token], features, 0),
        runner.forward(replica, caches[1], ids[split:], features, offset),
    ]
    try:
        packed = packed_forward(
            replica.model,
            [Piece(caches[2], [token]), Piece(caches[3], ids[split:], features, offset)],
            runner.image_token_id,
        )
    except Exception:
        log.warning("a packed forward failed", exc_info=True)
        return False
    return all(_close(packed[row], alone[row], replica.model.dtype) for row in range(2))
