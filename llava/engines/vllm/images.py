"""A picture as vLLM takes it: the decoded image and its content id.

vLLM runs its own processor and vision tower inside the engine; what the kit hands it is the
image and an id derived from its pixels (`multi_modal_uuids`). vLLM keys its processor cache,
its encoder cache and its prefix-cache block hashes on that id, so a follow-up that sends the
same picture again runs neither the processor nor the tower while vLLM still holds them. The id
must be the content's digest: vLLM trusts it, and an id reused for other pixels would serve
the other picture's features.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from PIL import Image


@dataclass(frozen=True, eq=False)
class VllmImage:
    """A decoded RGB picture and the digest of its pixels."""

    image: Image.Image
    uuid: str

    @property
    def nbytes(self) -> int:
        width, height = self.image.size
        return width * height * 3

    @classmethod
    def of(cls, image: Any) -> VllmImage:
        """Convert to RGB (as the processor would) and name the result by its pixels (a
        prepared picture is taken as it is)."""
        if isinstance(image, VllmImage):
            return image
        rgb = image if image.mode == "RGB" else image.convert("RGB")
        digest = hashlib.sha256(f"{rgb.size[0]}x{rgb.size[1]}:".encode())
        digest.update(rgb.tobytes())
        return cls(rgb, "sha256:" + digest.hexdigest())


def pictures(prepared: Any) -> tuple[VllmImage, ...]:
    """The pictures a prepared value holds, in order (the preparer's tuple, or one picture)."""
    if isinstance(prepared, tuple):
        return tuple(VllmImage.of(image) for image in prepared)
    return (VllmImage.of(prepared),)


class VllmImagePreparer:
    """The image processes' work for this engine: only the RGB conversion and the digest
    (vLLM's processor runs inside the engine, once per picture it has not seen)."""

    def __call__(self, image: Any, earlier: list[Any]) -> tuple[VllmImage, ...]:
        """A conversation's pictures in order: the earlier ones sent with it, then `image`."""
        return tuple(VllmImage.of(picture) for picture in (*earlier, image))
