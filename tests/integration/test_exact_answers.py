"""A session answers exactly as the model's own transformers pipeline, through a real TorchServe.

The oracle (`helpers.Reference`) renders the whole conversation with `apply_chat_template`,
runs the processor and `generate` from scratch for every turn; it shares no code with the kit.
Every family: LLaVA-1.5 (`tiny`: SentencePiece-style, where tokenizing a turn on its own gives
different ids), Interleave (Qwen2 byte-level BPE, ChatML), NeXT (Mistral's [INST] template, anyres
tiles) and OneVision (Qwen2, anyres_max_9), whose image-token counts vary with the image's size.
Each server has a device budget of about two sessions, so later turns come back from host memory.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from engine_under_test import ON_VLLM, assert_reused
from helpers import Reference, ask, data_uri, make_image, open_session

from llava.fronts.torchserve.launcher import TorchServe

pytestmark = pytest.mark.integration

PROMPTS = ["What is this?", "Describe the colors.", "Is it big?", "Why?"]
TOKENS = 12


# Non-square images of several sizes: anyres families tile each differently.
SIZES = [(61, 37), (30, 90), (80, 64)]


@pytest.fixture(scope="module", params=["tiny", "interleave", "next", "onevision"])
def served(request: pytest.FixtureRequest, family_server: Any) -> tuple[TorchServe, Reference]:
    """A TorchServe serving one profile (conftest.FAMILY_ENV: prefills in chunks cut inside
    image runs, a few sessions' caches on the device), and the oracle on the same checkpoint."""
    return family_server(request.param)


def test_four_turns_equal_the_pipeline_with_and_without_a_system_prompt(served, client):
    server, reference = served
    url = server.url("/predictions/llava")
    for seed, size, system_prompt in [(10, SIZES[0], None), (11, SIZES[1], "Answer briefly.")]:
        image = make_image(seed, size)  # not square: resize, crop and tiling all run
        extra = {"system_prompt": system_prompt} if system_prompt else {}
        sid = open_session(client, url, data_uri(image), **extra)
        bodies = [ask(client, url, sid, p, max_new_tokens=TOKENS) for p in PROMPTS]
        got = [body["text"] for body in bodies]
        assert got == reference.answers(image, PROMPTS, TOKENS, system_prompt)
        assert len(set(got)) > 1  # a degenerate model would prove nothing
        assert bodies[0]["usage"]["cached_tokens"] > 0  # the opening prefilled the image
        for earlier, later in zip(bodies, bodies[1:], strict=False):  # never the image again
            assert_reused(earlier["usage"], later["usage"])


def test_history_false_answers_from_the_image_alone_between_turns(served, client):
    server, reference = served
    url = server.url("/predictions/llava")
    image = make_image(12, (40, 64))
    sid = open_session(client, url, data_uri(image))
    main = [ask(client, url, sid, PROMPTS[0], max_new_tokens=TOKENS)["text"]]
    branches = [ask(client, url, sid, p, max_new_tokens=TOKENS, history=False) for p in PROMPTS]
    main.append(ask(client, url, sid, PROMPTS[1], max_new_tokens=TOKENS)["text"])
    expected = reference.answers(image, PROMPTS, TOKENS, history=False)
    assert [b["text"] for b in branches] == expected
    assert main == reference.answers(image, PROMPTS[:2], TOKENS)
    assert all(b["usage"]["cached_tokens"] > 0 for b in branches)  # the image is reused


def test_usage_counts_every_fed_token_once(served, client):
    """cached + prefilled tokens add up to the whole conversation the pipeline would feed."""
    server, reference = served
    url = server.url("/predictions/llava")
    image = make_image(13)
    sid = open_session(client, url, data_uri(image))
    past: list[tuple[str, str]] = []
    for prompt in PROMPTS[:3]:
        body = ask(client, url, sid, prompt, max_new_tokens=TOKENS)
        messages = reference.messages(None, past, prompt)
        text = reference.processor.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        ids = reference.processor(images=[image], text=text)["input_ids"][0]
        usage = body["usage"]
        assert usage["cached_tokens"] + usage["prefill_tokens"] == len(ids)
        past.append((prompt, body["text"]))


def test_concurrent_sessions_with_different_image_token_counts(served, client):
    """Sessions whose images expand to different token counts decode side by side."""
    server, reference = served
    url = server.url("/predictions/llava")
    images = [make_image(20 + i, size) for i, size in enumerate(SIZES)]
    sids = [open_session(client, url, data_uri(image)) for image in images]

    def converse(sid: str) -> list[dict]:
        return [ask(client, url, sid, p, max_new_tokens=TOKENS) for p in PROMPTS[:3]]

    with ThreadPoolExecutor(len(sids)) as pool:
        results = list(pool.map(converse, sids))
    for image, bodies in zip(images, results, strict=True):
        assert [b["text"] for b in bodies] == reference.answers(image, PROMPTS[:3], TOKENS)
    opening = {b[0]["usage"]["cached_tokens"] + b[0]["usage"]["prefill_tokens"] for b in results}
    if type(reference.processor).__name__ != "LlavaProcessor":
        assert len(opening) > 1  # anyres: the images took different numbers of tokens
    for seed in range(4):  # newer sessions push the first ones past the device budget
        open_session(client, url, data_uri(make_image(30 + seed, SIZES[seed % 3])))
    follow = ask(client, url, sids[0], PROMPTS[3], max_new_tokens=TOKENS)
    if not ON_VLLM:  # vLLM keeps keys and values in its own cache: no tiers of the kit's
        assert follow["usage"]["session_tier"] == "host"
    assert follow["text"] == reference.answers(images[0], PROMPTS, TOKENS)[3]
