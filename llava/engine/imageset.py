"""A conversation's images as the model sees them: token counts per image, and their features.

Families differ in how the images of one conversation relate:
- LLaVA-1.5, Interleave and NeXT encode each image on its own, so an image added mid-conversation
  is encoded alone and its features are appended; what the session cached stays valid.
- OneVision encodes a conversation of several images differently from one of a single image (no
  anyres tiling, a fixed number of tokens per image, as its processor and model do when a sample
  holds several images). Adding a second image re-encodes every image of the conversation, and
  the session's cache is recomputed from its first image token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from llava.engine.loading import HOST
from llava.engine.vision import ProcessedImages, image_features, process_images


@dataclass(eq=False)
class ImageSet:
    """The images of a conversation, in order."""

    tokens: list[int]  # image tokens of each image
    features: torch.Tensor | None  # [sum(tokens), hidden] in host memory (kv mode)
    processed: ProcessedImages | None = None  # pixels mode: the processor's output, on the device
    sources: list[Any] = field(default_factory=list)  # decoded images, kept to re-encode jointly

    @property
    def host_bytes(self) -> int:
        features = self.features
        pixels = sum(image.width * image.height * 3 for image in self.sources)
        return pixels + (features.numel() * features.element_size() if features is not None else 0)

    @property
    def device_bytes(self) -> int:
        inputs = self.processed.inputs.values() if self.processed is not None else []
        return sum(t.numel() * t.element_size() for t in inputs if isinstance(t, torch.Tensor))


class ImageEncoder:
    """Encode a conversation's images the way its family does, for kv or pixels mode."""

    def __init__(self, processor: Any, token_id: int, *, keep_pixels: bool, joint: bool) -> None:
        self.processor = processor
        self.token_id = token_id
        self.keep_pixels = keep_pixels  # the reference design: re-run the tower every prefill
        self.joint = joint  # several images are encoded together, differently from one

    def encode(self, model: Any, device: torch.device, images: list[Any]) -> ImageSet:
        """Encode the images of one conversation."""
        processed = process_images(self.processor, images, self.token_id)
        sources = list(images) if self.joint else []
        if self.keep_pixels:
            processed.inputs = {k: v.to(device) for k, v in processed.inputs.items()}
            return ImageSet(processed.tokens, None, processed, sources)
        features = image_features(model, processed, device).to(HOST)
        return ImageSet(processed.tokens, features, None, sources)

    def add(
        self, model: Any, device: torch.device, current: ImageSet, image: Any
    ) -> tuple[ImageSet, bool]:
        """Return the set with one more image, and whether the earlier images' features changed.

        `current` is left untouched: the new set replaces it only when the answer is committed.
        """
        if self.joint:
            return self.encode(model, device, [*current.sources, image]), True
        added = self.encode(model, device, [image])
        assert current.features is not None and added.features is not None  # kv mode only
        features = torch.cat([current.features, added.features])
        return ImageSet(current.tokens + added.tokens, features), False

    def first_alone(
        self, model: Any, device: torch.device, current: ImageSet
    ) -> tuple[ImageSet, bool]:
        """Return the opening image as a conversation of its own, and whether it was re-encoded."""
        if len(current.tokens) == 1:
            return current, False
        if self.joint:
            return self.encode(model, device, current.sources[:1]), True
        assert current.features is not None
        return ImageSet(current.tokens[:1], current.features[: current.tokens[0]]), False

    def features(self, model: Any, device: torch.device, images: ImageSet) -> torch.Tensor | None:
        """Return the features to scatter into a prefill (running the tower in pixels mode)."""
        if images.processed is not None:
            return image_features(model, images.processed, device)
        return images.features
