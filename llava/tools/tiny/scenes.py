"""Scenes the seeing tiny model is trained and tested on: one to three shapes, and what is true.

A scene is drawn from a seed: a plain light or dark canvas of any size with an aspect ratio from
1:2 to 2:1, holding one to three different shapes (circle, square, triangle) in different colours.
`Scene.facts` answer the questions `dialogues` asks, so training data and accuracy tests come
from the same ground truth and never from the model.
"""

from __future__ import annotations

import io
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

SHAPES = ("circle", "square", "triangle")
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (215, 35, 35),
    "orange": (250, 140, 10),
    "yellow": (245, 215, 25),
    "green": (35, 160, 55),
    "blue": (35, 85, 220),
    "purple": (135, 50, 180),
    "black": (12, 12, 12),
    "white": (250, 250, 250),
}
NUMBERS = ("no", "one", "two", "three")


@dataclass(frozen=True)
class Shape:
    """One shape on the canvas: its kind, colour name and bounding box centre and size."""

    kind: str
    colour: str
    x: float  # centre, pixels from the left
    y: float  # centre, pixels from the top
    size: float  # side of its bounding box, pixels


@dataclass(frozen=True)
class Scene:
    """A canvas and the shapes on it."""

    width: int
    height: int
    dark: bool
    background: tuple[int, int, int]
    shapes: tuple[Shape, ...]

    def by_kind(self, kind: str) -> Shape | None:
        """Return the shape of that kind, if the scene has one."""
        return next((s for s in self.shapes if s.kind == kind), None)

    def by_colour(self, colour: str) -> Shape | None:
        """Return the shape of that colour, if the scene has one."""
        return next((s for s in self.shapes if s.colour == colour), None)

    def extreme(self, side: str) -> Shape | None:
        """Return the shape clearly furthest to ``side`` (left, right, top, bottom), if any."""
        if len(self.shapes) < 2:
            return None
        horizontal = side in ("left", "right")
        sign = -1 if side in ("left", "top") else 1
        ranked = sorted(self.shapes, key=lambda s: sign * (s.x if horizontal else s.y))
        first, second = ranked[-1], ranked[-2]
        gap = abs((first.x - second.x) if horizontal else (first.y - second.y))
        # Clearly: the centres differ by at least half the larger shape, so a person agrees.
        return first if gap >= 0.5 * max(first.size, second.size) else None

    def draw(self) -> Any:
        """Return the scene as a PIL RGB image."""
        from PIL import Image

        image = Image.new("RGB", (self.width, self.height), self.background)
        paint(image, self.shapes, [COLOURS[shape.colour] for shape in self.shapes])
        return image

    def encode(self, fmt: str = "PNG", quality: int = 90) -> bytes:
        """Return the scene as PNG or JPEG file bytes."""
        return file_bytes(self.draw(), fmt, quality)


def paint(image: Any, shapes: Sequence[Shape], fills: Sequence[Any], scale: int = 1) -> None:
    """Draw each shape, hard-edged, in its fill onto ``image``, whose canvas is ``scale`` times
    the scene's (the one drawing both the plain scene and every training look use)."""
    from PIL import ImageDraw

    pen = ImageDraw.Draw(image)
    for shape, fill in zip(shapes, fills, strict=True):
        x, y, half = shape.x * scale, shape.y * scale, shape.size * scale / 2
        box = (x - half, y - half, x + half, y + half)
        if shape.kind == "circle":
            pen.ellipse(box, fill=fill)
        elif shape.kind == "square":
            pen.rectangle(box, fill=fill)
        else:
            pen.polygon([(x, box[1]), (box[2], box[3]), (box[0], box[3])], fill=fill)


def file_bytes(image: Any, fmt: str, quality: int) -> bytes:
    """Return a picture as PNG or JPEG file bytes."""
    out = io.BytesIO()
    image.save(out, format=fmt, **({"quality": quality} if fmt == "JPEG" else {}))
    return out.getvalue()


