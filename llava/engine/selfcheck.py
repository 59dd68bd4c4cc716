"""The start-up check: this transformers takes the input embeddings the engine builds.

An older `LlavaModel.forward` silently ignores features it does not know how to take; the check
compares the engine's path with the model's own on the same input, on a blank image.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from llava.engine.cache import new_cache
from llava.engine.loading import transformers_version
from llava.engine.vision import image_features, model_inputs, process_images

if TYPE_CHECKING:
    from llava.engine.engine import LlavaEngine


@torch.inference_mode()
def self_check(engine: LlavaEngine) -> None:
    """Fail, naming the transformers version, if the engine's forward differs from the model's."""
    from PIL import Image

    replica = engine.replicas[0]
    image = Image.new("RGB", (40, 30), (120, 60, 200))
    try:
        processed = process_images(engine.processor, [image], engine.image_token_id)
        ids = engine.chat.tokenize(engine.chat.prefix_text(None), processed.tokens)
        features = image_features(replica.model, processed, replica.device)
        ours = engine.forward(replica, new_cache(engine.num_layers), ids, features, 0)
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
    tolerance = 1e-3 if replica.model.dtype == torch.float32 else 5e-2
    scale = float(theirs.abs().max()) or 1.0
    if float((ours.float() - theirs.float()).abs().max()) > tolerance * scale:
        raise RuntimeError(
            f"transformers {transformers_version()} answers differently when the engine "
            "passes image features itself; install the version range in pyproject.toml"
        )
