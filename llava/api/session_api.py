"""The wire protocol: header names, request types and their validation, response bodies.

A request is a JSON object whose `type` picks one of three schemas; the session id travels in
the SageMaker session header (a body `session_id` must agree with it). Parsing either returns a
typed request or raises `InvalidRequest` naming the offending field.

    >>> parse_request(b'{"type": "open_session", "image": "https://x/y.png"}', {})
    OpenSession(image='https://x/y.png', system_prompt=None)
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from llava.core.errors import InvalidRequest, PayloadTooLarge

if TYPE_CHECKING:
    from llava.api.openai import ChatCompletion

# SageMaker's session headers (botocore's sagemaker-runtime model).
SESSION_HEADER = "X-Amzn-SageMaker-Session-Id"
NEW_SESSION_HEADER = "X-Amzn-SageMaker-New-Session-Id"
CLOSED_SESSION_HEADER = "X-Amzn-SageMaker-Closed-Session-Id"
NEW_SESSION = "NEW_SESSION"
SESSION_ID_RE = re.compile(r"^[a-zA-Z0-9](-*[a-zA-Z0-9])*$")
SESSION_ID_MAX_LEN = 256

# SageMaker caps request and response bodies at 6 MiB.
MAX_BODY_BYTES = 6 * 1024 * 1024

STREAM_CONTENT_TYPE = "application/x-ndjson"
JSON_CONTENT_TYPE = "application/json"


@dataclass(frozen=True)
class Limits:
    """Bounds a request must stay within; the engine adds the token limit of prompts."""

    max_body_bytes: int = MAX_BODY_BYTES
    max_prompt_chars: int = 16_000
    max_system_prompt_chars: int = 8_000
    max_new_tokens: int = 1024
    default_max_new_tokens: int = 256


@dataclass(frozen=True)
class GenerationParams:
    """Sampling settings of one answer; temperature 0 means greedy decoding."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()  # the answer ends before the first of these strings

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class OpenSession:
    """Fetch and process one image, keep its state for the session's questions."""

    image: str = field(repr=False)
    system_prompt: str | None = None
    # earlier (question, answer) pairs the session starts with: a conversation carried over
    # from a session that expired or was lost (prefilled with the first question)
    history: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Query:
    """Ask one question in a session; `history=False` branches from the image alone.

    `image` adds a picture to the conversation with this question (multi-image models only).
    `sample_reply` answers in the AWS LLaVA sample's shape too (`response_text`).
    """

    session_id: str
    prompt: str = field(repr=False)
    params: GenerationParams = GenerationParams()
    stream: bool = False
    history: bool = True
    sample_reply: bool = False
    image: str | None = field(default=None, repr=False)


@dataclass(frozen=True)
class Generate:
    """Answer one question about an image without a session: nothing is kept afterwards.

    `history` replays earlier (question, answer) pairs, so a client can hold the conversation
    itself; every request then pays for the whole image and conversation again.
    """

    image: str = field(repr=False)
    prompt: str = field(repr=False)
    system_prompt: str | None = None
    history: tuple[tuple[str, str], ...] = ()
    params: GenerationParams = GenerationParams()
    stream: bool = False


@dataclass(frozen=True)
class CloseSession:
    """Free the session's memory."""

    session_id: str


@dataclass(frozen=True)
class Rollback:
    """Undo the session's last question and answer (to regenerate it, or ask another)."""

    session_id: str


Request = OpenSession | Query | CloseSession | Rollback | Generate


def header(headers: Mapping[str, Any], name: str) -> str | None:
    """Look a header up case-insensitively (HTTP names are not case-sensitive)."""
    wanted = name.lower()
    for key, value in headers.items():
        if str(key).lower() == wanted:
            return value.decode() if isinstance(value, (bytes, bytearray)) else str(value)
    return None


