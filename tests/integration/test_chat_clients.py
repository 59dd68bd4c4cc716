"""Chat clients as their users run them, with no session header, against a real TorchServe.

The official `openai` client sends what Open WebUI, LibreChat and Gradio send: text-only
questions, an image in a message of its own, several text parts, the whole chat again every
turn with its image as base64 each time, and side requests (a title) between turns. LangChain's
`ChatOpenAI` holds a multi-turn chat with an image. The oracle is transformers' own
`apply_chat_template` + processor + `generate` on the same messages; `cached_tokens` shows what
the instance reused of the conversation without being told which session it was.
"""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest
from engine_under_test import least_reused, oracle, reusable
from helpers import Reference, data_uri, make_image

pytestmark = pytest.mark.integration

TOKENS = 8


@pytest.fixture(scope="module")
def reference(tiny_checkpoint) -> Reference:
    return oracle(tiny_checkpoint)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=server.url("/predictions/llava/1.0/v1"), api_key="unused", max_retries=0
    )


def ask(client: openai.OpenAI, messages: list[dict[str, Any]], **kw: Any) -> Any:
    """One chat completion as a chat client sends it: no session header, greedy for the oracle."""
    kw = {"max_tokens": TOKENS, "temperature": 0, **kw}
    return client.chat.completions.create(model="llava", messages=messages, **kw)


def image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


PICTURE = make_image(301, (52, 40))
URL = data_uri(PICTURE)

SHAPES = {
    "text only": [{"role": "user", "content": "Hello! What can you do?"}],
    "a text-only conversation": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi."},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Tell me more."},
    ],
    "the image alone, then the question (Gradio)": [
        {"role": "user", "content": [image_part(URL)]},
        {"role": "user", "content": "What is in this picture?"},
    ],
    "two text parts around the image": [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Look at this:"},
                image_part(URL),
                {"type": "text", "text": "What colors are there?"},
            ],
        }
    ],
    "the image in a later message, after a null assistant content": [
        {"role": "user", "content": "I will send a picture."},
        {"role": "assistant", "content": None},
        {"role": "user", "content": [image_part(URL), {"type": "text", "text": "There."}]},
    ],
}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_every_conversation_the_model_accepts_is_answered_as_the_pipeline_does(
    client, reference, shape
):
    messages = SHAPES[shape]
    completion = ask(client, messages)
    expected = reference.chat_answer(messages, {URL: PICTURE}, TOKENS)
    assert completion.choices[0].message.content == expected


def test_a_second_image_for_a_single_image_model_is_a_400_naming_messages(client):
    other = data_uri(make_image(302))
    messages = [{"role": "user", "content": [image_part(URL), image_part(other), "Compare."]}]
    messages[0]["content"][2] = {"type": "text", "text": "Compare."}
    with pytest.raises(openai.BadRequestError) as info:
        ask(client, messages)
    assert info.value.status_code == 400
    assert info.value.body["field"] == "messages"


def test_open_webui_chat_is_reused_without_a_session_header(client, reference):
    """The whole chat re-sent each turn, its image as base64 every time, a title request
    between turns: each follow-up reuses the earlier turns (cached) and answers as the
    pipeline does; the side request changes nothing of the chat."""
    picture = make_image(303, (61, 37))
    url = data_uri(picture)
    questions = ["What is this?", "Describe the colors.", "Is it big?", "Why?"]
    chat: list[dict[str, Any]] = [{"role": "system", "content": "Answer briefly."}]
    cached, prompts = [], []
    for i, question in enumerate(questions):
        content: Any = [image_part(url), {"type": "text", "text": question}] if i == 0 else question
        chat.append({"role": "user", "content": content})
        completion = ask(client, chat)
        answer = completion.choices[0].message.content
        assert answer == reference.chat_answer(chat, {url: picture}, TOKENS), f"turn {i + 1}"
        cached.append(completion.usage.prompt_tokens_details.cached_tokens)
        prompts.append(completion.usage.prompt_tokens)
        chat.append({"role": "assistant", "content": answer})
        # Open WebUI's title request: the chat so far, quoted as text in one user message.
        quoted = "\n".join(f"{m['role']}: {m['content']}" for m in chat[2:])
        title = ask(client, [{"role": "user", "content": f"Title for this chat:\n{quoted}"}])
        assert title.choices[0].finish_reason in ("stop", "length")
    assert cached[0] == 0  # nothing held yet
    # Each follow-up reuses at least everything up to the previous answer (its prompt, which
    # holds the image's tokens); what re-tokenizes differently is the only part recomputed.
    for turn in range(1, len(questions)):
        assert cached[turn] >= least_reused(prompts[turn - 1]), (turn, cached, prompts)


def test_an_edited_answer_reuses_the_common_prefix_and_leaves_the_chat_as_it_was(client, reference):
    picture = make_image(304, (40, 56))
    url = data_uri(picture)
    chat: list[dict[str, Any]] = [
        {"role": "user", "content": [image_part(url), {"type": "text", "text": "What is it?"}]}
    ]
    first = ask(client, chat).choices[0].message.content
    chat += [{"role": "assistant", "content": first}, {"role": "user", "content": "And then?"}]
    ask(client, chat)  # the chat held: two turns
    edited = [*chat[:1], {"role": "assistant", "content": "Something else."}, chat[2]]
    forked = ask(client, edited)
    assert forked.choices[0].message.content == reference.chat_answer(
        edited, {url: picture}, TOKENS
    )
    # the image's tokens and the first question were reused, not the edited answer
    assert 0 < forked.usage.prompt_tokens_details.cached_tokens < forked.usage.prompt_tokens
    # the original chat goes on from where it was: everything it had is reused
    again = ask(client, chat)
    assert again.usage.prompt_tokens_details.cached_tokens >= len(chat) - 1
    assert again.usage.prompt_tokens_details.cached_tokens == reusable(
        again.usage.prompt_tokens - 1
    )


