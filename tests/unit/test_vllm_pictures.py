"""How a vLLM session keeps its pictures (llava/engines/vllm/images.py, snapshot.py): as the
bytes the client sent (else PNG), named by their pixels, decoded again only within limits;
hostile snapshots refused as ValueError. Pillow only: no vLLM needed."""

from __future__ import annotations

import io
import json
import random

import numpy as np
import pytest
from PIL import Image, ImageFile, PngImagePlugin
from safetensors.numpy import save as save_arrays

from llava.core.config import ServerConfig
from llava.engines.vllm import images as pictures_module
from llava.engines.vllm.images import VllmImage, VllmImagePreparer, decode
from llava.engines.vllm.snapshot import FORMAT, PNGS, RAW_PIXELS, capture, restore
from llava.engines.vllm.state import VllmSession
from llava.images.decode import ImageDecoder
from llava.tools.tiny.scenes import draw_scene

LIMITS = ServerConfig()  # what a client may upload, by default


def scene(seed: int = 1) -> Image.Image:
    return draw_scene(random.Random(seed), count=2).draw().convert("RGB")


def jpeg_of(rgb: Image.Image) -> bytes:
    out = io.BytesIO()
    rgb.save(out, format="JPEG", quality=85)
    return out.getvalue()


def test_pixels_without_sent_bytes_are_kept_as_png_and_weigh_it_once_processed() -> None:
    rgb = scene()
    image = VllmImage.of(rgb)
    assert image.encoded.startswith(b"\x89PNG") and image.size == rgb.size
    assert image.nbytes == len(image.encoded) + rgb.size[0] * rgb.size[1] * 3  # pixels held
    image.processed()
    assert image.fresh is None and image.nbytes == len(image.encoded)
    assert decode(image.encoded).tobytes() == rgb.tobytes()
    assert VllmImage.restored(image.encoded).uuid == image.uuid


def test_a_sent_photo_is_kept_as_its_own_bytes_not_encoded_again() -> None:
    """A JPEG as the image processes get it: the kit's decoder's pixels, kept as the JPEG
    itself (no PNG made: 100 ms for a 1024x768 photo), which decodes to the same pixels and
    the same content id; the bytes are not sent back twice with the pixels."""
    sent = jpeg_of(scene())
    decoded = ImageDecoder(max_pixels=10**8, max_bytes=10**8)(sent)
    [image] = VllmImagePreparer()(decoded, [])
    assert image.encoded == sent and image.fresh is not None
    assert "llava.sent_as" not in image.fresh.info
    assert image.uuid == VllmImage.of(decode(sent)).uuid  # the same pixels, PNG or not
    image.processed()
    assert image.nbytes == len(sent) and image.pixels().tobytes() == decoded.tobytes()
    assert VllmImage.restored(sent).uuid == image.uuid


def encoded(rgb: Image.Image, fmt: str, **options: object) -> bytes:
    out = io.BytesIO()
    rgb.save(out, format=fmt, **options)
    return out.getvalue()


def test_sent_bytes_are_kept_only_where_pillow_alone_decodes_them_to_the_same_pixels() -> None:
    """Whatever is kept decodes to the pixels the kit's decoder made of the upload: the bytes
    themselves for an upright RGB JPEG or PNG, a PNG of the pixels for a JPEG to be turned
    upright, a transparent, grey or palette picture, and bytes that weigh more than their
    pixels (a session holds what it keeps)."""
    rgb = scene()
    rotated = Image.Exif()
    rotated[0x0112] = 6
    padding = PngImagePlugin.PngInfo()
    padding.add_text("comment", "x" * 10_000)  # a few pixels sent with 10 KB of text
    uploads = {
        "jpeg": (encoded(rgb, "JPEG"), True),
        "rgb png": (encoded(rgb, "PNG"), True),
        "jpeg to turn upright": (encoded(rgb, "JPEG", exif=rotated.tobytes()), False),
        "rgba png": (encoded(rgb.convert("RGBA"), "PNG"), False),
        "grey jpeg": (encoded(rgb.convert("L"), "JPEG"), False),
        "palette png": (encoded(rgb.convert("P"), "PNG"), False),
        "webp": (encoded(rgb, "WEBP", lossless=True), False),
        "png padded past its pixels": (encoded(rgb.resize((8, 8)), "PNG", pnginfo=padding), False),
        "rgb png with a transparent colour": (
            encoded(rgb, "PNG", transparency=rgb.getpixel((0, 0))),
            False,
        ),
        "jpeg of too many scans": (encoded(rgb, "JPEG", comment=b"\xff\xda" * 40), False),
    }
    decoder = ImageDecoder(max_pixels=10**8, max_bytes=10**8)
    for name, (sent, kept) in uploads.items():
        pixels = decoder(sent)
        image = VllmImage.of(pixels)
        assert (image.encoded == sent) is kept, name
        assert kept or image.encoded.startswith(b"\x89PNG"), name
        assert decode(image.encoded).tobytes() == pixels.tobytes(), name
        assert VllmImage.restored(image.encoded).uuid == image.uuid, name


def test_a_restored_picture_is_named_by_its_pixels_never_by_its_record() -> None:
    """vLLM trusts ids: a snapshot recording another picture's id gets its own pixels' id."""
    image = VllmImage.of(scene())
    other = VllmImage.of(scene(2))
    state = VllmSession(None, (other,), [])
    data = capture(state, "model-a", {})()
    forged = data.replace(other.uuid.encode(), image.uuid.encode())
    assert forged != data
    assert restore(forged, "model-a", LIMITS)[0].images[0].uuid == other.uuid


