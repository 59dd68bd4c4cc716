"""A picture as vLLM takes it: its pixels, kept encoded, and their content id.

vLLM runs its own processor and vision tower inside the engine; what the kit hands it is the
image and an id derived from its pixels (`multi_modal_uuids`). vLLM keys its processor cache,
its encoder cache and its prefix-cache block hashes on that id, so a follow-up that sends the
same picture again runs neither the processor nor the tower while vLLM still holds them (the kit
then sends the id alone, and the pixels only if vLLM has let them go). The id must be the
content's digest: vLLM trusts it, and an id reused for other pixels would serve the other
picture's features.

A session keeps each picture encoded: the bytes the client sent where Pillow alone decodes them
to the same pixels (an upright RGB JPEG or PNG: most photos) in fewer bytes than the pixels,
else a lossless PNG of the pixels (zlib's fastest level). Either weighs what a picture weighs on
the wire rather than width x height x 3 bytes (a 6000x6000 flat-colour picture is 108 MB of RGB
and about 100 KB of PNG), and keeping the sent bytes costs no encoding (a 1024x768 photo's PNG
took 100 ms of an image process, and weighed 7x its JPEG). They are decoded again only when
vLLM needs the pixels: on a rendering thread, never on the step thread.
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass, field
from typing import Any

from PIL import Image

from llava.core.pictures import MAX_JPEG_SCANS, SENT_AS, few_scans

PNG_LEVEL = 1  # zlib's fastest: a photo's PNG is ~2x smaller than its pixels at any level
# The most pixels a kept picture may decode to: the default `image_max_pixels` (40 MP) with room
# to spare, so that a snapshot's picture (a few KB can decode to GBs) cannot exhaust the worker.
MAX_KEPT_PIXELS = 64_000_000
KEPT_FORMATS = ["PNG", "JPEG"]  # what the kit keeps: its PNGs, and the JPEGs (MPO too) it was sent


def content_id(rgb: Image.Image) -> str:
    """Name RGB pixels by their digest (and size: two shapes of the same bytes differ)."""
    digest = hashlib.sha256(f"{rgb.size[0]}x{rgb.size[1]}:".encode())
    digest.update(rgb.tobytes())
    return "sha256:" + digest.hexdigest()


def encode(rgb: Image.Image) -> bytes:
    """Lossless PNG of RGB pixels."""
    out = io.BytesIO()
    rgb.save(out, format="PNG", compress_level=PNG_LEVEL)
    return out.getvalue()


def check_kept_size(width: int, height: int, max_pixels: int | None = None) -> None:
    """ValueError if a picture to keep holds over `max_pixels` (at most MAX_KEPT_PIXELS)."""
    limit = min(max_pixels or MAX_KEPT_PIXELS, MAX_KEPT_PIXELS)
    if width * height > limit:
        raise ValueError(f"a {width}x{height} picture, over {limit} pixels")


def decode(data: bytes, max_pixels: int | None = None) -> Image.Image:
    """The RGB pixels a kept picture holds; ValueError if it is not an RGB PNG or JPEG within
    `max_pixels` (at most MAX_KEPT_PIXELS) and MAX_JPEG_SCANS, checked before anything is
    decoded."""
    try:
        with Image.open(io.BytesIO(data), formats=KEPT_FORMATS) as image:
            if image.mode != "RGB":
                raise ValueError(f"not an RGB PNG or JPEG ({image.mode})")
            check_kept_size(*image.size, max_pixels)
            if not few_scans(image.format, data):
                raise ValueError(f"a JPEG of more than {MAX_JPEG_SCANS} scans")
            image.load()
            return image.copy()
    except (OSError, Image.DecompressionBombError) as exc:  # Pillow's errors for bad bytes
        raise ValueError(f"not a PNG or JPEG: {exc}") from exc


@dataclass(eq=False)
class VllmImage:
    """A picture, encoded, and the digest of its pixels; `fresh` holds the decoded pixels from
    its preparation until vLLM has processed them once (then only the encoded bytes are kept)."""

    encoded: bytes
    uuid: str
    size: tuple[int, int]
    fresh: Image.Image | None = field(default=None, repr=False)

    @property
    def nbytes(self) -> int:
        """The encoded bytes, and the pixels' while they are held."""
        width, height = self.size
        return len(self.encoded) + (width * height * 3 if self.fresh is not None else 0)

    def pixels(self) -> Image.Image:
        """The RGB pixels (the ones from preparation, else decoded from the encoded bytes)."""
        return self.fresh if self.fresh is not None else decode(self.encoded)

    def processed(self) -> None:
        """vLLM has the pixels: keep only the encoded bytes from now on."""
        self.fresh = None

    @classmethod
    def of(cls, image: Any) -> VllmImage:
        """Convert to RGB (as the processor would), name the result by its pixels and keep the
        bytes it was sent as (`SENT_AS`), else encode it (a prepared picture is taken as it
        is)."""
        if isinstance(image, VllmImage):
            return image
        source = image.info.pop(SENT_AS, None)  # set by the kit's decoder, on RGB pictures
        rgb = image if image.mode == "RGB" else image.convert("RGB")
        width, height = rgb.size
        if source is None or len(source) >= width * height * 3:  # padded bytes: not worth it
            source = encode(rgb)
        return cls(source, content_id(rgb), rgb.size, rgb)

    @classmethod
    def restored(cls, data: bytes, max_pixels: int | None = None) -> VllmImage:
        """A picture read back from a snapshot, named by its pixels as this build decodes them
        (never by the id the snapshot records: vLLM trusts ids); ValueError if it is none, or
        holds over `max_pixels`."""
        rgb = decode(data, max_pixels)
        return cls(data, content_id(rgb), rgb.size)


def pictures(prepared: Any) -> tuple[VllmImage, ...]:
    """The pictures a prepared value holds, in order (the preparer's tuple, or one picture)."""
    if isinstance(prepared, tuple):
        return tuple(VllmImage.of(image) for image in prepared)
    return (VllmImage.of(prepared),)


class VllmImagePreparer:
    """The image processes' work for this engine: RGB conversion, the digest and the bytes to
    keep (vLLM's processor runs inside the engine, once per picture it has not seen)."""

    def __call__(self, image: Any, earlier: list[Any]) -> tuple[VllmImage, ...]:
        """A conversation's pictures in order: the earlier ones sent with it, then `image`."""
        return tuple(VllmImage.of(picture) for picture in (*earlier, image))
