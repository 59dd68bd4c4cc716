"""The kit's own session API: request types picked by `type`, and their validation.

A request is a JSON object whose `type` picks one of five schemas; the session id travels in
the SageMaker session header (a body `session_id` must agree with it). Parsing either returns a
typed request or raises `InvalidRequest` naming the offending field. `dispatch.py` picks this
dialect or OpenAI's for a body.

    >>> parse_session_request({"type": "open_session", "image": "https://x/y.png"}, {})
    OpenSession(image='https://x/y.png', system_prompt=None, history=())
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from llava.api.fields import check_fields, flag_field, number_field, required_text, text_field
from llava.api.headers import NEW_SESSION, SESSION_HEADER, session_id_from
from llava.core.errors import InvalidRequest
from llava.core.ids import is_valid_session_id
from llava.core.params import GenerationParams, Limits


@dataclass(frozen=True)
class OpenSession:
    """Fetch and process one image (or none), keep its state for the session's questions."""

    image: str | None = field(repr=False)
    system_prompt: str | None = None
    # earlier (question, answer) pairs the session starts with: a conversation carried over
    # from a session that expired or was lost (prefilled with the first question)
    history: tuple[tuple[str, str], ...] = ()
    # the id of a session to resume from the shared store (its instance went away), kept
    resume: str | None = None


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

    image: str | None = field(repr=False)
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


def _parse_open(obj: Mapping[str, Any], sid: str | None, limits: Limits) -> OpenSession:
    check_fields(obj, {"image", "system_prompt", "history", "resume"})
    resume = obj.get("resume")
    if resume is not None:
        if not isinstance(resume, str) or not is_valid_session_id(resume):
            raise InvalidRequest('"resume" must be a session id', field="resume")
        if set(obj) & {"image", "system_prompt", "history"}:
            raise InvalidRequest(
                '"resume" carries on a stored session as it was: send no image, system_prompt '
                "or history with it",
                field="resume",
            )
    if sid is not None:
        raise InvalidRequest(
            f'"open_session" starts a new session: send {SESSION_HEADER}: {NEW_SESSION} or none',
            field="session_id",
        )
    image = _image(obj, limits)
    system_prompt = text_field(obj, "system_prompt", limits.max_system_prompt_chars, required=False)
    return OpenSession(
        image=image, system_prompt=system_prompt, history=_history(obj, limits), resume=resume
    )


def _image(obj: Mapping[str, Any], limits: Limits) -> str | None:
    """An optional image reference (a session or an answer may be text-only); never empty."""
    image = text_field(obj, "image", limits.max_body_bytes, required=False)
    if image is not None and not image.strip():
        raise InvalidRequest(
            '"image" is empty: leave it out for a text-only conversation', field="image"
        )
    return image


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
    check_fields(obj, _GENERATION_FIELDS | {"history", "image"})
    sid = _require_session(sid, "query")
    return Query(
        session_id=sid,
        prompt=required_text(obj, "prompt", limits.max_prompt_chars),
        params=_params(obj, limits),
        stream=flag_field(obj, "stream", False),
        history=flag_field(obj, "history", True),
        image=text_field(obj, "image", limits.max_body_bytes, required=False),
    )


def _parse_generate(obj: Mapping[str, Any], sid: str | None, limits: Limits) -> Generate:
    check_fields(obj, _GENERATION_FIELDS | {"image", "system_prompt", "history"})
    if sid is not None:
        raise InvalidRequest('"generate" uses no session: send no session id', field="session_id")
    return Generate(
        image=_image(obj, limits),
        prompt=required_text(obj, "prompt", limits.max_prompt_chars),
        system_prompt=text_field(
            obj, "system_prompt", limits.max_system_prompt_chars, required=False
        ),
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
    check_fields(obj, set())
    return CloseSession(session_id=_require_session(sid, "close_session"))


def _parse_rollback(obj: Mapping[str, Any], sid: str | None, limits: Limits) -> Rollback:
    check_fields(obj, set())
    return Rollback(session_id=_require_session(sid, "rollback"))


_PARSERS: dict[str, Callable[[Mapping[str, Any], str | None, Limits], Request]] = {
    "open_session": _parse_open,
    "query": _parse_query,
    "close_session": _parse_close,
    "rollback": _parse_rollback,
    "generate": _parse_generate,
}


def parse_session_request(
    obj: Mapping[str, Any], headers: Mapping[str, Any], limits: Limits = Limits()
) -> Request:
    """Validate a body of the kit's session API (already a JSON object) into a typed request."""
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
    return parser(obj, session_id_from(obj, headers), limits)