def test_decode_refuses_what_is_not_a_small_enough_picture(monkeypatch: pytest.MonkeyPatch) -> None:
    for data in (b"\x89PNG\r\n\x1a\n garbage", b"\xff\xd8\xff not a jpeg", b""):
        with pytest.raises(ValueError):
            decode(data)
    grey = io.BytesIO()
    scene().convert("L").save(grey, format="PNG")
    with pytest.raises(ValueError, match="RGB"):
        decode(grey.getvalue())
    for fmt in ("WEBP", "TIFF", "BMP"):  # only the formats the kit keeps reach a decoder
        with pytest.raises(ValueError, match="PNG or JPEG"):
            decode(encoded(scene(), fmt))
    with pytest.raises(ValueError, match="scans"):  # each one decodes the whole picture again
        decode(encoded(scene(), "JPEG", comment=b"\xff\xda" * 40))
    png = VllmImage.of(scene()).encoded
    width, height = scene().size
    monkeypatch.setattr(pictures_module, "MAX_KEPT_PIXELS", width * height - 1)
    with pytest.raises(ValueError, match=f"over {width * height - 1} pixels"):  # its header's
        decode(png)
    with pytest.raises(ValueError, match=f"over {width * height - 2} pixels"):  # a lower limit
        decode(png, width * height - 2)


def snapshot_of(meta: dict, arrays: dict) -> bytes:
    return bytes(save_arrays(arrays, metadata={"llava": json.dumps(meta)}))


def raw_meta(uuid: str) -> dict:
    """The header of a first-format snapshot (raw RGB pixels) of `model-a` with one picture."""
    return {
        "format": RAW_PIXELS,
        "model": "model-a",
        "system_prompt": None,
        "history": [],
        "uuids": [uuid],
        "extra": {},
    }


def test_snapshots_write_kept_bytes_read_every_format_and_refuse_hostile_pictures() -> None:
    rgb = scene()
    image = VllmImage.of(rgb)
    photo = VllmImage.of(ImageDecoder(max_pixels=10**8, max_bytes=10**8)(jpeg_of(rgb)))
    state = VllmSession("be brief", (image, photo), [])
    data = capture(state, "model-a", {"k": 1})()
    assert len(data) < len(image.encoded) + len(photo.encoded) + 2048  # no pixels
    again, extra = restore(data, "model-a", LIMITS)
    assert extra == {"k": 1} and [i.uuid for i in again.images] == [image.uuid, photo.uuid]
    assert again.images[1].encoded == photo.encoded  # the JPEG, as it was sent
    assert FORMAT.encode() in data  # a JPEG kept: the third format
    pngs = data.replace(FORMAT.encode(), PNGS.encode())
    assert restore(pngs, "model-a", LIMITS)[0].images[0].uuid == image.uuid
    only_pngs = capture(VllmSession(None, (image,), []), "model-a", {})()
    assert PNGS.encode() in only_pngs  # what a kit before the third format reads
    meta = raw_meta(image.uuid)
    old, _ = restore(snapshot_of(meta, {"image.0": np.asarray(rgb)}), "model-a", LIMITS)
    assert old.images[0].uuid == image.uuid
    with pytest.raises(ValueError, match="different model"):
        restore(data, "model-b", LIMITS)
    hostile = {
        "not a png": np.frombuffer(b"not a png at all", np.uint8),
        "pixels where a PNG goes": np.asarray(rgb),
    }
    for array in hostile.values():
        with pytest.raises(ValueError, match="picture 0"):
            restore(snapshot_of({**meta, "format": FORMAT}, {"image.0": array}), "model-a", LIMITS)


def test_a_restored_session_is_held_to_the_limits_an_upload_is_held_to(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A snapshot (from the store: sealed, but written under other settings) with a larger
    picture or more pictures than this instance lets a client send is refused, that session
    only, before any of its pictures is decoded."""
    image = VllmImage.of(scene())
    width, height = image.size
    data = capture(VllmSession(None, (image, image), []), "model-a", {})()
    raw = snapshot_of(raw_meta(image.uuid), {"image.0": np.asarray(scene())})
    exact = ServerConfig(image_max_pixels=width * height)  # at the limit: as an upload, taken
    assert restore(data, "model-a", exact)[0].images[1].uuid == image.uuid
    assert restore(raw, "model-a", exact)[0].images[0].uuid == image.uuid
    small = ServerConfig(image_max_pixels=width * height - 1)
    decoded: list[str] = []
    load, encode = ImageFile.ImageFile.load, pictures_module.encode

    def loading(self: ImageFile.ImageFile) -> object:
        decoded.append("bytes")
        return load(self)

    def encoding(rgb: Image.Image) -> bytes:
        decoded.append("pixels")
        return encode(rgb)

    monkeypatch.setattr(ImageFile.ImageFile, "load", loading)  # decoding a PNG or JPEG
    monkeypatch.setattr(pictures_module, "encode", encoding)  # a raw picture kept as PNG
    with pytest.raises(ValueError, match=f"picture 0: .* over {width * height - 1} pixels"):
        restore(data, "model-a", small)
    with pytest.raises(ValueError, match=f"picture 0: .* over {width * height - 1} pixels"):
        restore(raw, "model-a", small)
    with pytest.raises(ValueError, match="2 pictures, over max_images_per_session"):
        restore(data, "model-a", ServerConfig(max_images_per_session=1))
    assert decoded == []
