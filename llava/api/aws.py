"""AWS's dialects, translated into the kit's session API: `requestType` and the LLaVA sample."""

from __future__ import annotations

from typing import Any

from llava.core.errors import InvalidRequest

# AWS's containers (LMI, model-hosting-container-standards) open and close with `requestType`.
REQUEST_TYPES = {"NEW_SESSION": "open_session", "CLOSE": "close_session"}


def translate_dialects(obj: dict[str, Any]) -> tuple[dict[str, Any], bool]:
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
        if not isinstance(kind, str) or kind not in REQUEST_TYPES:
            raise InvalidRequest(
                f'unknown "requestType" {str(kind)[:40]!r}: use "NEW_SESSION" or "CLOSE" '
                '(questions use {"type": "query"})',
                field="requestType",
            )
        obj = {k: v for k, v in obj.items() if k != "requestType"}
        obj["type"] = REQUEST_TYPES[kind]
    elif obj.get("type") == "start_session":
        obj = renamed(obj, "open_session", "path", "image")
    elif obj.get("type") == "send_text_prompt":
        return renamed(obj, "query", "prompt_text", "prompt"), True
    return obj, False


def renamed(obj: dict[str, Any], kind: str, old: str, new: str) -> dict[str, Any]:
    if new in obj:
        raise InvalidRequest(f'"{obj["type"]}" takes "{old}", not "{new}"', field=new)
    if old not in obj:
        raise InvalidRequest(f'"{obj["type"]}" needs "{old}"', field=old)
    out = {(new if k == old else k): v for k, v in obj.items()}
    out["type"] = kind
    return out
