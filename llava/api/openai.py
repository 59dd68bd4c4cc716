"""OpenAI chat completions: the request a chatbot client sends, and the replies it parses.

A client of this API re-sends the whole conversation every turn. With a session header the kit
matches it against the session's conversation by token prefix (the engine's normal path), so
only the new tokens are prefilled; without one the request is a one-shot answer.

    {"model": "llava", "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://..."}},
                                     {"type": "text", "text": "What is this?"}]}],
     "max_tokens": 64, "stream": true}
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from llava.api.fields import flag_field, number_field
from llava.api.headers import NEW_SESSION, SESSION_HEADER, header
from llava.core.errors import SEND_PICTURE_AGAIN, InvalidRequest, UnknownImageHandle
from llava.core.ids import is_valid_session_id
from llava.core.params import GenerationParams, Limits

MAX_STOP_SEQUENCES = 4
MAX_MESSAGES = 257  # a system prompt and 128 question/answer pairs
MAX_UUID = 256
# How an image sent by its uuid alone is referred to inside the kit (never a URL it fetches).
HANDLE = "llava-image-handle:"
Message = dict[str, Any]  # one message in transformers' chat format

_ACCEPTED = {
    "model",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "n",
    "user",
    "session_id",
    "cache_salt",
}
# Known OpenAI fields the kit does not implement: refused by name rather than ignored.
_UNSUPPORTED = {
    "tools": "tool calls",
    "tool_choice": "tool calls",
    "functions": "function calls",
    "function_call": "function calls",
    "logprobs": "log probabilities",
    "top_logprobs": "log probabilities",
    "logit_bias": "logit biases",
    "response_format": "structured output",
    "presence_penalty": "penalties",
    "frequency_penalty": "penalties",
    "audio": "audio output",
    "modalities": "audio output",
    "prediction": "predicted outputs",
}


@dataclass(frozen=True)
class ListModels:
    """`GET .../v1/models`: what OpenAI clients (Open WebUI, LibreChat) ask to discover models."""


def is_model_listing(body: Any, headers: Mapping[str, Any]) -> bool:
    """Tell a GET (no body, no Content-Type) from a request: TorchServe hides the method and path.

    TorchServe routes `GET /predictions/<model>/<version>/v1/models` to the handler with neither
    method nor path, only an empty body; a POST always carries a body or a Content-Type.
    """
    empty = body is None or (isinstance(body, (bytes, bytearray, str)) and not body)
    return empty and header(headers, "Content-Type") is None


def models_body(model: str, created: int) -> dict[str, Any]:
    """Return OpenAI's model list, naming the one model this endpoint serves."""
    entry = {"id": model, "object": "model", "created": created, "owned_by": "llava-sessions"}
    return {"object": "list", "data": [entry]}


@dataclass(frozen=True)
class ChatCompletion:
    """A chat-completions request: the client's conversation, as its chat template renders it.

    `chat` holds the messages after the system prompt in transformers' chat format: each
    content part is `{"type": "text", "text": ...}` or `{"type": "image"}`, the images being
    `images` in order. It ends with a user message.
    """

    images: tuple[str, ...] = field(repr=False)
    system_prompt: str | None
    chat: tuple[Message, ...] = field(repr=False)
    params: GenerationParams
    stream: bool
    include_usage: bool
    model: str
    session: str | None  # None: no header; NEW_SESSION: open a session; else the session's id
    # vLLM's field: a tenant's own namespace. A header-less chat reuses only what was held for
    # chats with the same salt, so one tenant's chats cannot learn what another's held.
    cache_salt: str | None = None
    # Each image's `uuid` (vLLM's form), None where it has none; an image sent by uuid alone is
    # a handle (`is_handle`) to a picture the instance holds of this conversation.
    image_uuids: tuple[str | None, ...] = ()

    @property
    def handles(self) -> dict[int, str]:
        """The images named by uuid alone: index -> uuid."""
        pairs = enumerate(self.refs_and_uuids)
        return {i: uuid for i, (ref, uuid) in pairs if uuid is not None and is_handle(ref)}

    @property
    def refs_and_uuids(self) -> list[tuple[str, str | None]]:
        uuids = self.image_uuids or (None,) * len(self.images)
        return [(ref, uuid) for ref, uuid in zip(self.images, uuids, strict=True)]

    @property
    def image_key(self) -> str:
        """Identify the image references, to check a session is asked about its own images."""
        return image_key("\n".join(self.images))

    @property
    def prompt(self) -> str:
        """The text of the last user message (the question this request asks)."""
        return message_text(self.chat[-1])


def message_text(message: Message) -> str:
    """Join a message's text parts (what a prompt limit counts)."""
    return "".join(p["text"] for p in message["content"] if p["type"] == "text")


def is_handle(ref: str) -> bool:
    """Whether an image reference names a picture by its uuid alone (no bytes, no URL)."""
    return ref.startswith(HANDLE)