def parse_request(
    body: Any, headers: Mapping[str, Any], limits: Limits = Limits()
) -> Request | ChatCompletion:
    """Validate one request body and its session header into a typed request."""
    # Imported here: the chat-completions dialect builds on this module's types.
    from llava.api.openai import is_chat_completion, parse_chat_completion

    decoded = _decode_body(body, headers, limits)
    if is_chat_completion(decoded):
        return parse_chat_completion(decoded, headers, limits)
    obj, sample_reply = _translate_dialects(decoded)
    kind = obj.get("type")
    if kind is None:
        raise InvalidRequest(
            'missing "type": use "open_session", "query", "rollback", "close_session" or '
            '"generate"',
            field="type",
        )
    parser = _PARSERS.get(kind) if isinstance(kind, str) else None
    if parser is None:
        raise InvalidRequest(
            f'unknown "type" {str(kind)[:40]!r}: use "open_session", "query", "rollback", '
            '"close_session" or "generate"',
            field="type",
        )
    request = parser(obj, _session_id(obj, headers), limits)
    if sample_reply and isinstance(request, Query):
        request = replace(request, sample_reply=True)
    return request


# AWS's containers (LMI, model-hosting-container-standards) open and close with `requestType`.
_REQUEST_TYPES = {"NEW_SESSION": "open_session", "CLOSE": "close_session"}


def _translate_dialects(obj: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """Rewrite AWS's `requestType` bodies and the AWS LLaVA sample's bodies into the kit's own.

    Return the kit's body and whether the answer should carry the sample's `response_text`.

    - `{"requestType": "NEW_SESSION", "image": ...}` opens, `{"requestType": "CLOSE"}` closes;
    - the sample's `{"type": "start_session", "path": URL}` opens,
      `{"type": "send_text_prompt", "prompt_text": ...}` asks (answered with `response_text`);
      its `close_session` is the kit's own.
    """
    if "requestType" in obj:
        kind = obj.get("requestType")
        if "type" in obj:
            raise InvalidRequest('send either "type" or "requestType", not both', field="type")
        if not isinstance(kind, str) or kind not in _REQUEST_TYPES:
            raise InvalidRequest(
                f'unknown "requestType" {str(kind)[:40]!r}: use "NEW_SESSION" or "CLOSE" '
                '(questions use {"type": "query"})',
                field="requestType",
            )
        obj = {k: v for k, v in obj.items() if k != "requestType"}
        obj["type"] = _REQUEST_TYPES[kind]
    elif obj.get("type") == "start_session":
        obj = _renamed(obj, "open_session", "path", "image")
    elif obj.get("type") == "send_text_prompt":
        return _renamed(obj, "query", "prompt_text", "prompt"), True
    return obj, False


def _renamed(obj: dict[str, Any], kind: str, old: str, new: str) -> dict[str, Any]:
    if new in obj:
        raise InvalidRequest(f'"{obj["type"]}" takes "{old}", not "{new}"', field=new)
    if old not in obj:
        raise InvalidRequest(f'"{obj["type"]}" needs "{old}"', field=old)
    out = {(new if k == old else k): v for k, v in obj.items()}
    out["type"] = kind
    return out


def _decode_body(body: Any, headers: Mapping[str, Any], limits: Limits) -> dict[str, Any]:
    """Return the body as a JSON object, whatever the Content-Type (which is not checked).

    The handler asks TorchServe's worker for raw bytes (`TS_DECODE_INPUT_REQUEST=false`), so
    bytes arrive. A worker that decodes anyway passes `application/json` as a dict, list, number
    or string and `text/*` as a string; those are taken too.
    """
    if isinstance(body, dict):
        # Decoded by TorchServe, whose own limit (max_request_size) is above ours: check the
        # length the client declared.
        declared = header(headers, "Content-Length")
        if declared is not None and declared.strip().isdigit():
            _check_size(int(declared), limits)
        return body
    if body is not None and not isinstance(body, (str, bytes, bytearray)):
        raise InvalidRequest("body must be a JSON object", field="body")  # TorchServe decoded it
    if isinstance(body, str) and _media_type(headers) == JSON_CONTENT_TYPE:
        # A JSON string that TorchServe already decoded: do not decode its content again.
        raise InvalidRequest("body must be a JSON object", field="body")
    if isinstance(body, str):
        body = body.encode()
    if not isinstance(body, (bytes, bytearray)) or not body:
        raise InvalidRequest('empty body: send a JSON object with a "type"', field="body")
    _check_size(len(body), limits)
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError) as exc:  # incl. ints over Python's 4300-digit limit
        raise InvalidRequest(f"body is not valid JSON: {str(exc)[:200]}", field="body") from None
    if not isinstance(obj, dict):
        raise InvalidRequest("body must be a JSON object", field="body")
    return obj


