"""OpenAI chat completions through a real TorchServe, driven by the official `openai` client.

The SDK posts to `{base_url}/chat/completions`; TorchServe routes
`/predictions/llava/1.0/v1/chat/completions` to the model (version 1.0), so no adapter is needed.
A conversation re-sent whole each turn with a session header is matched against the session's
cache; answers equal transformers' own pipeline on the same messages.
"""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest
from engine_under_test import least_reused, oracle
from helpers import Reference, data_uri, make_image

from llava.api.headers import NEW_SESSION, NEW_SESSION_HEADER, SESSION_HEADER

pytestmark = pytest.mark.integration

PROMPTS = ["What is this?", "Describe the colors.", "Is it big?", "Why?"]
TOKENS = 10
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def client(front) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=front.url("/predictions/llava/1.0/v1"), api_key="unused", max_retries=0
    )


@pytest.fixture(scope="module")
def reference(tiny_checkpoint) -> Reference:
    return oracle(tiny_checkpoint)


def messages(image_url: str, past: list[tuple[str, str]], prompt: str) -> list[dict[str, Any]]:
    """Write a chat as an OpenAI client does: the image in the first user message."""
    out: list[dict[str, Any]] = [{"role": "system", "content": "Answer briefly."}]
    for i, (question, answer) in enumerate([*past, (prompt, None)]):
        content: Any = question
        if i == 0:
            content = [
                {"type": "image_url", "image_url": {"url": image_url}},
                {"type": "text", "text": question},
            ]
        out.append({"role": "user", "content": content})
        if answer is not None:
            out.append({"role": "assistant", "content": answer})
    return out


def create(client: openai.OpenAI, session: str | None, msgs: list[Any], **kw: Any) -> Any:
    """Send one chat completion; return the raw response (headers) and the parsed one."""
    headers = {SESSION_HEADER: session} if session else {}
    raw = client.chat.completions.with_raw_response.create(
        model="llava", messages=msgs, max_tokens=TOKENS, temperature=0, extra_headers=headers, **kw
    )
    return raw, raw.parse()


def test_a_whole_chat_resent_each_turn_reuses_the_session(client, reference):
    image = make_image(110, (61, 37))
    url = data_uri(image)
    past: list[tuple[str, str]] = []
    sid, cached, asked = NEW_SESSION, [], []
    for prompt in PROMPTS:
        raw, completion = create(client, sid, messages(url, past, prompt))
        if sid == NEW_SESSION:
            sid = raw.headers[NEW_SESSION_HEADER].split(";")[0]
        answer = completion.choices[0].message.content
        assert completion.object == "chat.completion"
        assert completion.choices[0].finish_reason in ("stop", "length")
        usage = completion.usage
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        cached.append(usage.prompt_tokens_details.cached_tokens)
        asked.append(usage.prompt_tokens)
        past.append((prompt, answer))
    expected = reference.answers(image, PROMPTS, TOKENS, "Answer briefly.")
    assert [a for _, a in past] == expected
    for turn in range(1, len(PROMPTS)):  # each turn reuses what the one before was asked
        assert cached[turn] >= least_reused(asked[turn - 1]), (cached, asked)

    # The same chat with no session is a one-shot: same answer, nothing cached.
    _, oneshot = create(client, None, messages(url, past[:3], PROMPTS[3]))
    assert oneshot.choices[0].message.content == expected[3]
    assert oneshot.usage.prompt_tokens_details.cached_tokens == 0

    # An edited earlier answer: the session rolls back to where the chats agree.
    edited = [past[0], (past[1][0], "Red and blue."), past[2]]
    _, diverged = create(client, sid, messages(url, edited, PROMPTS[3]))
    oracle = Reference.messages("Answer briefly.", edited, PROMPTS[3])
    assert diverged.choices[0].message.content == reference.answer([image], oracle, TOKENS)
    assert 0 < diverged.usage.prompt_tokens_details.cached_tokens < cached[3]


def test_streaming_chunks_parse_with_the_sdk(client):
    url = data_uri(make_image(111))
    msgs = messages(url, [], PROMPTS[0])
    _, whole = create(client, None, msgs)
    stream = client.chat.completions.create(
        model="llava",
        messages=msgs,
        max_tokens=TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_stop_strings_end_the_answer_before_them(client):
    url = data_uri(make_image(112))
    msgs = messages(url, [], PROMPTS[1])
    _, whole = create(client, None, msgs)
    text = whole.choices[0].message.content
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip()
    _, cut = create(client, None, msgs, stop=[stop])
    assert cut.choices[0].message.content == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"n": 2}, "n"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"logprobs": True}, "logprobs"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ],
)
def test_unsupported_fields_are_refused_by_name(client, extra, field):
    msgs = messages(data_uri(make_image(113)), [], PROMPTS[0])
    with pytest.raises(openai.BadRequestError) as info:
        create(client, None, msgs, extra_body=extra)
    assert info.value.body["field"] == field


def test_a_chat_about_another_image_is_refused_by_a_session(client):
    raw, _ = create(client, NEW_SESSION, messages(data_uri(make_image(114)), [], PROMPTS[0]))
    sid = raw.headers[NEW_SESSION_HEADER].split(";")[0]
    with pytest.raises(openai.BadRequestError, match="another image"):
        create(client, sid, messages(data_uri(make_image(115)), [], PROMPTS[0]))


def test_the_model_is_discovered_as_open_webui_and_librechat_do(client, front):
    """`GET {base_url}/models` (the SDK's `models.list()`) names the served model; a POST with
    an empty body is still a bad request."""
    listed = client.models.list()
    assert [m.id for m in listed.data] == ["llava"]  # the archive's model name
    assert listed.data[0].object == "model"
    empty = httpx.post(front.url("/predictions/llava"), content=b"", headers=JSON, timeout=30)
    assert empty.status_code == 400 and empty.json()["error"]["field"] == "body"
