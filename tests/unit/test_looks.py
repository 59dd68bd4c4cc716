"""The looks the default model trains on change how a scene is drawn, never what it shows."""

from __future__ import annotations

import colorsys
import random

import pytest
from helpers import centre_colour

from llava.tools.tiny.looks import SHADES, decoded, random_look, render, shade
from llava.tools.tiny.scenes import COLOURS, draw_scene


def off_shade(colour: str, rgb: tuple[int, int, int]) -> float:
    """How far a pixel lies outside the shades a colour name covers (0: inside), in hue turns,
    saturation and value added up."""
    (h0, h1), (s0, s1), (v0, v1) = SHADES[colour]
    h, s, v = colorsys.rgb_to_hsv(*(c / 255 for c in rgb))
    value = max(v0 - v, v - v1, 0.0)
    if v1 < 0.2:  # black: in so dark a pixel neither hue nor saturation means anything
        return value
    off = value + max(s0 - s, s - s1, 0.0)
    if h1 - h0 >= 360 or s < 0.2:  # white, or a pixel too grey to have a hue
        return off
    centre = (h0 + h1) / 2
    hue = (h * 360 - centre + 180) % 360 - 180 + centre  # red's range wraps round 0
    return off + max(h0 - hue, hue - h1, 0.0) / 360


@pytest.mark.parametrize("colour", list(COLOURS))
def test_every_shade_of_a_colour_is_in_its_range(colour: str) -> None:
    rng = random.Random(colour)
    assert all(off_shade(colour, shade(colour, rng)) < 0.005 for _ in range(200))


def test_a_look_changes_the_drawing_and_keeps_the_facts() -> None:
    rng = random.Random(5)
    plain = 0
    for _ in range(120):
        scene = draw_scene(rng, sizes=(0.12, 0.32))
        look = random_look(scene, rng)
        image = decoded(render(scene, look))
        assert image.size == (scene.width, scene.height)
        if look.fills == tuple(COLOURS[s.colour] for s in scene.shapes) and look.fmt == "PNG":
            plain += 1
            assert image.tobytes() == scene.draw().tobytes()
            continue
        assert image.tobytes() != scene.draw().tobytes()
        for shape in scene.shapes:  # blur, noise and JPEG leave each centre its colour's shade
            pixel = centre_colour(image, shape)
            nearest = min(COLOURS, key=lambda name: off_shade(name, pixel))
            assert nearest == shape.colour and off_shade(shape.colour, pixel) < 0.08, (look, shape)
    assert 15 <= plain <= 45  # about one in four is the scene's own drawing
