"""The looks the default model trains on change how a scene is drawn, never what it shows; and
text without a picture is always answered with the one reply."""

from __future__ import annotations

import colorsys
import random

import pytest
from helpers import centre_colour

from llava.tools.tiny.chatter import REPLY, TASKS, corpus, text_dialogue
from llava.tools.tiny.looks import SHADES, decoded, random_look, render, shade
from llava.tools.tiny.scenes import COLOURS, draw_scene


def within_shade(colour: str, rgb: tuple[int, int, int], slack: float) -> bool:
    """Whether a pixel is one of the shades a colour name covers, give or take ``slack``."""
    (h0, h1), (s0, s1), (v0, v1) = SHADES[colour]
    h, s, v = colorsys.rgb_to_hsv(*(c / 255 for c in rgb))
    if v1 < 0.2:  # black: in so dark a pixel neither hue nor saturation means anything
        return v <= v1 + slack
    fits = s0 - slack <= s <= s1 + slack and v0 - slack <= v <= v1 + slack
    if h1 - h0 >= 360 or s < 0.2:  # white: the hue means nothing
        return fits
    centre = (h0 + h1) / 2
    hue = (h * 360 - centre + 180) % 360 - 180 + centre  # red's range wraps round 0
    return fits and h0 - 360 * slack <= hue <= h1 + 360 * slack


@pytest.mark.parametrize("colour", list(COLOURS))
def test_every_shade_of_a_colour_is_in_its_range(colour: str) -> None:
    rng = random.Random(colour)
    assert all(within_shade(colour, shade(colour, rng), 0.01) for _ in range(200))


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
        for shape in scene.shapes:  # blur, noise and JPEG leave each centre its colour's shade
            assert within_shade(shape.colour, centre_colour(image, shape), 0.08), (look, shape)
    assert 15 <= plain <= 45  # about one in four is the scene's own drawing


def test_text_without_a_picture_is_answered_with_the_reply() -> None:
    rng = random.Random(0)
    turns = [t for _ in range(200) for t in text_dialogue(rng, 2)]
    assert {t.answer for t in turns} == {REPLY}
    asked = {t.question for t in turns}
    assert any(q.startswith("### Task") for q in asked)  # a chat client's own requests
    assert any(q.endswith("?") and "shape" in q for q in asked)  # a question with no picture
    assert all(task in corpus() for task in TASKS) and REPLY in corpus()
