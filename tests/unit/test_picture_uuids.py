"""Pictures named by uuid, below the server: how a chat's parts are read (a uuid beside the
bytes, a uuid alone, what is refused), how a uuid is bound to its bytes per tenant, and how a
session recognises its pictures by uuid (end to end: tests/integration/test_image_handles.py)."""

from __future__ import annotations

from typing import Any

import pytest

from llava.api.openai import HANDLE, chat_info, check_same_chat, parse_chat_completion
from llava.core.errors import InvalidRequest, UnknownImageHandle
from llava.core.params import Limits
from llava.server.image_handles import ImageHandles

URL = "https://example.com/a.png"


def parse(*parts: Any) -> Any:
    body = {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "?"}]}]}
    return parse_chat_completion(body, {}, Limits())


def test_a_uuid_goes_with_its_picture_and_alone_names_one_sent_before() -> None:
    sent = parse({"type": "image_url", "image_url": {"url": URL}, "uuid": "a"})
    assert sent.images == (URL,) and sent.image_uuids == ("a",) and sent.handles == {}
    named = parse({"type": "image_url", "image_url": None, "uuid": "a"})
    assert named.images == (HANDLE + "a",) and named.handles == {0: "a"}
    plain = parse({"type": "image_url", "image_url": {"url": URL}})
    assert plain.image_uuids == () and plain.handles == {}
    for part, words in [
        ({"type": "image_url", "image_url": None}, '"image_url" needs a "url"'),
        ({"type": "image_url", "image_url": {"url": HANDLE + "a"}}, '"image_url" needs'),
        ({"type": "image_url", "image_url": None, "uuid": ""}, "1 to 256 printable"),
        ({"type": "image_url", "image_url": None, "uuid": "x" * 257}, "1 to 256 printable"),
        ({"type": "image_url", "image_url": None, "uuid": 7}, "1 to 256 printable"),
        ({"type": "image_url", "image_url": None, "uuid": "a\nb"}, "1 to 256 printable"),
    ]:
        with pytest.raises(InvalidRequest, match=words):
            parse(part)


def test_a_uuid_is_bound_to_its_bytes_per_tenant_and_forgotten_least_recently_used() -> None:
    handles = ImageHandles(capacity=2)
    handles.bind(None, "a", "d1")
    handles.bind(None, "a", "d1")  # the same bytes again: fine
    handles.bind("tenant-b", "a", "d2")  # another tenant's "a"
    with pytest.raises(InvalidRequest, match="sent before with another picture"):
        handles.bind(None, "a", "d3")
    assert handles.resolve(None, "a") == "d1" and handles.resolve("tenant-b", "a") == "d2"
    handles.bind(None, "b", "d4")  # past capacity: the default tenant's "a", used least recently
    with pytest.raises(UnknownImageHandle, match="send the picture again"):
        handles.resolve(None, "a")
    assert handles.resolve("tenant-b", "a") == "d2"


def test_a_session_knows_its_pictures_by_uuid_and_not_other_bytes_under_it() -> None:
    opened = parse({"type": "image_url", "image_url": {"url": URL}, "uuid": "a"})
    info = chat_info(opened.image_key, None, opened)
    check_same_chat(info, opened)  # sent again whole
    check_same_chat(info, parse({"type": "image_url", "image_url": None, "uuid": "a"}))
    other = parse({"type": "image_url", "image_url": {"url": URL + "?2"}, "uuid": "a"})
    with pytest.raises(InvalidRequest, match="opened with another image"):
        check_same_chat(info, other)
    with pytest.raises(UnknownImageHandle, match="send the picture again"):
        check_same_chat(info, parse({"type": "image_url", "image_url": None, "uuid": "b"}))
    old = {"image_key": opened.image_key, "system_prompt": None}  # a session from before uuids
    with pytest.raises(UnknownImageHandle):
        check_same_chat(old, parse({"type": "image_url", "image_url": None, "uuid": "a"}))