def _check_size(size: int, limits: Limits) -> None:
    if size > limits.max_body_bytes:
        raise PayloadTooLarge(
            f"body is {size} bytes, the limit is {limits.max_body_bytes}: "
            "send large images by https or s3:// URL instead of inline base64",
            field="body",
        )


def _media_type(headers: Mapping[str, Any]) -> str:
    value = header(headers, "Content-Type") or ""
    return value.split(";", 1)[0].strip().lower()


def _session_id(obj: Mapping[str, Any], headers: Mapping[str, Any]) -> str | None:
    """Return the session id the request names, or None for a new session."""
    from_header = header(headers, SESSION_HEADER)
    from_header = from_header.strip() if from_header is not None else None
    if from_header in ("", NEW_SESSION):
        from_header = None
    from_body = obj.get("session_id")
    if from_body is not None and not isinstance(from_body, str):
        raise InvalidRequest('"session_id" must be a string', field="session_id")
    if from_header is not None and from_body is not None and from_header != from_body:
        raise InvalidRequest(
            f'body "session_id" does not match the {SESSION_HEADER} header', field="session_id"
        )
    sid = from_header if from_header is not None else from_body
    if sid is not None and not is_valid_session_id(sid):
        raise InvalidRequest(
            "malformed session id: letters, digits and hyphens (not first or last), at most 256 "
            "characters",
            field="session_id",
        )
    return sid


def is_valid_session_id(sid: str) -> bool:
    """Tell whether `sid` matches SageMaker's session id pattern."""
    return len(sid) <= SESSION_ID_MAX_LEN and SESSION_ID_RE.fullmatch(sid) is not None


