"""One entry for every request body: pick its dialect and parse it into a typed request.

The dialects are the kit's session API (`session_api.py`), AWS's `requestType` bodies and the
AWS LLaVA sample's (`aws.py`, translated into the kit's), and OpenAI's chat completions
(`openai.py`). Each dialect module knows only its own shape; this one chooses.

    >>> parse_request(b'{"type": "open_session", "image": "https://x/y.png"}', {})
    OpenSession(image='https://x/y.png', system_prompt=None, history=())
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from llava.api.aws import translate_dialects
from llava.api.body import decode_body
from llava.api.openai import (
    ChatCompletion,
    ListModels,
    is_chat_completion,
    is_model_listing,
    parse_chat_completion,
)
from llava.api.session_api import Query, Request, parse_session_request
from llava.core.params import Limits


def parse_request(
    body: Any, headers: Mapping[str, Any], limits: Limits = Limits()
) -> Request | ChatCompletion | ListModels:
    """Validate one request body and its session header into a typed request."""
    if is_model_listing(body, headers):
        return ListModels()
    decoded = decode_body(body, headers, limits)
    if is_chat_completion(decoded):
        return parse_chat_completion(decoded, headers, limits)
    obj, sample_reply = translate_dialects(decoded)
    request = parse_session_request(obj, headers, limits)
    if sample_reply and isinstance(request, Query):
        request = replace(request, sample_reply=True)
    return request
