"""The local runtime's prefix-aware routing and bearer tokens, without containers: a chat's
follow-ups go where it went, the threshold and a lost instance move it, the prefix-aware id
keeps apart chats that start alike, and only a token signed with the runtime's credentials
for its region, unexpired, opens the OpenAI path (end to end: tests/integration/
test_prefix_routing.py)."""

from __future__ import annotations

import base64
import io
import json
import re
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace
from typing import Any

import pytest
from helpers import sagemaker_token

from llava.api.headers import SESSION_HEADER
from llava.fronts.local_runtime.bearer import TOKEN_PREFIX, check_bearer
from llava.fronts.local_runtime.errors import Refusal
from llava.fronts.local_runtime.prefix import BLOCK, PrefixAware
from llava.fronts.local_runtime.router import StickyRouter
from llava.fronts.local_runtime.server import LocalRuntime
from llava.fronts.local_runtime.wire import read_body

ROUTING = PrefixAware(prefix_length=1024, concurrency_threshold=2)
PICTURE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}


def chat(*texts: str, picture: dict[str, Any] = PICTURE) -> bytes:
    """An OpenAI chat whose user and assistant messages alternate, a picture in the first."""
    messages: list[dict[str, Any]] = []
    for i, text in enumerate(texts):
        content: Any = [picture, {"type": "text", "text": text}] if i == 0 else text
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": content})
    return json.dumps({"model": "llava", "messages": messages}).encode()


def test_a_chats_chain_is_its_texts_in_blocks_and_a_follow_up_extends_it() -> None:
    first = ROUTING.chain(chat("What is in the picture?"), None, chat=True)
    follow_up = ROUTING.chain(
        chat("What is in the picture?", "A red disc.", "And?"), None, chat=True
    )
    assert len(first) == len("What is in the picture?") // BLOCK
    assert follow_up[: len(first)] == first
    other_picture = {"type": "image_url", "image_url": {"url": "https://example.com/b.png"}}
    assert ROUTING.chain(
        chat("What is in the picture?", picture=other_picture), None, chat=True
    ) == (first)  # pictures are not text
    assert ROUTING.chain(chat("What is in the picture?"), "user-1", chat=True)[0] != first[0]
    body = chat("What is in the picture?")
    assert len(ROUTING.chain(body, None, chat=False)) == min(len(body), 1024) // BLOCK
    assert ROUTING.chain(b"not json", None, chat=True) == []
    with pytest.raises(Refusal, match="between 1 and 64"):
        ROUTING.chain(body, "x" * 65, chat=True)


def test_follow_ups_go_where_the_chat_went_until_its_instance_is_busy_or_gone() -> None:
    router = StickyRouter(2, "llava")
    a = ROUTING.chain(chat("Tell me about the picture, please."), None, chat=True)
    b = ROUTING.chain(chat("Which colours do you see in it?"), None, chat=True)
    first_a, first_b = router.pick_by_prefix(a, 2), router.pick_by_prefix(b, 2)
    assert first_a != first_b  # new prefixes: the least busy (round robin on ties)
    a2 = ROUTING.chain(
        chat("Tell me about the picture, please.", "A disc.", "Big?"), None, chat=True
    )
    for _ in range(5):
        assert router.pick_by_prefix(a2, 2) == first_a
    with router.in_flight(first_a), router.in_flight(first_a):  # at the threshold: elsewhere
        assert router.pick_by_prefix(a2, 2) == first_b
    assert router.pick_by_prefix(a2, 2) == first_b  # ... and it is held there now
    router.down(first_b)
    assert router.pick_by_prefix(a2, 2) == first_a  # its instance is out of rotation


def _retoken(token: str, change: Any) -> str:
    """The token with its presigned URL's query changed."""
    host, _, query = base64.b64decode(token[len(TOKEN_PREFIX) :]).decode().partition("/?")
    return TOKEN_PREFIX + base64.b64encode(f"{host}/?{change(query)}".encode()).decode()


def test_the_openai_path_forwards_no_session_header_and_big_bodies_are_not_read() -> None:
    headers = {"Content-Type": "application/json", SESSION_HEADER: "abc", "Accept": "*/*"}
    handler = SimpleNamespace(headers=headers)
    assert LocalRuntime._forward_headers(handler, False, True) == {  # type: ignore[arg-type]
        "Content-Type": "application/json",
        "Accept": "*/*",
    }
    assert LocalRuntime._forward_headers(handler, False, False)[SESSION_HEADER] == "abc"  # type: ignore[arg-type]
    body = io.BytesIO(b"x" * 100)
    big = SimpleNamespace(headers={"Content-Length": "100"}, rfile=body)
    with pytest.raises(Refusal, match="100 bytes; the limit is 10") as caught:
        read_body(big, 10)  # type: ignore[arg-type]
    assert caught.value.status == 413 and body.tell() == 0


def test_a_bearer_token_opens_the_path_only_when_aws_would_take_it() -> None:
    now = datetime.now(timezone.utc)
    keys = {"test": "test"}
    good = sagemaker_token("test", "test", "us-east-1")
    assert check_bearer(f"Bearer {good}", "us-east-1", keys, now) == "test"
    temporary = sagemaker_token("test", "test", "us-east-1", session="FwoGZXIvYXdzE")
    assert check_bearer(f"Bearer {temporary}", "us-east-1", keys, now) == "test"
    refused = {
        None: (401, "Authorization: Bearer"),
        "Basic dGVzdDp0ZXN0": (401, "Authorization: Bearer"),
        "Bearer sk-123": (403, "does not start with sagemaker-api-key-"),
        "Bearer sagemaker-api-key-@@@": (403, "not base64"),
        f"Bearer {sagemaker_token('test', 'wrong', 'us-east-1')}": (403, "signature"),
        f"Bearer {sagemaker_token('other', 'test', 'us-east-1')}": (403, "signature"),
        f"Bearer {sagemaker_token('test', 'test', 'eu-west-1')}": (403, "made for eu-west-1"),
    }
    for header, (status, words) in refused.items():
        with pytest.raises(Refusal, match=words) as caught:
            check_bearer(header, "us-east-1", keys, now)
        assert caught.value.status == status
    for tampered, words in [
        (lambda url: "Action=Junk&" + url, "repeated"),
        (lambda url: url.replace("&Version=1", ""), "not a SageMaker bearer token"),
        (lambda url: re.sub("Signature=[0-9a-f]+", "Signature=%C3%A9", url), "signature"),
        (lambda url: re.sub(r"Date=\d{8}", "Date=20990101", url), "credential's date"),
    ]:
        with pytest.raises(Refusal, match=words) as caught:
            check_bearer(f"Bearer {_retoken(good, tampered)}", "us-east-1", keys, now)
        assert caught.value.status == 403
    with pytest.raises(Refusal, match="dated in the future"):
        check_bearer(f"Bearer {good}", "us-east-1", keys, now - timedelta(minutes=6))
    short = sagemaker_token("test", "test", "us-east-1", expires=60)
    made = datetime.now(timezone.utc).replace(microsecond=0)  # its X-Amz-Date, to the second
    assert check_bearer(f"Bearer {short}", "us-east-1", keys, made + timedelta(seconds=58))
    with pytest.raises(Refusal, match="expired"):
        check_bearer(f"Bearer {short}", "us-east-1", keys, made + timedelta(seconds=62))