def draw_scene(
    rng: random.Random, count: int | None = None, sizes: tuple[float, float] = (0.17, 0.26)
) -> Scene:
    """Return a random scene: canvas, background and 1-3 non-overlapping shapes, each ``sizes``
    (a range) of the canvas's longer side across."""
    ratio = math.exp(rng.uniform(math.log(0.5), math.log(2.0)))
    long_side = rng.randint(160, 800)
    width, height = (
        (long_side, round(long_side / ratio))
        if ratio >= 1
        else (
            round(long_side * ratio),
            long_side,
        )
    )
    dark = rng.random() < 0.5
    level = rng.randint(20, 60) if dark else rng.randint(205, 240)
    background = tuple(min(255, max(0, level + rng.randint(-8, 8))) for _ in range(3))
    banned = "black" if dark else "white"
    count = count or rng.randint(1, 3)
    kinds = rng.sample(SHAPES, count)
    colours = rng.sample([c for c in COLOURS if c != banned], count)
    while True:
        shapes: list[Shape] = []
        for kind, colour in zip(kinds, colours, strict=True):
            for _ in range(50):
                size = rng.uniform(*sizes) * max(width, height)
                size = min(size, 0.8 * min(width, height))
                x = rng.uniform(size / 2 + 2, width - size / 2 - 2)
                y = rng.uniform(size / 2 + 2, height - size / 2 - 2)
                if all(_apart(x, y, size, other) for other in shapes):
                    shapes.append(Shape(kind, colour, x, y, size))
                    break
        if len(shapes) == count:
            return Scene(width, height, dark, background, tuple(shapes))  # type: ignore[arg-type]


def _apart(x: float, y: float, size: float, other: Shape) -> bool:
    """Return whether two bounding boxes keep a gap of a tenth of the larger one."""
    gap = 0.55 * (size + other.size)
    return abs(x - other.x) >= gap or abs(y - other.y) >= gap


# Each question kind in several phrasings (US and UK spelling); answers are one fixed sentence.
COLOUR_OF = (
    "What color is the {kind}?",
    "What colour is the {kind}?",
    "Which color does the {kind} have?",
    "Which colour does the {kind} have?",
    "What is the color of the {kind}?",
    "What is the colour of the {kind}?",
)
SHAPE_OF = (
    "What shape is {colour}?",
    "Which shape is {colour}?",
    "What is the {colour} shape?",
    "Which shape has the color {colour}?",
    "Which shape has the colour {colour}?",
)
COUNT = (
    "How many shapes are there?",
    "How many shapes are in the picture?",
    "How many shapes do you see?",
    "How many shapes can you see in this image?",
    "Count the shapes.",
)
SIDE = (
    "Which shape is on the {side}?",
    "What is the {side}most shape?",
    "Which shape is furthest to the {side}?",
)
VERTICAL = (
    "Which shape is at the {side}?",
    "Which shape is nearest the {side}?",
    "What is the {side}most shape?",
)
HAS_KIND = ("Is there a {kind}?", "Is there a {kind} in the picture?", "Do you see a {kind}?")
HAS_COLOUR = ("Is there a {colour} shape?", "Is anything {colour}?", "Do you see a {colour} shape?")
AND_KIND = ("And the {kind}?", "What about the {kind}?", "And what color is the {kind}?")
AND_COLOUR = ("And the {colour} one?", "What about the {colour} one?")
OTHER = ("And the other one?", "What about the other one?", "And the other shape?")
DESCRIBE = ("What is in this picture?", "What is in the image?", "Describe the picture.")


@dataclass(frozen=True)
class Turn:
    """A question about a scene, the one right answer, and the kind of question it is."""

    question: str
    answer: str
    kind: str  # colour, shape, count, position, exists, follow-up, describe, no-picture


def colour_answer(scene: Scene, kind: str) -> str:
    """Answer which colour the shape of ``kind`` has."""
    shape = scene.by_kind(kind)
    return f"The {kind} is {shape.colour}." if shape else f"There is no {kind}."


def shape_answer(scene: Scene, colour: str) -> str:
    """Answer which shape has ``colour``."""
    shape = scene.by_colour(colour)
    return f"The {colour} shape is a {shape.kind}." if shape else f"There is no {colour} shape."


def count_answer(scene: Scene) -> str:
    """Answer how many shapes there are."""
    n = len(scene.shapes)
    return "There is one shape." if n == 1 else f"There are {NUMBERS[n]} shapes."


