"""A conversation's images as the model sees them: token counts per image, and their features.

Work on images happens in two stages so the shared step loop never does more than a bounded
piece of it:
- `ImagePreparer` (decode already done; resizing, normalising, counting tokens: the
  processor) is pure CPU work and runs in the server's image processes, never on the step loop;
- the vision tower (`encode_pending`) runs inside a step, scheduled against the step's token
  budget like a prefill chunk; or, for a model on the CPU, in the preparer too (the image
  processes' cores are the model's, and the step loop then holds no stream for it).

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

from llava.core.pictures import SENT_AS
from llava.engines.conversation.checks import check_added_image, check_image_count
from llava.engines.transformers.model.loading import HOST
from llava.engines.transformers.model.vision import (
    ProcessedImages,
    as_bytes,
    from_bytes,
    image_features,
    process_images,
    register_outputs,
    unhooked,
)


@dataclass(eq=False)
class PreparedImages:
    """Images through the processor (off the step loop), and through the vision tower too when
    the model runs on the CPU (then the image processes run it: `features`)."""

    processed: ProcessedImages  # without its inputs once `features` are computed
    sources: list[Any]  # the decoded images, kept by families that re-encode them jointly
    joint: bool  # the conversation's earlier images are included (re-encoded together)
    features: torch.Tensor | None = None  # [tokens, hidden] on the host, when encoded

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        if self.features is not None:
            state["features"] = as_bytes(self.features)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        if state["features"] is not None:
            state["features"] = from_bytes(state["features"])
        self.__dict__.update(state)


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


class ImagePreparer:
    """Run the processor on a new image and the conversation's earlier ones it joins.

    Thread-safe (one copy of the processor per thread: a fast tokenizer must not be used by two
    threads at once, "Already borrowed", and the step loop tokenizes with the original) and
    picklable, so image processes each get their own copy. Given the model's `vision` part
    (a model on the CPU), it runs the vision tower too.
    """

    def __init__(self, processor: Any, token_id: int, joint: bool, vision: Any = None) -> None:
        self.processor = processor
        self.token_id = token_id
        self.joint = joint  # several images are encoded together, differently from one
        self.vision = vision
        self._local = threading.local()

    def __getstate__(self) -> dict[str, Any]:
        state = {k: v for k, v in self.__dict__.items() if k != "_local"}
        if self.vision is not None:  # it may have run here, and been hooked
            state["vision"] = unhooked(self.vision)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _local=threading.local())
        if self.vision is not None:
            register_outputs(self.vision)

    def __call__(self, image: Any, earlier: list[Any]) -> PreparedImages:
        processor = getattr(self._local, "processor", None)
        if processor is None:
            processor = self._local.processor = copy.deepcopy(self.processor)
        images = [*earlier, image]
        for picture in images:  # this engine keeps pixels, never the bytes they were sent as
            picture.info.pop(SENT_AS, None)
        processed = process_images(processor, images, self.token_id)
        prepared = PreparedImages(processed, images if self.joint else [], bool(earlier))
        if self.vision is not None:
            with torch.inference_mode():
                prepared.features = image_features(self.vision, processed, HOST)
            prepared.processed = replace(processed, inputs={})
        return prepared


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
        vision: Any = None,
    ) -> None:
        self.keep_pixels = keep_pixels  # the reference design: re-run the tower every prefill
        self.joint = joint
        self.multi_image = multi_image  # the model was trained on several images a conversation
        self.max_images = max_images
        self.preparer = ImagePreparer(processor, token_id, joint, vision)

    def earlier(self, current: ImageSet | None) -> list[Any]:
        """Return the images a new one is processed with: the conversation's, if encoded
        jointly (OneVision), else none."""
        return list(current.sources) if self.joint and current is not None else []

    def prepare(self, image: Any, current: ImageSet | None = None) -> PreparedImages:
        """Run the processor for a new image (with the conversation's, if encoded jointly)."""
        return self.preparer(image, self.earlier(current))

    def start(self, prepared: PreparedImages, device: torch.device) -> ImageSet:
        """Return an opening's image set (its features still to compute, in kv mode)."""
        processed = prepared.processed
        if self.keep_pixels:
            inputs = {k: v.to(device) for k, v in processed.inputs.items()}
            return ImageSet(processed.tokens, None, replace(processed, inputs=inputs))
        pending = processed if prepared.features is None else None
        return ImageSet(processed.tokens, prepared.features, None, prepared.sources, pending)

    def check_count(self, count: int) -> None:
        """Refuse a conversation with more images than the model or the session takes."""
        check_image_count(count, self.multi_image, self.max_images)

    def for_turn(
        self, current: ImageSet, image: PreparedImages | None, history: bool
    ) -> tuple[ImageSet, bool]:
        """Return the images of a turn's conversation, and whether the cached ones changed;
        refuse an added image the model or the session cannot take."""
        if image is None:
            return (current, False) if history else self.first_alone(current)
        refused = None
        if not history or self.keep_pixels:
            refused = '"history": false' if not history else 'cache_mode "pixels"'
        check_added_image(len(current.tokens), self.multi_image, self.max_images, refused)
        return self.add(current, image)

    def add(self, current: ImageSet, prepared: PreparedImages) -> tuple[ImageSet, bool]:
        """Return the set with one more image, and whether the earlier images' features change.

        `current` is left untouched: the new set replaces it only when the answer is committed.
        """
        processed, new = prepared.processed, prepared.features
        pending = processed if new is None else None
        if prepared.joint:
            opening = current.opening or ImageSet(current.tokens[:1], current.features)
            return ImageSet(
                processed.tokens, new, None, prepared.sources, pending=pending, opening=opening
            ), True
        tokens = current.tokens + processed.tokens
        features = current.features
        if new is not None:
            features = new if features is None else torch.cat([features, new])
        return ImageSet(tokens, features, None, pending=pending), False

    def first_alone(self, current: ImageSet) -> tuple[ImageSet, bool]:
        """Return the opening image as a conversation of its own, and whether it was re-encoded."""
        if len(current.tokens) <= 1:
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
