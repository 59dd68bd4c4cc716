"""The seeing model's ground truth: drawn scenes show what their facts say, and training examples
are the exact ids serving feeds, with the answers (and only they) as targets."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from helpers import centre_colour

from llava.tools.tiny.profiles import PROFILES
from llava.tools.tiny.quiz import make_quiz, score, shortfalls
from llava.tools.tiny.scenes import (
    COLOURS,
    SHAPES,
    Scene,
    Shape,
    count_answer,
    dialogue,
    draw_scene,
    follow_up,
)
from llava.tools.tiny.train import SHIPPED, Recipe, encode, messages, train
from llava.tools.tiny.vision import COLOUR_IDS, KIND_IDS, patch_labels

SEEDS = range(200)


@pytest.mark.parametrize("seed", SEEDS[:40])
def test_a_scene_shows_what_its_facts_say(seed: int) -> None:
    scene = draw_scene(random.Random(seed))
    image = scene.draw()
    assert 0.5 <= scene.width / scene.height <= 2.0
    assert image.size == (scene.width, scene.height)
    kinds = [s.kind for s in scene.shapes]
    colours = [s.colour for s in scene.shapes]
    assert 1 <= len(kinds) <= 3 and len(set(kinds)) == len(kinds) == len(set(colours))
    assert ("black" if scene.dark else "white") not in colours  # never invisible
    for shape in scene.shapes:
        assert centre_colour(image, shape) == COLOURS[shape.colour]
        half = shape.size / 2
        assert half <= shape.x <= scene.width - half and half <= shape.y <= scene.height - half


def test_positions_are_asked_only_where_a_person_would_agree() -> None:
    left = Shape("circle", "red", 100, 100, 60)
    near = Shape("square", "blue", 120, 300, 60)  # 20 px right of the circle: too close to call
    far = Shape("triangle", "green", 400, 100, 60)
    scene = Scene(500, 400, False, (230, 230, 230), (left, near, far))
    assert scene.extreme("right") == far
    assert scene.extreme("left") is None
    assert scene.extreme("top") is None  # circle and triangle share a height
    assert scene.extreme("bottom") == near
    assert Scene(500, 400, False, (230, 230, 230), (left,)).extreme("left") is None
    assert count_answer(Scene(500, 400, False, (0, 0, 0), (left,))) == "There is one shape."


def test_the_other_one_is_asked_only_when_it_is_one_shape() -> None:
    rng = random.Random(0)
    for _ in range(300):
        scene = draw_scene(rng)
        about = ("kind", rng.choice(SHAPES))
        turn = follow_up(scene, rng, about)
        if "other" in turn.question:
            assert scene.by_kind(about[1]) is not None and len(scene.shapes) == 2


def test_every_kind_of_question_is_asked() -> None:
    rng = random.Random(1)
    kinds = {t.kind for _ in range(300) for t in dialogue(draw_scene(rng), rng, 3)}
    assert kinds == {"colour", "shape", "count", "position", "exists", "follow-up", "describe"}


def test_the_quiz_scores_by_kind_against_the_facts() -> None:
    quiz = make_quiz(30)
    truth = [[t.answer for t in item.turns] for item in quiz]
    assert not shortfalls(score(quiz, truth))
    wrong = [["The circle is red."] * len(item.turns) for item in quiz]
    assert shortfalls(score(quiz, wrong))


def test_a_training_example_is_what_serving_feeds_with_only_answers_as_targets() -> None:
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(SHIPPED)
    tokenizer = processor.tokenizer
    spec = PROFILES["shapes"]
    rng = random.Random(3)
    scene = draw_scene(rng)
    turns = dialogue(scene, rng, 3)
    ids, labels = encode(processor, turns, "You are a helpful assistant.", spec.num_image_tokens)
    # The first turn's prompt, through the processor with the image, as serving builds it.
    chat = messages(turns[:1], "You are a helpful assistant.")[:2]
    text = processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    served = processor(text=text, images=scene.draw(), return_tensors="pt")["input_ids"][0]
    assert ids[: len(served)] == served.tolist()
    targets = [token for token in labels if token != -100]
    answers = [tokenizer(t.answer, add_special_tokens=False)["input_ids"] for t in turns]
    assert targets == [token for answer in answers for token in answer] + [tokenizer.eos_token_id]


def test_the_towers_labels_follow_llava_preprocessing() -> None:
    """A wide canvas is padded top and bottom to a square, then resized: a shape centred at the
    canvas's left middle lands in the left column's middle rows."""
    circle = Shape("circle", "red", 50, 100, 60)
    square = Shape("square", "blue", 350, 20, 30)
    scene = Scene(400, 200, False, (230, 230, 230), (circle, square))
    colours, kinds = patch_labels(scene, image_size=64, patch=16)
    grid = [[kinds[r * 4 + c] for c in range(4)] for r in range(4)]
    assert grid[2][0] == KIND_IDS["circle"] and colours[2 * 4 + 0] == COLOUR_IDS["red"]
    assert grid[1][3] == KIND_IDS["square"]  # y 20 + 100 padding = 120 of 400: row 1
    assert sum(k > 0 for k in kinds) == 2


def test_stage_0b_labels_the_clear_extremes_in_the_same_geometry() -> None:
    from llava.tools.tiny.vision import SIDES, extreme_labels

    circle = Shape("circle", "red", 50, 100, 60)
    square = Shape("square", "blue", 350, 20, 30)
    scene = Scene(400, 200, False, (230, 230, 230), (circle, square))
    labels = extreme_labels(scene, image_size=64, patch=16)
    side = dict(zip(SIDES, range(4), strict=True))
    assert labels[2 * 4 + 0][side["left"]] == 1 and labels[2 * 4 + 0][side["bottom"]] == 1
    assert labels[1 * 4 + 3][side["right"]] == 1 and labels[1 * 4 + 3][side["top"]] == 1
    assert sum(map(sum, labels)) == 4  # nothing else is an extreme


def test_training_writes_a_checkpoint_transformers_loads(tmp_path: Path) -> None:
    from transformers import AutoModelForImageTextToText

    recipe = Recipe(steps=2, batch=2, scenes=4, vision_steps=2, extreme_steps=1, align_steps=1)
    out = train(tmp_path / "shapes", recipe)
    model = AutoModelForImageTextToText.from_pretrained(out)
    assert model.config.model_type == "llava"
    assert json.loads((out / "recipe.json").read_text())["steps"] == 2


def test_the_shipped_checkpoint_is_the_default_recipe() -> None:
    """`python -m llava.tools.tiny.train` with no flags re-trains exactly what is committed."""
    assert json.loads((SHIPPED / "recipe.json").read_text()) == json.loads(
        json.dumps(Recipe().__dict__)
    )