def _check_fields(obj: Mapping[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(obj) - allowed - {"type", "session_id"})
    if unknown:
        raise InvalidRequest(
            f"unknown field {unknown[0]!r}; allowed: {', '.join(sorted(allowed))}",
            field=unknown[0],
        )


def _text(obj: Mapping[str, Any], name: str, max_chars: int, *, required: bool) -> str | None:
    value = obj.get(name)
    if value is None:
        if required:
            raise InvalidRequest(f'missing "{name}"', field=name)
        return None
    if not isinstance(value, str):
        raise InvalidRequest(f'"{name}" must be a string', field=name)
    if required and not value.strip():
        raise InvalidRequest(f'"{name}" is empty', field=name)
    if len(value) > max_chars:
        raise InvalidRequest(f'"{name}" is longer than {max_chars} characters', field=name)
    return value


def _required(obj: Mapping[str, Any], name: str, max_chars: int) -> str:
    value = _text(obj, name, max_chars, required=True)
    assert value is not None  # required: _text raised otherwise
    return value


def number_field(
    obj: Mapping[str, Any], name: str, default: float, lo: float, hi: float, *, integer: bool
) -> Any:
    value = obj.get(name, default)
    kind = "an integer" if integer else "a number"
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        raise InvalidRequest(f'"{name}" must be {kind}', field=name)
    if not lo <= value <= hi or value != value:
        raise InvalidRequest(f'"{name}" must be between {lo} and {hi}', field=name)
    return value


def flag_field(obj: Mapping[str, Any], name: str, default: bool) -> bool:
    value = obj.get(name, default)
    if not isinstance(value, bool):
        raise InvalidRequest(f'"{name}" must be true or false', field=name)
    return value


def _parse_open(obj: Mapping[str, Any], sid: str | None, limits: Limits) -> OpenSession:
    _check_fields(obj, {"image", "system_prompt", "history"})
    if sid is not None:
        raise InvalidRequest(
            f'"open_session" starts a new session: send {SESSION_HEADER}: {NEW_SESSION} or none',
            field="session_id",
        )
    image = _required(obj, "image", limits.max_body_bytes)
    system_prompt = _text(obj, "system_prompt", limits.max_system_prompt_chars, required=False)
    return OpenSession(image=image, system_prompt=system_prompt, history=_history(obj, limits))


def _require_session(sid: str | None, kind: str) -> str:
    if sid is None:
        raise InvalidRequest(
            f'"{kind}" needs the {SESSION_HEADER} header returned by "open_session"',
            field="session_id",
        )
    return sid


_GENERATION_FIELDS = {"prompt", "max_new_tokens", "temperature", "top_p", "seed", "stream"}
MAX_REPLAYED_TURNS = 64


def _parse_query(obj: Mapping[str, Any], sid: str | None, limits: Limits) -> Query:
    _check_fields(obj, _GENERATION_FIELDS | {"history", "image"})
    sid = _require_session(sid, "query")
    return Query(
        session_id=sid,
        prompt=_required(obj, "prompt", limits.max_prompt_chars),
        params=_params(obj, limits),
        stream=flag_field(obj, "stream", False),
        history=flag_field(obj, "history", True),
        image=_text(obj, "image", limits.max_body_bytes, required=False),
    )


def _parse_generate(obj: Mapping[str, Any], sid: str | None, limits: Limits) -> Generate:
    _check_fields(obj, _GENERATION_FIELDS | {"image", "system_prompt", "history"})
    if sid is not None:
        raise InvalidRequest('"generate" uses no session: send no session id', field="session_id")
    return Generate(
        image=_required(obj, "image", limits.max_body_bytes),
        prompt=_required(obj, "prompt", limits.max_prompt_chars),
        system_prompt=_text(obj, "system_prompt", limits.max_system_prompt_chars, required=False),
        history=_history(obj, limits),
        params=_params(obj, limits),
        stream=flag_field(obj, "stream", False),
    )


def _history(obj: Mapping[str, Any], limits: Limits) -> tuple[tuple[str, str], ...]:
    value = obj.get("history", [])
    problem = '"history" must be a list of [question, answer] string pairs'
    if not isinstance(value, list):
        raise InvalidRequest(problem, field="history")
    if len(value) > MAX_REPLAYED_TURNS:
        raise InvalidRequest(f'"history" has more than {MAX_REPLAYED_TURNS} turns', field="history")
    pairs = []
    for pair in value:
        if not (
            isinstance(pair, list)
            and len(pair) == 2
            and all(isinstance(x, str) and len(x) <= limits.max_prompt_chars for x in pair)
        ):
            raise InvalidRequest(problem, field="history")
        pairs.append((pair[0], pair[1]))
    return tuple(pairs)


def _params(obj: Mapping[str, Any], limits: Limits) -> GenerationParams:
    seed = obj.get("seed")
    if seed is not None:
        seed = number_field(obj, "seed", 0, 0, 2**63 - 1, integer=True)
    return GenerationParams(
        max_new_tokens=number_field(
            obj,
            "max_new_tokens",
            limits.default_max_new_tokens,
            1,
            limits.max_new_tokens,
            integer=True,
        ),
        temperature=float(number_field(obj, "temperature", 0.0, 0.0, 2.0, integer=False)),
        top_p=float(number_field(obj, "top_p", 1.0, 1e-6, 1.0, integer=False)),
        seed=seed,
    )


def _parse_close(obj: Mapping[str, Any], sid: str | None, limits: Limits) -> CloseSession:
    _check_fields(obj, set())
    return CloseSession(session_id=_require_session(sid, "close_session"))


def _parse_rollback(obj: Mapping[str, Any], sid: str | None, limits: Limits) -> Rollback:
    _check_fields(obj, set())
    return Rollback(session_id=_require_session(sid, "rollback"))


_PARSERS: dict[str, Callable[[Mapping[str, Any], str | None, Limits], Request]] = {
    "open_session": _parse_open,
    "query": _parse_query,
    "close_session": _parse_close,
    "rollback": _parse_rollback,
    "generate": _parse_generate,
}


def expires_header(session_id: str, expires_at: float) -> str:
    """Format the `<id>; Expires=<UTC ISO-8601 Z>` value of the new-session header."""
    return f"{session_id}; Expires={iso_utc(expires_at)}"


def iso_utc(ts: float) -> str:
    """Format a POSIX time as `YYYY-MM-DDTHH:MM:SSZ`."""
    return datetime.fromtimestamp(ts, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def stream_line(obj: Mapping[str, Any]) -> bytes:
    """Encode one newline-delimited JSON line of a streamed answer."""
    return (json.dumps(obj, separators=(",", ":"), ensure_ascii=False) + "\n").encode()
