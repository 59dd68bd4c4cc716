"""How a scene may look: the rendering variations the default model trains on.

`Scene.draw` paints hard-edged shapes in one fixed shade per colour on a flat canvas; the
pictures people send are anti-aliased, in other shades of each colour, on tinted or graded
backgrounds, blurred or noisy, and JPEG-compressed. Training on one look, the model answered
70-76% right on scenes drawn elsewhere; it trains on these instead (the scene's facts, and so
the answers, stay the same whatever the look).
"""

from __future__ import annotations

import colorsys
import io
import random
from dataclasses import dataclass
from typing import Any

from llava.tools.tiny.scenes import COLOURS, Scene, file_bytes, paint

# Each colour name as a range of hue (degrees; red wraps round 0), saturation and value: the
# shades a person would still call by that name.
SHADES: dict[str, tuple[tuple[float, float], tuple[float, float], tuple[float, float]]] = {
    "red": ((-8.0, 8.0), (0.7, 1.0), (0.6, 1.0)),
    "orange": ((20.0, 41.0), (0.75, 1.0), (0.85, 1.0)),
    "yellow": ((46.0, 62.0), (0.7, 1.0), (0.85, 1.0)),
    "green": ((90.0, 150.0), (0.55, 1.0), (0.4, 0.9)),
    "blue": ((200.0, 245.0), (0.6, 1.0), (0.55, 1.0)),
    "purple": ((265.0, 310.0), (0.5, 1.0), (0.4, 0.85)),
    "black": ((0.0, 360.0), (0.0, 0.3), (0.0, 0.18)),
    "white": ((0.0, 360.0), (0.0, 0.06), (0.93, 1.0)),
}


def shade(colour: str, rng: random.Random) -> tuple[int, int, int]:
    """Return one RGB shade of a colour name."""
    (h0, h1), (s0, s1), (v0, v1) = SHADES[colour]
    r, g, b = colorsys.hsv_to_rgb(
        (rng.uniform(h0, h1) % 360) / 360, rng.uniform(s0, s1), rng.uniform(v0, v1)
    )
    return round(r * 255), round(g * 255), round(b * 255)


@dataclass(frozen=True)
class Look:
    """One way of rendering a scene: edges, shades, canvas, blur, noise and file format."""

    supersample: int  # 1: hard edges, as Scene.draw; 2-4: anti-aliased
    fills: tuple[tuple[int, int, int], ...]  # one per shape
    background: tuple[int, int, int]
    gradient: tuple[int, int, int]  # added across the canvas, top-left to bottom-right
    blur: float  # Gaussian radius, pixels
    noise: float  # Gaussian sigma, levels (the field is seeded by the canvas's size)
    fmt: str  # PNG or JPEG
    quality: int


def random_look(scene: Scene, rng: random.Random) -> Look:
    """Return a random look for a scene: one in four is the scene's own plain drawing."""
    if rng.random() < 0.25:
        fills = tuple(COLOURS[s.colour] for s in scene.shapes)
        return Look(1, fills, scene.background, (0, 0, 0), 0.0, 0.0, "PNG", 95)
    level = rng.randint(0, 70) if scene.dark else rng.randint(190, 255)
    r, g, b = (min(255, max(0, level + rng.randint(-14, 14))) for _ in range(3))
    span = rng.randint(-30, 30) if rng.random() < 0.4 else 0
    return Look(
        supersample=rng.choice((1, 2, 3, 4)),
        fills=tuple(shade(s.colour, rng) for s in scene.shapes),
        background=(r, g, b),
        gradient=(span, span, span),
        blur=rng.uniform(0.3, 1.2) if rng.random() < 0.25 else 0.0,
        noise=rng.uniform(1.0, 6.0) if rng.random() < 0.25 else 0.0,
        fmt="JPEG" if rng.random() < 0.6 else "PNG",
        quality=rng.randint(30, 95),
    )


def render(scene: Scene, look: Look) -> bytes:
    """Return the scene's file bytes, rendered in ``look``."""
    import numpy as np
    from PIL import Image, ImageFilter

    k = look.supersample
    canvas = Image.new("RGB", (scene.width * k, scene.height * k), look.background)
    paint(canvas, scene.shapes, look.fills, k)
    if k > 1:
        canvas = canvas.resize((scene.width, scene.height), Image.Resampling.LANCZOS)
    if look.blur:
        canvas = canvas.filter(ImageFilter.GaussianBlur(look.blur))
    if look.gradient != (0, 0, 0) or look.noise:
        pixels = np.asarray(canvas, dtype=np.float32)
        ramp = np.add.outer(np.linspace(0, 0.5, scene.height), np.linspace(0, 0.5, scene.width))
        pixels += ramp[..., None] * np.asarray(look.gradient, dtype=np.float32)
        if look.noise:
            pixels += np.random.default_rng(scene.width * scene.height).normal(
                0, look.noise, pixels.shape
            )
        canvas = Image.fromarray(pixels.clip(0, 255).astype(np.uint8))
    return file_bytes(canvas, look.fmt, look.quality)


def decoded(data: bytes) -> Any:
    """Return file bytes as the RGB picture serving decodes."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        return image.convert("RGB")
