"""Rolling the last turn back: the regenerated answer is the pipeline's and prefills nothing."""

from __future__ import annotations

import pytest
from helpers import Reference, make_image

from llava.core.config import ServerConfig
from llava.core.errors import InvalidRequest
from llava.core.params import GenerationParams
from llava.engines.transformers import LlavaEngine, Tier

GREEDY = GenerationParams(max_new_tokens=8)
PROMPTS = ["What is this?", "Which colors do you see?", "Is it big?"]


@pytest.fixture(scope="module")
def engine(either_checkpoint) -> LlavaEngine:
    return LlavaEngine.load(either_checkpoint, ServerConfig(device="cpu", step_token_budget=64))


@pytest.fixture(scope="module")
def reference(either_checkpoint) -> Reference:
    return Reference(either_checkpoint)


def ask(engine: LlavaEngine, state, prompt: str, params: GenerationParams = GREEDY):
    return engine.run_to_end(engine.start_turn(state, prompt, params))


def test_regenerating_reuses_the_question_and_answers_as_the_pipeline(engine, reference):
    image = make_image(21)
    state = engine.open_session(image)
    ask(engine, state, PROMPTS[0])
    sampled = GenerationParams(max_new_tokens=8, temperature=1.0, seed=3)
    ask(engine, state, PROMPTS[1], sampled)
    assert engine.rollback(state) == 1
    assert [e.prompt for e in state.history] == PROMPTS[:1]
    again = ask(engine, state, PROMPTS[1])
    assert again.prefill_tokens <= 1  # the question is still cached: only the answer costs
    assert again.text == reference.answers(image, PROMPTS[:2], 8)[1]
    # A different question after a rollback is the pipeline's too.
    assert engine.rollback(state) == 1
    assert (
        ask(engine, state, PROMPTS[2]).text
        == reference.answers(image, [PROMPTS[0], PROMPTS[2]], 8)[1]
    )


def test_rollback_works_in_every_tier(engine, reference):
    image = make_image(22)
    expected = reference.answers(image, PROMPTS[:2], 8)
    for move in (engine.offload, lambda s: (engine.offload(s), engine.drop_cache(s))):
        state = engine.open_session(image)
        ask(engine, state, PROMPTS[0])
        ask(engine, state, "Something else entirely?")
        move(state)
        engine.rollback(state)
        assert state.tier in (Tier.HOST, Tier.FEATURES)
        assert ask(engine, state, PROMPTS[1]).text == expected[1]


def test_nothing_to_roll_back_is_refused(engine):
    state = engine.open_session(make_image(23))
    with pytest.raises(InvalidRequest, match="no answered question"):
        engine.rollback(state)
