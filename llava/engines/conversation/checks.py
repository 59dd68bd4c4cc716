"""What a question must pass before any engine takes it, with the same 400 on either engine."""

from __future__ import annotations

from collections.abc import Sequence

from llava.core.errors import InvalidRequest
from llava.engines.conversation.chat import ChatFormatter
from llava.engines.conversation.incremental import Message


def refuse_placeholder(chat: ChatFormatter, text: str | None, field: str) -> None:
    """Refuse user text holding the image placeholder: images come only as images."""
    token = chat.image_token
    if text and token in text:
        raise InvalidRequest(
            f"{field} contains the model's image placeholder {token!r}; "
            "send images in the image field",
            field=field,
        )


def check_prompt_tokens(chat: ChatFormatter, limit: int, text: str, field: str) -> None:
    """Refuse a question over `max_prompt_tokens` (counted on its own)."""
    tokens = chat.tokens_over(text, limit)
    if tokens is not None:
        raise InvalidRequest(f"prompt is {tokens} tokens, the limit is {limit}", field=field)


def check_chat(chat: ChatFormatter, limit: int, messages: Sequence[Message], held: int) -> str:
    """Check a client's whole chat against a session holding `held` images: no placeholder in
    its texts, its last question within `limit` tokens, as many images as the session; return
    that last question."""
    for message in messages:
        for part in message["content"]:
            if part["type"] == "text":
                refuse_placeholder(chat, part["text"], "messages")
    question = "".join(p["text"] for p in messages[-1]["content"] if p["type"] == "text")
    check_prompt_tokens(chat, limit, question, "messages")
    wanted = images_in(messages)
    if wanted != held:
        raise InvalidRequest(
            f"the messages hold {wanted} image(s), the session {held}", field="messages"
        )
    return question


def images_in(chat: Sequence[Message]) -> int:
    """Count the image parts of a chat."""
    return sum(part["type"] == "image" for message in chat for part in message["content"])


def check_image_count(count: int, multi_image: bool, max_images: int) -> None:
    """Refuse a conversation with more images than the model or the session takes."""
    if count > 1 and not multi_image:
        raise InvalidRequest(
            f"the conversation has {count} images and this model was trained on one per "
            "conversation (LLaVA-OneVision and LLaVA-Interleave take several)",
            field="messages",
        )
    if count > max_images:
        raise InvalidRequest(
            f"the conversation has {count} images, over the limit of {max_images} "
            "(max_images_per_session)",
            field="messages",
        )


def check_added_image(held: int, multi_image: bool, max_images: int, refused: str | None) -> None:
    """Refuse an image added to a conversation holding `held` images where the model, the
    session's limit or the request (`refused`: why, e.g. '"history": false') does not allow it."""
    if not multi_image and held:
        raise InvalidRequest(
            "this model was trained on one image per conversation; open a new session to "
            "ask about another image (LLaVA-OneVision and LLaVA-Interleave take several)",
            field="image",
        )
    if refused:
        raise InvalidRequest(f"an image cannot be added with {refused}", field="image")
    if held >= max_images:
        raise InvalidRequest(
            f"the session holds {max_images} images, the limit (max_images_per_session); "
            "open a new session",
            field="image",
        )


def check_restored_count(count: int, max_images: int) -> None:
    """Refuse a stored session with more pictures than an upload may bring, before any of them
    is decoded: ValueError, that session only."""
    if count > max_images:
        raise ValueError(f"it holds {count} pictures, over max_images_per_session")


def check_restored(sizes: Sequence[tuple[int, int]], max_pixels: int, max_images: int) -> None:
    """Refuse a stored session with more or larger pictures than an upload may bring
    (`image_max_pixels`, `max_images_per_session`): ValueError, that session only."""
    check_restored_count(len(sizes), max_images)
    for width, height in sizes:
        if width * height > max_pixels:
            raise ValueError(f"it holds a {width}x{height} picture, over image_max_pixels")
