"""How a vLLM session keeps its pictures (llava/engines/vllm/images.py, snapshot.py): as PNG,
named by their pixels, decoded again only within limits; hostile snapshots refused as
ValueError. Pillow only: no vLLM needed."""

from __future__ import annotations

import io
import json
import random

import numpy as np
import pytest
from PIL import Image
from safetensors.numpy import save as save_arrays

from llava.core.config import ServerConfig
from llava.engines.vllm import images as pictures_module
from llava.engines.vllm.images import VllmImage, decode
from llava.engines.vllm.snapshot import FORMAT, RAW_PIXELS, capture, restore
from llava.engines.vllm.state import VllmSession
from llava.tools.tiny.scenes import draw_scene

LIMITS = ServerConfig()  # what a client may upload, by default


def scene(seed: int = 1) -> Image.Image:
    return draw_scene(random.Random(seed), count=2).draw().convert("RGB")


def test_a_picture_is_kept_as_png_of_the_same_pixels_and_weighs_its_png_once_processed() -> None:
    rgb = scene()
    image = VllmImage.of(rgb)
    assert image.png.startswith(b"\x89PNG") and image.size == rgb.size
    assert image.nbytes == len(image.png) + rgb.size[0] * rgb.size[1] * 3  # pixels still held
    image.processed()
    assert image.fresh is None and image.nbytes == len(image.png)
    assert decode(image.png).tobytes() == rgb.tobytes()
    assert VllmImage.restored(image.png, image.uuid).uuid == image.uuid
    other = VllmImage.of(scene(2))
    with pytest.raises(ValueError, match="content id"):
        VllmImage.restored(other.png, image.uuid)


def test_decode_refuses_what_is_not_a_small_enough_rgb_png(monkeypatch: pytest.MonkeyPatch) -> None:
    jpeg = io.BytesIO()
    scene().save(jpeg, format="JPEG")
    grey = io.BytesIO()
    scene().convert("L").save(grey, format="PNG")
    for data in (jpeg.getvalue(), grey.getvalue(), b"\x89PNG\r\n\x1a\n garbage", b""):
        with pytest.raises(ValueError):
            decode(data)
    png = VllmImage.of(scene()).png
    width, height = scene().size
    monkeypatch.setattr(pictures_module, "MAX_PNG_PIXELS", width * height - 1)
    with pytest.raises(ValueError, match="at most"):  # from the header, before decoding
        decode(png)


def snapshot_of(meta: dict, arrays: dict) -> bytes:
    return bytes(save_arrays(arrays, metadata={"llava": json.dumps(meta)}))


def test_snapshots_write_png_read_both_formats_and_refuse_hostile_pictures() -> None:
    rgb = scene()
    image = VllmImage.of(rgb)
    state = VllmSession("be brief", (image,), [])
    data = capture(state, "model-a", {"k": 1})()
    assert len(data) < len(image.png) + 2048  # the PNG and a header, no pixels
    again, extra = restore(data, "model-a", LIMITS)
    assert extra == {"k": 1} and again.images[0].uuid == image.uuid
    meta = {
        "format": RAW_PIXELS,
        "model": "model-a",
        "system_prompt": None,
        "history": [],
        "uuids": [image.uuid],
        "extra": {},
    }
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


def test_a_restored_session_is_held_to_the_limits_an_upload_is_held_to() -> None:
    """A snapshot (from the store: sealed, but written under other settings) with a larger
    picture or more pictures than this instance lets a client send is refused, that session
    only."""
    image = VllmImage.of(scene())
    width, height = image.size
    data = capture(VllmSession(None, (image, image), []), "model-a", {})()
    assert restore(data, "model-a", LIMITS)[0].images[1].uuid == image.uuid
    small = ServerConfig(image_max_pixels=width * height - 1)
    with pytest.raises(ValueError, match="image_max_pixels"):
        restore(data, "model-a", small)
    with pytest.raises(ValueError, match="max_images_per_session"):
        restore(data, "model-a", ServerConfig(max_images_per_session=1))