def image_key(ref: str) -> str:
    """Return a digest of an image reference (URL or inline data)."""
    return hashlib.sha256(ref.strip().encode()).hexdigest()


def chat_info(
    key: str, system_prompt: str | None, request: ChatCompletion | None = None
) -> dict[str, Any]:
    """Return what a session keeps of its opening (the image's `image_key`, and each image's
    key and uuid), to recognise its chat when it is re-sent."""
    info: dict[str, Any] = {"image_key": key, "system_prompt": system_prompt}
    if request is not None and any(request.image_uuids):
        info["image_keys"] = [image_key(ref) for ref in request.images]
        info["image_uuids"] = list(request.image_uuids)
    return info


def _same_images(info: Mapping[str, Any], request: ChatCompletion) -> bool:
    """Whether a chat's images are its session's: sent again, or named by the uuid they were
    opened with (a uuid sent with other bytes is another image)."""
    if info.get("image_key") == request.image_key:
        return True
    keys, uuids = info.get("image_keys"), info.get("image_uuids")
    if keys is None or uuids is None or not len(keys) == len(uuids) == len(request.images):
        return False
    return all(
        uuid == uuids[i] if is_handle(ref) else image_key(ref) == keys[i]
        for i, (ref, uuid) in enumerate(request.refs_and_uuids)
    )


def check_same_chat(info: Mapping[str, Any], request: ChatCompletion) -> None:
    """Refuse a chat whose image or system prompt is not the session's own."""
    if not _same_images(info, request):
        if request.handles:
            raise UnknownImageHandle(
                "this session holds no picture by the uuids sent: " + SEND_PICTURE_AGAIN,
                field="messages",
            )
        raise InvalidRequest(
            "this session was opened with another image: re-send the session's own image in the "
            f"first user message, or start a new session ({SESSION_HEADER}: {NEW_SESSION})",
            field="messages",
        )
    if info.get("system_prompt") != request.system_prompt:
        raise InvalidRequest(
            "the system message differs from the one this session was opened with; start a new "
            f"session ({SESSION_HEADER}: {NEW_SESSION}) to change it",
            field="messages",
        )


def is_chat_completion(obj: Mapping[str, Any]) -> bool:
    """Tell an OpenAI chat-completions body from the kit's own requests."""
    return "messages" in obj and "type" not in obj


def parse_chat_completion(
    obj: Mapping[str, Any], headers: Mapping[str, Any], limits: Limits
) -> ChatCompletion:
    """Validate a chat-completions body into the conversation the engine answers."""
    for name in sorted(obj):
        if name in _UNSUPPORTED and obj[name] not in (None, False, 0, [], {}):
            raise InvalidRequest(f'"{name}" ({_UNSUPPORTED[name]}) is not supported', field=name)
        if name not in _ACCEPTED and name not in _UNSUPPORTED:
            raise InvalidRequest(f"unknown field {name!r} for a chat completion", field=name)
    if obj.get("n", 1) != 1:
        raise InvalidRequest('"n" must be 1: one answer per request', field="n")
    system_prompt, chat, images, uuids = _conversation(obj.get("messages"), limits)
    return ChatCompletion(
        images=images,
        system_prompt=system_prompt,
        chat=chat,
        params=_params(obj, limits),
        stream=flag_field(obj, "stream", False),
        include_usage=_include_usage(obj),
        model=_model(obj),
        session=_session(obj, headers),
        cache_salt=_cache_salt(obj),
        image_uuids=uuids if any(uuids) else (),
    )


def _conversation(
    messages: Any, limits: Limits
) -> tuple[str | None, tuple[Message, ...], tuple[str, ...], tuple[str | None, ...]]:
    """Return the system prompt, the other messages in the chat template's format, and the
    image references and their uuids in order.

    Whatever OpenAI accepts is taken: string or list content, several text parts, an image in
    any user message (alone or beside text), consecutive messages of one role, and an assistant
    message whose content is null. Whether the model takes that many images is the engine's
    to say (it knows the model).
    """
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest('"messages" must be a non-empty list', field="messages")
    if len(messages) > MAX_MESSAGES:
        raise InvalidRequest(f'"messages" holds more than {MAX_MESSAGES}', field="messages")
    system_prompt = None
    chat: list[Message] = []
    images: list[str] = []
    uuids: list[str | None] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidRequest(f'{where} must be an object with a "role"', field=where)
        role = message["role"]
        if role not in ("system", "developer", "user", "assistant"):
            raise InvalidRequest(
                f'{where}: role is "system", "developer", "user" or "assistant"', field=where
            )
        content = message.get("content")
        if content is None and role == "assistant":
            content = ""  # OpenAI allows a null assistant content
        parts, refs, named = _content(content, where, limits, images_allowed=role == "user")
        if role in ("system", "developer"):
            if i != 0:
                raise InvalidRequest(f"{where}: a system message comes first", field=where)
            system_prompt = message_text({"content": parts})
            continue
        chat.append({"role": role, "content": parts})
        images += refs
        uuids += named
    if not chat or chat[-1]["role"] != "user":
        raise InvalidRequest("the last message must be the user's", field="messages")
    return system_prompt, tuple(chat), tuple(images), tuple(uuids)