def describe_answer(scene: Scene) -> str:
    """Describe the scene: its shapes from left to right."""
    ordered = sorted(scene.shapes, key=lambda s: s.x)
    parts = [f"a {s.colour} {s.kind}" for s in ordered]
    listed = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
    return f"I see {listed}."


def first_turn(scene: Scene, rng: random.Random) -> tuple[Turn, tuple[str, str] | None]:
    """Return an opening question and what a follow-up can lean on ("kind"/"colour", value)."""
    roll = rng.random()
    present = [s.kind for s in scene.shapes]
    if roll < 0.3:
        kind = rng.choice(present) if rng.random() < 0.85 else rng.choice(SHAPES)
        q = rng.choice(COLOUR_OF).format(kind=kind)
        return Turn(q, colour_answer(scene, kind), "colour"), ("kind", kind)
    if roll < 0.55:
        colours = [s.colour for s in scene.shapes]
        colour = rng.choice(colours) if rng.random() < 0.85 else rng.choice(list(COLOURS))
        q = rng.choice(SHAPE_OF).format(colour=colour)
        return Turn(q, shape_answer(scene, colour), "shape"), ("colour", colour)
    if roll < 0.62:
        return Turn(rng.choice(COUNT), count_answer(scene), "count"), None
    if roll < 0.84:
        side = rng.choice(("left", "right", "top", "bottom"))
        shape = scene.extreme(side)
        if shape is not None:
            phrasings = SIDE if side in ("left", "right") else VERTICAL
            q = rng.choice(phrasings).format(side=side)
            return Turn(q, f"The {shape.kind} is on the {side}.", "position"), None
    if roll < 0.95:
        if rng.random() < 0.5:
            kind = rng.choice(SHAPES)
            has = scene.by_kind(kind) is not None
            answer = f"Yes, there is a {kind}." if has else f"No, there is no {kind}."
            return Turn(rng.choice(HAS_KIND).format(kind=kind), answer, "exists"), None
        colour = rng.choice(list(COLOURS))
        has = scene.by_colour(colour) is not None
        answer = f"Yes, there is a {colour} shape." if has else f"No, there is no {colour} shape."
        return Turn(rng.choice(HAS_COLOUR).format(colour=colour), answer, "exists"), None
    return describe(scene, rng), None


def describe(scene: Scene, rng: random.Random) -> Turn:
    """Return a request to describe the scene (LLaVA's first training stage is captions)."""
    return Turn(rng.choice(DESCRIBE), describe_answer(scene), "describe")


def follow_up(scene: Scene, rng: random.Random, about: tuple[str, str]) -> Turn:
    """Return a follow-up that leans on the previous turn's subject ("And the other one?")."""
    axis, value = about
    if axis == "kind":
        others = [s.kind for s in scene.shapes if s.kind != value]
        if scene.by_kind(value) and len(others) == 1 and rng.random() < 0.5:
            return Turn(rng.choice(OTHER), colour_answer(scene, others[0]), "follow-up")
        kind = rng.choice(others or list(SHAPES))
        return Turn(rng.choice(AND_KIND).format(kind=kind), colour_answer(scene, kind), "follow-up")
    others = [s.colour for s in scene.shapes if s.colour != value]
    if scene.by_colour(value) and len(others) == 1 and rng.random() < 0.5:
        return Turn(rng.choice(OTHER), shape_answer(scene, others[0]), "follow-up")
    colour = rng.choice(others or list(COLOURS))
    q = rng.choice(AND_COLOUR).format(colour=colour)
    return Turn(q, shape_answer(scene, colour), "follow-up")


def dialogue(scene: Scene, rng: random.Random, turns: int) -> list[Turn]:
    """Return up to ``turns`` turns: fresh questions, each possibly followed by a follow-up."""
    out: list[Turn] = []
    about: tuple[str, str] | None = None
    while len(out) < turns:
        if about is not None and rng.random() < 0.6:
            turn = follow_up(scene, rng, about)
            out.append(turn)
            about = None
            continue
        turn, about = first_turn(scene, rng)
        out.append(turn)
    return out


# examples/sample.png: what the quickstart and the README ask about.
SAMPLE = Scene(
    width=640,
    height=400,
    dark=False,
    background=(232, 232, 228),
    shapes=(Shape("circle", "red", 170, 210, 160), Shape("square", "blue", 460, 190, 145)),
)
