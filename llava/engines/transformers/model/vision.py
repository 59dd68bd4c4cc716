"""Images to model inputs: the processor's pixels and token count, the vision tower's features.

Every llava-hf family (LLaVA-1.5, NeXT, OneVision) expands an image placeholder into a number of
image tokens that the processor decides (fixed for 1.5, dependent on the image's size for the
anyres families) and replaces those tokens' embeddings with the image's projected features. The
engine does that replacement itself (`embed`), for any slice of a conversation, so a prefill can
be cut into chunks anywhere, even inside an image, and a session's image features can be kept
and reused without the vision tower.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
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

    def __getstate__(self) -> dict[str, Any]:
        return {"inputs": {k: as_bytes(v) for k, v in self.inputs.items()}, "tokens": self.tokens}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.inputs = {k: from_bytes(v) for k, v in state["inputs"].items()}
        self.tokens = state["tokens"]


# Tensors cross from an image process as plain bytes: torch's own pickling between processes
# moves them through shared memory, with file descriptors passed by a helper thread.
def as_bytes(tensor: torch.Tensor) -> tuple[str, tuple[int, ...], bytes]:
    """Return a CPU tensor as (dtype, shape, bytes), any dtype (numpy has no bfloat16)."""
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    return str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), flat.numpy().tobytes()


def from_bytes(plain: tuple[str, tuple[int, ...], bytes]) -> torch.Tensor:
    """Rebuild a tensor from `as_bytes`."""
    dtype, shape, data = plain
    if not data:  # torch.frombuffer refuses an empty buffer
        return torch.empty(shape, dtype=getattr(torch, dtype))
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)  # writable: a copy of its own
    return raw.view(getattr(torch, dtype)).reshape(shape)


def vision_part(model: Any) -> Any:
    """Return the model's image path (vision tower, projector, their glue) without its language
    model, sharing the weights: what image processes get a pickled copy of, to run the tower
    off the step loop."""
    return unhooked(model.model, skip="language_model")


def register_outputs(module: Any) -> None:
    """Register the models in an unpickled module tree for transformers' output capture.

    transformers records which outputs each model class can capture when a model is built
    (`PreTrainedModel.__init__`); a process that only unpickled one has no record, and the
    vision tower then returns no hidden states. The kit's tests check the features an image
    process computes against the model's own, for every family.
    """
    from transformers import PreTrainedModel
    from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY

    by_class = type(_CAN_RECORD_REGISTRY) is dict  # transformers 5.19 (vLLM's) keys by class
    for part in module.modules():
        if isinstance(part, PreTrainedModel):
            key = str(part.__class__) if by_class else part
            _CAN_RECORD_REGISTRY[key] = part._can_record_outputs


def unhooked(module: Any, skip: str = "") -> Any:
    """Copy a module tree without its hooks, sharing parameters and buffers.

    transformers installs output-capturing hooks (closures, which cannot be pickled) on first
    use and marks the model as hooked; the copy is unmarked, so it installs its own.
    """
    clone = copy.copy(module)  # a new __dict__; its dicts are still the original's
    clone._modules = {k: unhooked(m) for k, m in module._modules.items() if k != skip}
    for hooks in ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs"):
        setattr(clone, hooks, OrderedDict())
    clone.__dict__.pop("_output_capturing_hooks_installed", None)
    return clone


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
    """Embed ids [1, n, hidden]; image tokens take features[offset:] in order.

    Without features every id is text: a generated token is text even where it is the image
    token's id (as in transformers' `generate`, which merges image features into the prompt
    only), so an answer that samples it goes on instead of failing.
    """
    device = model.get_input_embeddings().weight.device
    tensor = torch.tensor([ids], device=device)
    embeds = model.get_input_embeddings()(tensor)
    count = ids.count(token_id)  # counted on the host: no device sync for a text-only chunk
    if features is None or not count:
        return embeds
    if offset + count > features.shape[0]:
        raise RuntimeError("the conversation has more image tokens than the session's images")
    chunk = features[offset : offset + count].to(device, embeds.dtype)
    embeds[0, tensor[0] == token_id] = chunk
    return embeds