def _content(
    content: Any, where: str, limits: Limits, *, images_allowed: bool
) -> tuple[list[dict[str, str]], list[str], list[str | None]]:
    """Return a message's parts in the chat template's format, its image references, and
    their uuids."""
    if isinstance(content, str):
        raw: list[Any] = [{"type": "text", "text": content}]
    elif isinstance(content, list) and content:
        raw = content
    else:
        raise InvalidRequest(
            f"{where}.content must be a string or a non-empty list of parts", field=where
        )
    parts: list[dict[str, str]] = []
    refs: list[str] = []
    uuids: list[str | None] = []
    for part in raw:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "image_url" and images_allowed:
            uuid = _uuid(part.get("uuid"), where)
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            if url is None and uuid is not None:
                url = HANDLE + uuid  # a picture sent before: resolved by what the instance holds
            elif not isinstance(url, str) or not url.strip() or is_handle(url):
                raise InvalidRequest(
                    f'{where}: "image_url" needs a "url" (or, for a picture sent before with a '
                    '"uuid", null and that "uuid")',
                    field=where,
                )
            parts.append({"type": "image"})
            refs.append(url)
            uuids.append(uuid)
        elif kind == "image_url":
            raise InvalidRequest(f"{where}: only user messages carry images", field=where)
        else:
            raise InvalidRequest(f'{where}: parts are "text" or "image_url"', field=where)
    if sum(len(p.get("text", "")) for p in parts) > limits.max_prompt_chars:
        raise InvalidRequest(f"{where}: longer than {limits.max_prompt_chars} chars", field=where)
    return parts, refs, uuids


def _uuid(value: Any, where: str) -> str | None:
    """An image part's `uuid`: a client's name for a picture, to send it by that name later."""
    if value is None:
        return None
    if not isinstance(value, str) or not 1 <= len(value) <= MAX_UUID or not value.isprintable():
        raise InvalidRequest(
            f'{where}: an image\'s "uuid" is 1 to {MAX_UUID} printable characters', field=where
        )
    return value


def _params(obj: Mapping[str, Any], limits: Limits) -> GenerationParams:
    name = "max_completion_tokens" if "max_completion_tokens" in obj else "max_tokens"
    tokens = limits.default_max_new_tokens
    if obj.get(name) is not None:
        tokens = number_field(obj, name, tokens, 1, limits.max_new_tokens, integer=True)
    seed = obj.get("seed")
    if seed is not None:
        seed = number_field(obj, "seed", 0, 0, 2**63 - 1, integer=True)
    return GenerationParams(
        max_new_tokens=tokens,
        # OpenAI's default temperature is 1, not the session API's 0.
        temperature=float(number_field(obj, "temperature", 1.0, 0.0, 2.0, integer=False)),
        top_p=float(number_field(obj, "top_p", 1.0, 1e-6, 1.0, integer=False)),
        seed=seed,
        stop=_stop(obj.get("stop")),
    )


def _stop(value: Any) -> tuple[str, ...]:
    stops = [value] if isinstance(value, str) else value if value is not None else []
    if (
        not isinstance(stops, list)
        or len(stops) > MAX_STOP_SEQUENCES
        or not all(isinstance(s, str) and s for s in stops)
    ):
        raise InvalidRequest(
            f'"stop" is a string or a list of at most {MAX_STOP_SEQUENCES} non-empty strings',
            field="stop",
        )
    return tuple(stops)


def _include_usage(obj: Mapping[str, Any]) -> bool:
    options = obj.get("stream_options") or {}
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise InvalidRequest('"stream_options" is {"include_usage": bool}', field="stream_options")
    return bool(options.get("include_usage", False))


def _model(obj: Mapping[str, Any]) -> str:
    model = obj.get("model", "llava")
    if not isinstance(model, str) or len(model) > 256:
        raise InvalidRequest('"model" must be a string', field="model")
    return model


def _cache_salt(obj: Mapping[str, Any]) -> str | None:
    salt = obj.get("cache_salt")
    if salt is None:
        return None
    if not isinstance(salt, str) or not 0 < len(salt) <= 256:
        raise InvalidRequest(
            '"cache_salt" must be a non-empty string of at most 256 characters', field="cache_salt"
        )
    return salt


def _session(obj: Mapping[str, Any], headers: Mapping[str, Any]) -> str | None:
    sid = header(headers, SESSION_HEADER)
    sid = sid.strip() if sid is not None else obj.get("session_id")
    if sid is None or sid == "":
        return None
    if not isinstance(sid, str) or not (sid == NEW_SESSION or is_valid_session_id(sid)):
        raise InvalidRequest("malformed session id", field="session_id")
    return sid
