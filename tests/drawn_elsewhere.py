"""Scenes of the default model's kind, drawn by a renderer written apart from the training one.

The training renderer (llava/tools/tiny/looks.py) paints with PIL; this one computes each pixel's
coverage with numpy (4x4 samples per pixel, so every edge is anti-aliased), in the shades a web
page or a drawing program names (CSS colours), on white, paper, grey and dark-theme canvases,
with equilateral triangles, its own shape sizes and layouts, saved as a JPEG at the quality a
phone or a browser uses. Only the scene's facts are shared with training: `Scene` answers the
questions, whatever draws it.
"""

from __future__ import annotations

import io
import random

import numpy as np
from PIL import Image

from llava.tools.tiny.quiz import Item
from llava.tools.tiny.scenes import SHAPES, Scene, Shape, dialogue

CSS = {
    "red": ((255, 0, 0), (220, 20, 60), (178, 34, 34), (231, 76, 60)),
    "orange": ((255, 165, 0), (255, 140, 0), (243, 156, 18)),
    "yellow": ((255, 255, 0), (255, 215, 0), (241, 196, 15)),
    "green": ((0, 128, 0), (34, 139, 34), (46, 204, 113), (50, 205, 50)),
    "blue": ((0, 0, 255), (30, 144, 255), (65, 105, 225), (52, 152, 219)),
    "purple": ((128, 0, 128), (148, 0, 211), (155, 89, 182), (138, 43, 226)),
    "black": ((0, 0, 0), (33, 33, 33), (20, 20, 20)),
    "white": ((255, 255, 255), (245, 245, 245), (236, 240, 241)),
}
LIGHT = ((255, 255, 255), (250, 249, 246), (240, 240, 240), (245, 245, 220), (220, 223, 228))
DARK = ((0, 0, 0), (30, 30, 30), (20, 33, 61), (44, 44, 46), (18, 18, 18))
SAMPLES = 4  # per pixel and axis


def _layout(rng: random.Random) -> Scene:
    """Return a canvas and 1-3 shapes of different kinds and colours that do not touch."""
    width, height = rng.choice(((640, 480), (800, 600), (1024, 768), (512, 512), (400, 300)))
    if rng.random() < 0.3:
        width, height = height, width
    dark = rng.random() < 0.4
    count = rng.randint(1, 3)
    names = [c for c in CSS if c != ("black" if dark else "white")]
    kinds, colours = rng.sample(SHAPES, count), rng.sample(names, count)
    while True:
        shapes: list[Shape] = []
        for kind, colour in zip(kinds, colours, strict=True):
            size = rng.uniform(0.15, 0.3) * max(width, height)
            size = min(size, 0.75 * min(width, height))
            for _ in range(100):
                x = rng.uniform(size / 2 + 4, width - size / 2 - 4)
                y = rng.uniform(size / 2 + 4, height - size / 2 - 4)
                if all(max(abs(x - o.x), abs(y - o.y)) > 0.6 * (size + o.size) for o in shapes):
                    shapes.append(Shape(kind, colour, x, y, size))
                    break
        if len(shapes) == count:
            background = rng.choice(DARK if dark else LIGHT)
            return Scene(width, height, dark, background, tuple(shapes))


def _coverage(shape: Shape, xs: np.ndarray, ys: np.ndarray) -> np.ndarray:
    """Return, per pixel of the sampled region, the fraction of its samples inside the shape."""
    half = shape.size / 2
    dx, dy = xs - shape.x, ys - shape.y
    if shape.kind == "circle":
        inside = dx**2 + dy**2 <= half**2
    elif shape.kind == "square":
        inside = (np.abs(dx) <= half) & (np.abs(dy) <= half)
    else:  # equilateral, point up, centred in its box
        tall = half * np.sqrt(3)
        top, bottom = -tall / 2, tall / 2
        inside = (dy >= top) & (dy <= bottom) & (np.abs(dx) <= (dy - top) / np.sqrt(3))
    return inside.reshape(ys.shape[0] // SAMPLES, SAMPLES, -1, SAMPLES).mean(axis=(1, 3))


def paint(scene: Scene, rng: random.Random) -> Image.Image:
    """Return the scene painted in CSS shades with anti-aliased edges."""
    offsets = (np.arange(SAMPLES) + 0.5) / SAMPLES
    canvas = np.empty((scene.height, scene.width, 3), np.float32)
    canvas[:] = scene.background
    for shape in scene.shapes:
        half = shape.size / 2 + 1  # the pixels the shape can touch
        left, right = max(0, int(shape.x - half)), min(scene.width, int(shape.x + half) + 1)
        top, bottom = max(0, int(shape.y - half)), min(scene.height, int(shape.y + half) + 1)
        xs = (np.arange(left, right)[:, None] + offsets).reshape(-1)[None, :]
        ys = (np.arange(top, bottom)[:, None] + offsets).reshape(-1)[:, None]
        xs, ys = np.broadcast_arrays(xs, ys)
        alpha = _coverage(shape, xs, ys)[..., None]
        colour = np.asarray(rng.choice(CSS[shape.colour]), np.float32)
        region = canvas[top:bottom, left:right]
        canvas[top:bottom, left:right] = region * (1 - alpha) + colour * alpha
    return Image.fromarray(canvas.round().astype(np.uint8))


def jpeg(image: Image.Image, rng: random.Random) -> bytes:
    """Return the picture as a JPEG at a phone's or a browser's quality."""
    out = io.BytesIO()
    image.save(out, "JPEG", quality=rng.randint(60, 92))
    return out.getvalue()


def quiz(count: int, seed: int = 7) -> list[Item]:
    """Return ``count`` scenes drawn here, each with a three-question dialogue, sent as a JPEG."""
    rng = random.Random(seed)
    items = []
    for _ in range(count):
        scene = _layout(rng)
        turns = tuple(dialogue(scene, rng, 3))
        items.append(Item(scene, turns, jpeg(paint(scene, rng), rng)))
    return items
