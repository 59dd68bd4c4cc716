"""Sniff, size-check and decode image bytes into upright RGB (decompression-bomb guarded)."""

from __future__ import annotations

import functools
import io
import threading
import warnings
from dataclasses import dataclass

from PIL import ExifTags, Image, ImageOps

from llava.core.errors import ImageError, ImageTooLarge, KitError
from llava.core.pictures import SENT_AS, few_scans
from llava.images.inline import read_inline
from llava.images.refs import clean_text

# Formats worth accepting from strangers; Pillow's exotic plugins (EPS shells out to
# Ghostscript, others are rarely exercised) stay out of reach.
_WANTED_FORMATS = ("PNG", "JPEG", "MPO", "GIF", "WEBP", "BMP", "TIFF", "AVIF")
_WARNINGS_LOCK = threading.Lock()


@functools.lru_cache(maxsize=1)
def _formats() -> tuple[str, ...]:
    """Return the accepted formats this Pillow build can actually open."""
    Image.init()
    return tuple(f for f in _WANTED_FORMATS if f in Image.OPEN)


def _open(data: bytes) -> Image.Image:
    """Open image bytes lazily (header only), mapping Pillow's failures to kit errors."""
    try:
        # Pillow only *warns* between 1x and 2x its bomb limit; make that band an error here
        # without touching Pillow's global limit. catch_warnings swaps process-wide state, so
        # our threads take turns; the section only parses a header, so the lock is brief.
        with _WARNINGS_LOCK, warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            return Image.open(io.BytesIO(data), formats=list(_formats()))
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise ImageTooLarge(
            "image dimensions exceed the decompression-bomb limit; send a smaller image"
        ) from None
    except Image.UnidentifiedImageError:
        raise ImageError(
            "data is not a supported image (PNG, JPEG, GIF, WebP, BMP or TIFF); check that "
            "the reference points at an image file"
        ) from None


def _check_pixels(size: tuple[int, int], max_pixels: int) -> None:
    """Refuse empty images and images over the pixel budget, using header dimensions."""
    width, height = size
    if width < 1 or height < 1:
        raise ImageError(f"image has no pixels ({width}x{height}); send a non-empty image")
    if width * height > max_pixels:
        raise ImageTooLarge(
            f"image is {width}x{height} = {width * height} pixels, over the {max_pixels}-pixel "
            "limit; downscale it before sending",
            max_pixels=max_pixels,
        )


def _upright(img: Image.Image) -> Image.Image:
    """Apply the EXIF orientation tag, if any."""
    try:
        return ImageOps.exif_transpose(img)
    except Exception:  # noqa: BLE001 - corrupt EXIF should not sink an otherwise good image
        return img


def _to_8bit(img: Image.Image) -> Image.Image:
    """Map 16-bit integer and float grayscale to 8-bit "L", keeping relative brightness."""
    wide = img.convert("I") if img.mode.startswith("I;16") else img
    extrema = wide.getextrema()  # a single-band image: (low, high) numbers
    low, high = float(extrema[0]), float(extrema[1])  # type: ignore[arg-type]
    if img.mode.startswith("I;16"):
        scale, offset = 255 / 65535, 0.0
    elif img.mode == "F" and low >= 0 and high <= 1:
        scale, offset = 255.0, 0.0
    elif low >= 0 and high <= 255:
        scale, offset = 1.0, 0.0
    elif img.mode == "I" and low >= 0 and high <= 65535:
        scale, offset = 255 / 65535, 0.0
    else:  # unknown range: stretch what is there
        span = (high - low) or 1
        scale, offset = 255 / span, -low * 255 / span
    return wide.point(lambda v: v * scale + offset).convert("L")


def to_rgb(img: Image.Image) -> Image.Image:
    """Convert any Pillow mode to RGB, compositing transparency onto white."""
    if img.mode.startswith("I;16") or img.mode in ("I", "F"):
        img = _to_8bit(img)
    if "transparency" in img.info and img.mode in ("P", "L", "RGB"):
        img = img.convert("RGBA")
    if img.mode == "La":  # premultiplied; Pillow only converts it to LA
        img = img.convert("LA")
    if img.mode in ("RGBA", "LA", "PA", "RGBa"):
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return img if img.mode == "RGB" else img.convert("RGB")


def _parse(data: bytes, max_pixels: int) -> Image.Image:
    """Identify, size-check, verify and decode image bytes (first frame only)."""
    try:
        probe = _open(data)
        _check_pixels(probe.size, max_pixels)
        probe.verify()
        # verify() leaves the image unusable, so decode from a fresh open.
        img = _open(data)
        img.load()  # animated formats decode only the first frame here
        return img
    except KitError:
        raise
    except (Image.DecompressionBombError, MemoryError):
        raise ImageTooLarge(
            "image is too large to decode; send a smaller image", max_pixels=max_pixels
        ) from None
    except Exception:  # noqa: BLE001 - Pillow plugins raise many types on hostile input
        raise ImageError(
            "image data is corrupt or truncated; re-export the image and send it again"
        ) from None


def _decode_rgb(data: bytes, max_pixels: int) -> Image.Image:
    """Decode image bytes into an upright, fully loaded RGB image (carrying them, `SENT_AS`,
    where they are plain)."""
    img = _parse(data, max_pixels)
    try:
        rgb = to_rgb(_upright(img))
    except (ValueError, OSError):  # Pillow's "conversion not supported" and friends
        raise ImageError(
            f"image color mode {clean_text(img.mode, 12)!r} is not supported; save the image as "
            "RGB (or grayscale) PNG/JPEG and send it again"
        ) from None
    rgb.load()
    if _plain(img, data):
        rgb.info[SENT_AS] = data
    return rgb


def _plain(img: Image.Image, data: bytes) -> bool:
    """Whether Pillow alone decodes `data`, which `img` was opened from, to the pixels the kit
    made of them, quickly: an opaque, upright RGB JPEG (of few scans) or PNG (then an engine can
    keep the bytes rather than the pixels)."""
    try:
        upright = img.getexif().get(ExifTags.Base.Orientation, 1) == 1
    except Exception:  # noqa: BLE001 - corrupt EXIF: `_upright` kept the pixels, but be sure
        return False
    opaque = "transparency" not in img.info
    plain = upright and opaque and img.mode == "RGB" and img.format in ("JPEG", "MPO", "PNG")
    return plain and few_scans(img.format, data)


@dataclass(frozen=True)
class ImageDecoder:
    """Turn an encoded image into upright RGB: file bytes, or inline text (data URI, base64).

    Plain data, so image processes each get a copy: they decode inline text too, so base64's
    CPU work never holds the worker's interpreter lock.
    """

    max_pixels: int
    max_bytes: int

    def __call__(self, data: bytes | str) -> Image.Image:
        if isinstance(data, str):
            data = read_inline(data, self.max_bytes)
        return _decode_rgb(data, self.max_pixels)