def test_a_chat_past_the_context_is_a_400_that_names_limit_and_count(client, server):
    words = " ".join(["picture"] * 400)
    chat = [{"role": "user", "content": words}, {"role": "assistant", "content": words}] * 3
    chat.append({"role": "user", "content": "Summarize."})
    with pytest.raises(openai.BadRequestError) as info:
        ask(client, chat)
    error = info.value.body
    assert error["code"] == "context_length_exceeded" and error["field"] == "messages"
    assert error["tokens"] > error["limit"] > 0
    ping = httpx.get(server.url("/ping"), timeout=10)
    assert ping.status_code == 200


def test_langchain_chat_openai_holds_a_chat_with_an_image(server, reference):
    from langchain_core.messages import AIMessage, HumanMessage
    from langchain_openai import ChatOpenAI

    picture = make_image(305, (48, 48))
    url = data_uri(picture)
    llm = ChatOpenAI(
        model="llava",
        base_url=server.url("/predictions/llava/1.0/v1"),
        api_key="unused",
        temperature=0,
        max_tokens=TOKENS,
        max_retries=0,
    )
    history: list[Any] = [
        HumanMessage(content=[{"type": "text", "text": "What is this?"}, image_part(url)])
    ]
    sent: list[dict[str, Any]] = [
        {"role": "user", "content": [{"type": "text", "text": "What is this?"}, image_part(url)]}
    ]
    cached = []
    for question in ["Describe it.", "Anything else?"]:
        reply = llm.invoke(history)
        assert reply.content == reference.chat_answer(sent, {url: picture}, TOKENS)
        cached.append(reply.usage_metadata["input_token_details"].get("cache_read", 0))
        history += [AIMessage(content=reply.content), HumanMessage(content=question)]
        sent += [
            {"role": "assistant", "content": reply.content},
            {"role": "user", "content": question},
        ]
    final = llm.invoke(history)
    assert final.content == reference.chat_answer(sent, {url: picture}, TOKENS)
    assert cached[0] == 0 < cached[1]


@pytest.fixture(scope="module", params=["interleave", "onevision"])
def several(request, family_server):
    """A family trained on several images: Interleave encodes each alone, OneVision together."""
    return family_server(request.param)


def test_a_chat_with_images_in_several_messages_on_a_multi_image_family(several):
    server, reference = several
    client = openai.OpenAI(
        base_url=server.url("/predictions/llava/1.0/v1"), api_key="unused", max_retries=0
    )
    first, second = make_image(307, (50, 40)), make_image(308, (36, 60))
    urls = {data_uri(first): first, data_uri(second): second}
    one, two = list(urls)
    chat: list[dict[str, Any]] = [
        {"role": "user", "content": [image_part(one), {"type": "text", "text": "What is it?"}]}
    ]
    answer = ask(client, chat).choices[0].message.content
    assert answer == reference.chat_answer(chat, urls, TOKENS)
    chat += [
        {"role": "assistant", "content": answer},
        {"role": "user", "content": [{"type": "text", "text": "And this one?"}, image_part(two)]},
    ]
    completion = ask(client, chat)
    assert completion.choices[0].message.content == reference.chat_answer(chat, urls, TOKENS)
    again = ask(client, chat)  # the same two-image chat re-sent: held, nothing to prepare
    assert again.usage.prompt_tokens_details.cached_tokens == reusable(
        again.usage.prompt_tokens - 1
    )


def test_a_chat_with_another_cache_salt_reuses_nothing_held_for_others(client, reference):
    """vLLM's `cache_salt` names a tenant: a header-less chat finds only what was held for
    chats with its own salt, so no tenant learns (by `cached_tokens` or timing) another's."""
    picture = make_image(307, (44, 58))
    url = data_uri(picture)
    chat: list[dict[str, Any]] = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": [image_part(url), {"type": "text", "text": "What is this?"}]},
    ]
    first = ask(client, chat, extra_body={"cache_salt": "tenant-a"})
    chat += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "Describe the colors."},
    ]
    expected = reference.chat_answer(chat, {url: picture}, TOKENS)
    other = ask(client, chat, extra_body={"cache_salt": "tenant-b"})
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    assert other.choices[0].message.content == expected
    unsalted = ask(client, chat)
    assert unsalted.usage.prompt_tokens_details.cached_tokens == 0
    same = ask(client, chat, extra_body={"cache_salt": "tenant-a"})
    assert same.usage.prompt_tokens_details.cached_tokens > 0
    assert same.choices[0].message.content == expected
    for bad in ("", 7, "x" * 257):
        with pytest.raises(openai.BadRequestError) as info:
            ask(client, chat, extra_body={"cache_salt": bad})
        assert info.value.body["field"] == "cache_salt"
