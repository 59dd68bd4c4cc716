"""OpenAI chat-completions bodies: what is accepted, what is refused by name, how replies look."""

from __future__ import annotations

import json
from typing import Any

import pytest

from llava.api.dispatch import parse_request
from llava.api.headers import NEW_SESSION, SESSION_HEADER
from llava.api.openai import ChatCompletion, chat_info, check_same_chat, image_key
from llava.api.openai_replies import OpenAIReplies
from llava.core.errors import InvalidRequest
from llava.engines.conversation.text import visible_text

IMAGE = "https://example.com/cat.png"
FIRST = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": IMAGE}},
                                     {"type": "text", "text": "What is this?"}]}  # fmt: skip


def chat(*messages: Any, **fields: Any) -> dict[str, Any]:
    return {"model": "llava", "messages": list(messages or [FIRST]), **fields}


def parsed(body: dict[str, Any], headers: dict[str, str] | None = None) -> ChatCompletion:
    request = parse_request(json.dumps(body).encode(), headers or {})
    assert isinstance(request, ChatCompletion)
    return request


def refused(body: dict[str, Any]) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        parse_request(json.dumps(body).encode(), {})
    return info.value


def test_a_multi_turn_chat_keeps_its_messages_in_the_templates_format() -> None:
    request = parsed(
        chat(
            {"role": "system", "content": "Be brief."},
            FIRST,
            {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]},
            {"role": "user", "content": "What color?"},
            max_tokens=9,
            stop="\n",
        )
    )
    assert request.images == (IMAGE,) and request.system_prompt == "Be brief."
    assert request.chat == (
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]},
        {"role": "user", "content": [{"type": "text", "text": "What color?"}]},
    )
    assert request.prompt == "What color?"
    assert request.params.max_new_tokens == 9 and request.params.stop == ("\n",)
    assert request.params.temperature == 1.0  # OpenAI's default, not the session API's
    assert request.session is None


IMAGE_PART = {"type": "image_url", "image_url": {"url": IMAGE}}


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": "Hello! What can you do?"}],  # text only
        [{"role": "user", "content": [IMAGE_PART]}, {"role": "user", "content": "What is it?"}],
        [{"role": "user", "content": [{"type": "text", "text": "Look:"}, IMAGE_PART,
                                      {"type": "text", "text": "what is it?"}]}],
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None},
         {"role": "user", "content": [IMAGE_PART, {"type": "text", "text": "And this?"}]}],
    ],
)  # fmt: skip
def test_every_conversation_a_chat_client_sends_is_taken_as_sent(messages: list[Any]) -> None:
    """Open WebUI's text-only questions, Gradio's image in a message of its own, several text
    parts, a null assistant content: the parts stay in order, images become placeholders."""
    request = parsed({"model": "llava", "messages": messages})
    assert len(request.chat) == len(messages)
    for sent, kept in zip(messages, request.chat, strict=True):
        content = sent["content"] if isinstance(sent["content"], list) else [sent["content"]]
        kinds = ["image" if isinstance(p, dict) and p["type"] == "image_url" else "text"
                 for p in content]  # fmt: skip
        assert [p["type"] for p in kept["content"]] == kinds
    assert len(request.images) == sum(
        isinstance(p, dict) and p["type"] == "image_url"
        for m in messages if isinstance(m["content"], list) for p in m["content"]
    )  # fmt: skip


def test_the_session_header_decides_one_shot_new_or_continued() -> None:
    assert parsed(chat(), {SESSION_HEADER: NEW_SESSION}).session == NEW_SESSION
    assert parsed(chat(), {SESSION_HEADER: "abc-1"}).session == "abc-1"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (chat(n=3), "n"),
        (chat(tools=[{"type": "function"}]), "tools"),
        (chat(response_format={"type": "json_object"}), "response_format"),
        (chat(frobnicate=1), "frobnicate"),
        (chat(max_tokens=0), "max_tokens"),
        (chat(temperature=3), "temperature"),
        (chat(stop=[""]), "stop"),
        (chat(stream_options={"include_usage": "yes"}), "stream_options"),
        (chat(FIRST, {"role": "assistant", "content": "a"}), "messages"),
        (chat({"role": "tool", "content": "42"}), "messages[0]"),
        (chat(FIRST, {"role": "system", "content": "late"}, FIRST), "messages[1]"),
        (chat({"role": "user", "content": []}), "messages[0]"),
        (chat({"role": "user", "content": [{"type": "input_audio"}]}), "messages[0]"),
        (chat({"role": "assistant", "content": [IMAGE_PART]}, FIRST), "messages[0]"),
        ({"model": "llava", "messages": []}, "messages"),
    ],
)
def test_refusals_name_the_field(body: dict[str, Any], field: str) -> None:
    assert refused(body).field == field


def test_a_session_only_continues_its_own_chat() -> None:
    request = parsed(chat())
    check_same_chat(chat_info(image_key(IMAGE), None), request)
    with pytest.raises(InvalidRequest, match="another image"):
        check_same_chat(chat_info(image_key("https://example.com/dog.png"), None), request)
    with pytest.raises(InvalidRequest, match="system message"):
        check_same_chat(chat_info(image_key(IMAGE), "Be brief."), request)


def test_stream_events_end_with_done_and_usage_when_asked() -> None:
    replies = OpenAIReplies("llava", include_usage=True)
    usage = {"cached_tokens": 5, "prefill_tokens": 3, "generated_tokens": 2}
    events = (replies.chunk("A") + replies.last(" cat", usage, "stop")).decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": "A"}
    assert chunks[1]["choices"][0]["delta"] == {"content": " cat"}
    assert chunks[2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[3]["usage"]["prompt_tokens"] == 8 and chunks[3]["choices"] == []
    assert chunks[3]["usage"]["prompt_tokens_details"] == {"cached_tokens": 5}


@pytest.mark.parametrize(
    ("text", "final", "shown", "stopped"),
    [
        ("Hello wox", False, "Hello wox", False),
        ("Hello wo", False, "Hello ", False),  # "wo" may grow into "world"
        ("Hello wo", True, "Hello wo", False),
        ("Hello world!", False, "Hello ", True),
        ("Hi. END", False, "Hi", True),
    ],
)
def test_stop_strings_cut_the_answer_and_hold_back_a_possible_start(
    text: str, final: bool, shown: str, stopped: bool
) -> None:
    assert visible_text(text, ("world", ". END"), final=final) == (shown, stopped)
