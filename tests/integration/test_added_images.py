"""Images added mid-conversation, through a real TorchServe, against transformers' own pipeline.

Interleave encodes each image alone (its features are appended to the session's cache);
OneVision encodes several images together (the session is recomputed from its first image).
A single-image family (LLaVA-1.5) refuses an added image with a 400 and keeps serving the session.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from engine_under_test import assert_reused, oracle
from helpers import Reference, ask, data_uri, make_image, open_session, post

from llava.fronts.torchserve.launcher import TorchServe

pytestmark = pytest.mark.integration

PROMPTS = ["What is this?", "And this one?", "Which is brighter?", "Compare all three."]
TOKENS = 10


@pytest.fixture(scope="module", params=["interleave", "onevision"])
def served(request: pytest.FixtureRequest, family_server: Any) -> tuple[TorchServe, Reference]:
    """A multi-image family's server (its prefills in chunks, added pictures' too)."""
    return family_server(request.param)


def test_added_images_join_the_conversation_without_being_sent_again(served, client):
    server, reference = served
    url = server.url("/predictions/llava")
    opening, second, third = make_image(90, (61, 37)), make_image(91, (30, 90)), make_image(92)
    sid = open_session(client, url, data_uri(opening))
    bodies = [
        ask(client, url, sid, PROMPTS[0], max_new_tokens=TOKENS),
        ask(client, url, sid, PROMPTS[1], max_new_tokens=TOKENS, image=data_uri(second)),
        ask(client, url, sid, PROMPTS[2], max_new_tokens=TOKENS),
        ask(client, url, sid, PROMPTS[3], max_new_tokens=TOKENS, image=data_uri(third)),
    ]
    expected = reference.answers(opening, PROMPTS, TOKENS, added={1: second, 3: third})
    assert [b["text"] for b in bodies] == expected
    # The turn after an added image reuses everything: both pictures stay in the cache.
    assert_reused(bodies[1]["usage"], bodies[2]["usage"])
    branch = ask(client, url, sid, "Only the first?", max_new_tokens=TOKENS, history=False)
    assert branch["text"] == reference.answers(opening, ["Only the first?"], TOKENS)[0]


def test_a_broken_added_image_fails_its_query_alone(served, client):
    server, reference = served
    url = server.url("/predictions/llava")
    opening = make_image(93)
    sid = open_session(client, url, data_uri(opening))
    body = {"type": "query", "prompt": "And this?", "image": "data:image/png;base64,AAAA"}
    r = post(client, url, body, sid)
    assert r.status_code == 400
    assert r.json()["error"]["field"] == "image"
    r = post(client, url, {**body, "image": data_uri(make_image(94)), "history": False}, sid)
    assert r.status_code == 400 and r.json()["error"]["field"] == "image"
    # The session was not changed, nor left busy.
    got = ask(client, url, sid, PROMPTS[0], max_new_tokens=TOKENS)["text"]
    assert got == reference.answers(opening, PROMPTS[:1], TOKENS)[0]


def test_a_single_image_model_refuses_an_added_image(server, tiny_checkpoint):
    url = server.url("/predictions/llava")
    reference = oracle(tiny_checkpoint)
    opening = make_image(95)
    with httpx.Client(timeout=60) as client:
        sid = open_session(client, url, data_uri(opening))
        body = {"type": "query", "prompt": "And this?", "image": data_uri(make_image(96))}
        r = post(client, url, body, sid)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["field"] == "image" and "one image per conversation" in error["message"]
        got = ask(client, url, sid, PROMPTS[0], max_new_tokens=TOKENS)["text"]
    assert got == reference.answers(opening, PROMPTS[:1], TOKENS)[0]
