"""Every family in-process, against transformers' own pipeline: anyres images, images added
mid-conversation, memory tiers and batched decode across different image-token counts."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import Reference, make_image

from llava.core.config import ServerConfig
from llava.core.errors import InvalidRequest
from llava.core.params import GenerationParams
from llava.engines.transformers import LlavaEngine
from llava.tools.tiny import build_checkpoint

TOKENS = 10
GREEDY = GenerationParams(max_new_tokens=TOKENS)
PROMPTS = ["What is this?", "Which colors do you see?", "Is it big?", "Why?"]
SIZES = [(61, 37), (30, 90), (80, 64)]


# image_processes 2: on a CPU the images' preparer runs the vision tower (in the server's
# image processes); 0: the tower is a piece of a step, as on a GPU.
@pytest.fixture(
    scope="module",
    params=[("next", 2), ("onevision", 2), ("interleave", 2), ("next", 0), ("onevision", 0)],
    ids=lambda p: f"{p[0]}-tower-{'with-processor' if p[1] else 'in-step'}",
)
def family(request, tmp_path_factory) -> tuple[str, LlavaEngine, Reference]:
    profile, image_processes = request.param
    checkpoint = build_checkpoint(tmp_path_factory.mktemp("ckpt") / profile, profile)
    config = ServerConfig(device="cpu", max_images_per_session=3, image_processes=image_processes)
    engine = LlavaEngine.load(checkpoint, config)
    return profile, engine, Reference(Path(checkpoint))


def answer(engine, state, prompt, **kw):
    turn = engine.start_turn(state, prompt, GREEDY, **kw)
    while not turn.done:
        assert not engine.step([turn])
    engine.finish_turn(turn)
    return turn


def test_three_turns_equal_the_pipeline_whatever_the_image_size(family):
    profile, engine, reference = family
    counts = set()
    for seed, size in enumerate(SIZES):
        image = make_image(40 + seed, size)
        state = engine.open_session(image, "Be brief.")
        got = [answer(engine, state, p).text for p in PROMPTS[:3]]
        assert got == reference.answers(image, PROMPTS[:3], TOKENS, "Be brief.")
        counts.add(state.images.tokens[0])
    if profile != "interleave":  # anyres: the token count follows the image's size and aspect
        assert len(counts) == len(SIZES)


def test_batched_decode_across_different_image_token_counts(family):
    _, engine, reference = family
    images = [make_image(50 + i, size) for i, size in enumerate(SIZES)]
    states = [engine.open_session(image) for image in images]
    turns = [engine.start_turn(s, PROMPTS[0], GREEDY) for s in states]
    batched = 0
    while not all(t.done for t in turns):
        assert not engine.step(turns)
        batched += engine.runner.decoder.stacked  # the decoding turns shared one stacked forward
    for turn in turns:
        engine.finish_turn(turn)
    assert batched > 0
    for image, turn in zip(images, turns, strict=True):
        assert turn.text == reference.answers(image, PROMPTS[:1], TOKENS)[0]


def test_answers_survive_every_memory_tier(family):
    _, engine, reference = family
    image = make_image(60, SIZES[1])
    state = engine.open_session(image)
    got = [answer(engine, state, PROMPTS[0]).text]
    engine.offload(state)
    got.append(answer(engine, state, PROMPTS[1]).text)
    engine.drop_cache(state)  # only the image features are left
    turn = answer(engine, state, PROMPTS[2])
    got.append(turn.text)
    assert turn.found_in.value == "features"
    assert got == reference.answers(image, PROMPTS[:3], TOKENS)


def test_images_added_mid_conversation(family):
    profile, engine, reference = family
    opening, second, third = (make_image(70 + i, size) for i, size in enumerate(SIZES))
    state = engine.open_session(opening)
    if not engine.runner.images.multi_image:
        answer(engine, state, PROMPTS[0])
        with pytest.raises(InvalidRequest, match="one image per conversation") as info:
            engine.start_turn(state, PROMPTS[1], GREEDY, image=second)
        assert info.value.field == "image"
        assert (
            answer(engine, state, PROMPTS[1]).text
            == reference.answers(opening, PROMPTS[:2], TOKENS)[1]
        )
        return
    turns = [
        answer(engine, state, PROMPTS[0]),
        answer(engine, state, PROMPTS[1], image=second),
        answer(engine, state, PROMPTS[2]),
        answer(engine, state, PROMPTS[3], image=third),
    ]
    expected = reference.answers(opening, PROMPTS, TOKENS, added={1: second, 3: third})
    assert [t.text for t in turns] == expected
    assert len(state.images.tokens) == 3
    assert turns[2].cached_tokens > turns[1].cached_tokens  # both pictures stay cached
    if profile == "onevision":  # several images are encoded jointly: recomputed from the first
        assert turns[1].cached_tokens < state.prefix_len
    else:  # encoded alone: appended after what the session had cached
        assert turns[1].cached_tokens > state.prefix_len
    branch = answer(engine, state, "Branch?", history=False)
    assert branch.text == reference.answers(opening, ["Branch?"], TOKENS)[0]
    with pytest.raises(InvalidRequest, match="max_images_per_session"):
        engine.start_turn(state, "One more?", GREEDY, image=second)
    with pytest.raises(InvalidRequest, match="history"):
        engine.start_turn(engine.open_session(opening), "?", GREEDY, image=second, history=False)


def test_an_aborted_turn_leaves_its_added_image_out(family):
    _, engine, reference = family
    if not engine.runner.images.multi_image:
        pytest.skip("single-image family")
    opening, second = make_image(80, SIZES[0]), make_image(81, SIZES[2])
    state = engine.open_session(opening)
    answer(engine, state, PROMPTS[0])
    turn = engine.start_turn(state, PROMPTS[1], GREEDY, image=second)
    engine.step([turn])
    engine.abort_turn(turn)
    assert len(state.images.tokens) == 1
    follow = answer(engine, state, PROMPTS[1])
    assert follow.text == reference.answers(opening, PROMPTS[:2], TOKENS)[1]


def test_an_open_rides_the_forward_of_a_streaming_answer(family):
    # Packed steps: the image's prefill chunks go in the decode's forward; both answers are
    # the pipeline's.
    _, engine, reference = family
    assert engine.runner.packs
    streamed, opened = make_image(90, SIZES[0]), make_image(91, SIZES[2])
    long = GenerationParams(max_new_tokens=48)
    stream = engine.start_turn(engine.open_session(streamed), PROMPTS[0], long)
    while stream.prefilling:
        assert not engine.step([stream])
    state = engine.new_session(engine.prepare(opened))
    opening = engine.start_open(state)
    packed = []
    hook = engine.runner.replicas[0].model.register_forward_hook(
        lambda module, args, kwargs, out: packed.append("packing" in kwargs), with_kwargs=True
    )
    steps = 0
    try:
        while not opening.done:
            assert not engine.step([stream, opening])
            steps += 1
    finally:
        hook.remove()
    assert not stream.done
    assert len(packed) == steps and any(packed)  # one forward a step, the chunks' packed
    engine.finish_turn(opening)
    while not stream.done:
        assert not engine.step([stream])
    engine.finish_turn(stream)
    messages = reference.messages(None, [], PROMPTS[0])
    assert stream.text == reference.answer([streamed], messages, 48)
    assert (
        answer(engine, state, PROMPTS[1]).text == reference.answers(opened, PROMPTS[1:2], TOKENS)[0]
    )
