"""Pictures sent once and named by their uuid afterwards (vLLM's form: `{"type": "image_url",
"image_url": null, "uuid": ...}`), through a real TorchServe with the openai SDK: answers equal
the pipeline's either way, at a fraction of the bytes; a uuid reused with other bytes, unknown,
another tenant's, or in a chat that does not carry on the held conversation is a 400 that says
to send the picture again, and nothing held changes."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from engine_under_test import least_reused, oracle
from helpers import data_uri, make_image

from llava.api.headers import NEW_SESSION, NEW_SESSION_HEADER, SESSION_HEADER

pytestmark = pytest.mark.integration

TOKENS = 8
QUESTIONS = ["What is in the picture?", "Which colours?", "Anything else?"]


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    return oracle(tiny_checkpoint)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=server.url("/predictions/llava/1.0/v1"), api_key="unused", max_retries=0
    )


def picture_part(url: str | None, uuid: str | None) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "image_url", "image_url": {"url": url} if url else None}
    if uuid is not None:
        part["uuid"] = uuid
    return part


def chat(first: dict[str, Any], past: list[tuple[str, str]], question: str) -> list[Any]:
    out: list[Any] = []
    for i, (asked, answer) in enumerate([*past, (question, "")]):
        content: Any = [first, {"type": "text", "text": asked}] if i == 0 else asked
        out.append({"role": "user", "content": content})
        if answer:
            out.append({"role": "assistant", "content": answer})
    return out


def converse(client: openai.OpenAI, url: str, uuid: str | None, **extra: Any) -> dict[str, Any]:
    """Three turns, the picture's bytes in the first; later turns name it by `uuid` if given."""
    past: list[tuple[str, str]] = []
    sizes, cached, asked = [], [], []
    for turn, question in enumerate(QUESTIONS):
        first = picture_part(url if turn == 0 or uuid is None else None, uuid)
        messages = chat(first, past, question)
        sizes.append(len(json.dumps({"messages": messages})))
        reply = client.chat.completions.create(
            model="llava", messages=messages, max_tokens=TOKENS, temperature=0, **extra
        )
        usage = reply.usage
        assert usage is not None and usage.prompt_tokens_details is not None
        cached.append(usage.prompt_tokens_details.cached_tokens or 0)
        asked.append(usage.prompt_tokens)
        past.append((question, reply.choices[0].message.content or ""))
    return {"answers": [a for _, a in past], "sizes": sizes, "cached": cached, "asked": asked}


def test_a_picture_named_by_its_uuid_is_answered_as_if_sent_again(client, reference):
    picture = make_image(501, (320, 240))
    named = converse(client, data_uri(picture), "photo-501")
    again = converse(client, data_uri(make_image(502, (320, 240))), None)
    expected = reference.answers(picture, QUESTIONS, TOKENS)
    assert named["answers"] == expected
    for turn in (1, 2):
        assert named["cached"][turn] >= least_reused(named["asked"][turn - 1])
    per_follow_up = sum(named["sizes"][1:]) / 2, sum(again["sizes"][1:]) / 2
    print(f"bytes per follow-up: {per_follow_up[0]:.0f} named, {per_follow_up[1]:.0f} re-sent")
    assert per_follow_up[0] * 20 < per_follow_up[1]


def test_a_uuid_is_bound_to_its_bytes_and_only_the_callers_chat_resolves_it(client, reference):
    picture, other = make_image(511, (64, 48)), make_image(512, (64, 48))
    opened = client.chat.completions.create(
        model="llava",
        messages=chat(picture_part(data_uri(picture), "pic-511"), [], QUESTIONS[0]),
        max_tokens=TOKENS,
        temperature=0,
    )
    answer = opened.choices[0].message.content or ""
    refusals = {
        "reused with other bytes": (
            chat(picture_part(data_uri(other), "pic-511"), [(QUESTIONS[0], answer)], "And?"),
            {},
            "sent before with another picture",
        ),
        "unknown": (
            chat(picture_part(None, "never-sent"), [(QUESTIONS[0], answer)], "And?"),
            {},
            "send the picture again",
        ),
        "another tenant's": (
            chat(picture_part(None, "pic-511"), [(QUESTIONS[0], answer)], "And?"),
            {"extra_body": {"cache_salt": "tenant-b"}},
            "send the picture again",
        ),
        "in a chat that asked otherwise": (
            chat(picture_part(None, "pic-511"), [("Is it a photo?", answer)], "And?"),
            {},
            "send the picture again",
        ),
        "by a caller who does not hold the answer it was given": (
            chat(picture_part(None, "pic-511"), [(QUESTIONS[0], "A cat.")], "And?"),
            {},
            "send the picture again",
        ),
        "opening a session": (
            chat(picture_part(None, "pic-511"), [], QUESTIONS[0]),
            {"extra_headers": {SESSION_HEADER: NEW_SESSION}},
            "opens with its pictures' bytes",
        ),
    }
    for case, (messages, extra, words) in refusals.items():
        with pytest.raises(openai.BadRequestError, match=words) as refused:
            client.chat.completions.create(
                model="llava", messages=messages, max_tokens=TOKENS, temperature=0, **extra
            )
        body: Any = refused.value.body
        assert body["field"] == "messages", case
        if words == "send the picture again":
            assert body["code"] == "unknown_image_handle", case
    follow_up = chat(picture_part(None, "pic-511"), [(QUESTIONS[0], answer)], QUESTIONS[1])
    reply = client.chat.completions.create(
        model="llava", messages=follow_up, max_tokens=TOKENS, temperature=0
    )  # the held conversation is as it was: answered about its own picture
    assert [answer, reply.choices[0].message.content] == reference.answers(
        picture, QUESTIONS[:2], TOKENS
    )


def test_a_session_takes_its_pictures_uuid_in_place_of_its_bytes(client, reference):
    picture = make_image(521, (64, 48))
    first = chat(picture_part(data_uri(picture), "pic-521"), [], QUESTIONS[0])
    raw = client.chat.completions.with_raw_response.create(
        model="llava",
        messages=first,
        max_tokens=TOKENS,
        temperature=0,
        extra_headers={SESSION_HEADER: NEW_SESSION},
    )
    session = raw.headers[NEW_SESSION_HEADER].split(";")[0]
    answer = raw.parse().choices[0].message.content or ""
    headers = {SESSION_HEADER: session}
    other = chat(picture_part(data_uri(make_image(522)), "pic-521"), [(QUESTIONS[0], answer)], "?")
    with pytest.raises(openai.BadRequestError, match="opened with another image"):
        client.chat.completions.create(
            model="llava", messages=other, max_tokens=TOKENS, extra_headers=headers
        )
    stranger = chat(picture_part(None, "pic-999"), [(QUESTIONS[0], answer)], "?")
    with pytest.raises(openai.BadRequestError, match="send the picture again"):
        client.chat.completions.create(
            model="llava", messages=stranger, max_tokens=TOKENS, extra_headers=headers
        )
    named = chat(picture_part(None, "pic-521"), [(QUESTIONS[0], answer)], QUESTIONS[1])
    reply = client.chat.completions.create(
        model="llava", messages=named, max_tokens=TOKENS, temperature=0, extra_headers=headers
    )
    assert [answer, reply.choices[0].message.content] == reference.answers(
        picture, QUESTIONS[:2], TOKENS
    )
