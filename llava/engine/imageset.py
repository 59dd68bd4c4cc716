"""A conversation's images as the model sees them: token counts per image, and their features.

Work on images happens in two stages so the shared step loop never does more than a bounded
piece of it:
- `prepare` (decode already done; resizing, normalising, counting tokens: the processor) is
  pure CPU work and runs on the image threads, never on the step loop;
- the vision tower (`encode_pending`) runs inside a step, scheduled against the step's token
  budget like a prefill chunk.

Families differ in how the images of one conversation relate:
- LLaVA-1.5, Interleave and NeXT encode each image on its own, so an image added mid-conversation
  is encoded alone and its features are appended; what the session cached stays valid.
- OneVision encodes a conversation of several images differently from one of a single image (no
  anyres tiling, a fixed number of tokens per image, as its processor and model do when a sample
  holds several images). Adding a second image re-encodes every image of the conversation, and
  the session's cache is recomputed from its first image token.
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from llava.engine.loading import HOST
from llava.engine.vision import ProcessedImages, image_features, process_images
from llava.errors import InvalidRequest


@dataclass(eq=False)
class PreparedImages:
    """Images through the processor (off the step loop), not yet through the vision tower."""

    processed: ProcessedImages
    sources: list[Any]  # the decoded images, kept by families that re-encode them jointly
    joint: bool  # the conversation's earlier images are included (re-encoded together)


@dataclass(eq=False)
class ImageSet:
    """The images of a conversation, in order."""

    tokens: list[int]  # image tokens of each image
    features: torch.Tensor | None  # [tokens of encoded images, hidden] in host memory (kv mode)
    processed: ProcessedImages | None = None  # pixels mode: the processor's output, on the device
    sources: list[Any] = field(default_factory=list)  # decoded images, kept to re-encode jointly
    pending: ProcessedImages | None = None  # the last images, waiting for the vision tower
    opening: ImageSet | None = None  # the first image encoded alone, once re-encoded jointly

    @property
    def host_bytes(self) -> int:
        features = self.features
        pixels = sum(image.width * image.height * 3 for image in self.sources)
        opening = self.opening.host_bytes if self.opening is not None else 0
        own = features.numel() * features.element_size() if features is not None else 0
        return pixels + own + opening

    @property
    def device_bytes(self) -> int:
        inputs = self.processed.inputs.values() if self.processed is not None else []
        return sum(t.numel() * t.element_size() for t in inputs if isinstance(t, torch.Tensor))


EMPTY = ImageSet([], None)


class ImageEncoder:
    """Encode a conversation's images the way its family does, for kv or pixels mode."""

    def __init__(
        self,
        processor: Any,
        token_id: int,
        *,
        keep_pixels: bool,
        joint: bool,
        multi_image: bool = False,
        max_images: int = 1,
    ) -> None:
        self.processor = processor
        self.token_id = token_id
        self.keep_pixels = keep_pixels  # the reference design: re-run the tower every prefill
        self.joint = joint  # several images are encoded together, differently from one
        self.multi_image = multi_image  # the model was trained on several images a conversation
        self.max_images = max_images
        # One processor per image thread: a fast tokenizer must not be used by two threads at
        # once ("Already borrowed"), and the step loop tokenizes with the original.
        self._local = threading.local()

    def _thread_processor(self) -> Any:
        processor = getattr(self._local, "processor", None)
        if processor is None:
            processor = self._local.processor = copy.deepcopy(self.processor)
        return processor

    def prepare(self, image: Any, current: ImageSet | None = None) -> PreparedImages:
        """Run the processor for a new image (with the conversation's, if encoded jointly).

        Thread-safe and CPU-only: the image threads call it, never the step loop.
        """
        joint = self.joint and current is not None and bool(current.sources)
        images = [*current.sources, image] if joint and current is not None else [image]
        processed = process_images(self._thread_processor(), images, self.token_id)
        return PreparedImages(processed, images if self.joint else [], joint)

    def start(self, prepared: PreparedImages, device: torch.device) -> ImageSet:
        """Return an opening's image set (its features still to compute, in kv mode)."""
        processed = prepared.processed
        if self.keep_pixels:
            inputs = {k: v.to(device) for k, v in processed.inputs.items()}
            return ImageSet(processed.tokens, None, replace(processed, inputs=inputs))
        return ImageSet(processed.tokens, None, None, prepared.sources, pending=processed)

    def for_turn(
        self, current: ImageSet, image: PreparedImages | None, history: bool
    ) -> tuple[ImageSet, bool]:
        """Return the images of a turn's conversation, and whether the cached ones changed;
        refuse an added image the model or the session cannot take."""
        if image is None:
            return (current, False) if history else self.first_alone(current)
        if not self.multi_image:
            raise InvalidRequest(
                "this model was trained on one image per conversation; open a new session to "
                "ask about another image (LLaVA-OneVision and LLaVA-Interleave take several)",
                field="image",
            )
        if not history or self.keep_pixels:
            why = '"history": false' if not history else 'cache_mode "pixels"'
            raise InvalidRequest(f"an image cannot be added with {why}", field="image")
        if len(current.tokens) >= self.max_images:
            raise InvalidRequest(
                f"the session holds {self.max_images} images, the limit "
                "(max_images_per_session); open a new session",
                field="image",
            )
        return self.add(current, image)

    def add(self, current: ImageSet, prepared: PreparedImages) -> tuple[ImageSet, bool]:
        """Return the set with one more image, and whether the earlier images' features change.

        `current` is left untouched: the new set replaces it only when the answer is committed.
        """
        processed = prepared.processed
        if prepared.joint:
            opening = current.opening or ImageSet(current.tokens[:1], current.features)
            return ImageSet(
                processed.tokens, None, None, prepared.sources, pending=processed, opening=opening
            ), True
        tokens = current.tokens + processed.tokens
        return ImageSet(tokens, current.features, None, pending=processed), False

    def first_alone(self, current: ImageSet) -> tuple[ImageSet, bool]:
        """Return the opening image as a conversation of its own, and whether it was re-encoded."""
        if len(current.tokens) == 1:
            return current, False
        if current.opening is not None:
            return current.opening, True
        assert current.features is not None
        return ImageSet(current.tokens[:1], current.features[: current.tokens[0]]), False

    @staticmethod
    def pending_tokens(images: ImageSet) -> int:
        """Tokens the vision tower still has to produce for this set (0 when encoded)."""
        return images.pending.total if images.pending is not None else 0

    def encode_pending(self, model: Any, device: torch.device, images: ImageSet) -> ImageSet:
        """Run the vision tower over the set's pending images; return the encoded set."""
        assert images.pending is not None
        new = image_features(model, images.pending, device).to(HOST)
        features = new if images.features is None else torch.cat([images.features, new])
        return replace(images, features=features, pending=None)

    def features(self, model: Any, device: torch.device, images: ImageSet) -> torch.Tensor | None:
        """Return the features to scatter into a prefill (running the tower in pixels mode)."""
        if images.processed is not None:
            return image_features(model, images.processed, device)
        return images.features
