"""Images to model inputs: the processor's pixels and token count, the vision tower's features.

Every llava-hf family (LLaVA-1.5, NeXT, OneVision) expands an image placeholder into a number of
image tokens that the processor decides (fixed for 1.5, dependent on the image's size for the
anyres families) and replaces those tokens' embeddings with the image's projected features. The
engine does that replacement itself (`embed`), for any slice of a conversation, so a prefill can
be cut into chunks anywhere, even inside an image, and a session's image features can be kept
and reused without the vision tower.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(eq=False)
class ProcessedImages:
    """A conversation's images as the processor prepared them: model inputs, tokens per image."""

    inputs: dict[str, torch.Tensor]  # pixel_values (image_sizes, batch_num_images: anyres)
    tokens: list[int]

    @property
    def total(self) -> int:
        return sum(self.tokens)


def image_token_id(model: Any) -> int:
    """Return the id of the image placeholder token from the model's config."""
    config = model.config
    value = getattr(config, "image_token_id", None)
    if value is None:
        value = getattr(config, "image_token_index", None)
    if value is None:
        raise ValueError("the model config names no image token (image_token_id)")
    return int(value)


def tower_ratio(model: Any) -> float:
    """Estimate the vision tower's cost per image token against the language model's per token.

    Compute per token scales with parameters, so the scheduler charges a tower run this share
    of a prefill of as many tokens.
    """
    vision = sum(
        p.numel()
        for name, p in model.named_parameters()
        if "vision_tower" in name or "multi_modal_projector" in name
    )
    total = sum(p.numel() for p in model.parameters())
    return vision / max(total - vision, 1)


def process_images(processor: Any, images: list[Any], token_id: int) -> ProcessedImages:
    """Run the processor on one conversation's images; count the image tokens of each.

    The images go in as one sample (a nested list), as `apply_chat_template` passes them: a
    family that encodes several images differently from one (OneVision) does so here too.
    """
    text = "\n".join([processor.image_token] * len(images))  # a non-image id between images
    out = processor(images=[list(images)], text=[text], return_tensors="pt")
    ids = out.pop("input_ids")[0].tolist()
    out.pop("attention_mask", None)
    tokens: list[int] = []
    run = 0
    for i in [*ids, None]:
        if i == token_id:
            run += 1
        elif run:
            tokens, run = [*tokens, run], 0
    if len(tokens) != len(images):
        raise ValueError(f"the processor expanded {len(images)} images to {len(tokens)} runs")
    inputs = {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}
    return ProcessedImages(inputs, tokens)


def model_inputs(model: Any, image: ProcessedImages, device: torch.device) -> dict[str, Any]:
    """Move the processor's outputs to `device`, pixels in the model's dtype."""
    return {
        k: v.to(device, model.dtype) if v.is_floating_point() else v.to(device)
        for k, v in image.inputs.items()
    }


def image_features(model: Any, image: ProcessedImages, device: torch.device) -> torch.Tensor:
    """Run the vision tower and projector: one [tokens, hidden] tensor in the model's dtype."""
    out = model.get_image_features(**model_inputs(model, image, device), return_dict=True)
    pooled = getattr(out, "pooler_output", out)
    if isinstance(pooled, (list, tuple)):
        features = torch.cat([p.reshape(-1, p.shape[-1]) for p in pooled])
    else:
        features = pooled.reshape(-1, pooled.shape[-1])
    if features.shape[0] != image.total:
        raise RuntimeError(
            f"the vision tower gave {features.shape[0]} features for images the processor "
            f"expanded to {image.total} tokens: this transformers version does not match the "
            "checkpoint (see pyproject.toml for the supported range)"
        )
    return features


def embed(
    model: Any, ids: list[int], token_id: int, features: torch.Tensor | None, offset: int
) -> torch.Tensor:
    """Embed ids [1, n, hidden]; image tokens take features[offset:] in order."""
    device = model.get_input_embeddings().weight.device
    tensor = torch.tensor([ids], device=device)
    embeds = model.get_input_embeddings()(tensor)
    mask = tensor[0] == token_id
    count = int(mask.sum())
    if count:
        if features is None or offset + count > features.shape[0]:
            raise RuntimeError("the conversation has more image tokens than the session's images")
        chunk = features[offset : offset + count].to(device, embeds.dtype)
        embeds[0, mask] = chunk
    return embeds
