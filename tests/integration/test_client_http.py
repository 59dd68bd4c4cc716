"""The session client straight against a real TorchServe (`SessionClient.for_url`)."""

from __future__ import annotations

import pytest
from engine_under_test import oracle
from helpers import data_uri, make_image

from llava.client import Session, SessionClient
from llava.core.errors import InvalidRequest, SessionClosed, SessionNotFound

pytestmark = pytest.mark.integration

PROMPTS = ["What is in the picture?", "Which colors?"]


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    return oracle(tiny_checkpoint)


@pytest.mark.parametrize("route", ["/predictions/llava", "/invocations"])
def test_ask_stream_close_over_http(server, reference, tmp_path, route):
    png = tmp_path / "photo.png"
    make_image(70).save(png)
    with SessionClient.for_url(server.url(route), timeout=60) as client:
        with client.session(image=png, system_prompt=None) as s:
            first = s.ask(PROMPTS[0], max_new_tokens=8)
            assert first.session_id == s.id and first.usage["generated_tokens"] >= 1
            deltas = list(s.stream(PROMPTS[1], max_new_tokens=8))
            assert len(deltas) >= 1 and s.last_usage["generated_tokens"] >= 1
            expected = reference.answers(make_image(70), PROMPTS, 8)
            assert [first.text, "".join(deltas)] == expected
            assert s.ask(PROMPTS[0], max_new_tokens=8, history=False).text == first.text
            with pytest.raises(InvalidRequest) as info:
                s.ask("")
            assert info.value.field == "prompt" and info.value.response.status == 400
        assert s.closed
        with pytest.raises(SessionClosed):  # refused locally, nothing sent
            s.ask("again?")
        with pytest.raises(SessionClosed):  # the server's answer for the same id
            Session(client, s.id).ask("again?")


def test_unknown_session_and_a_data_uri_image(server, reference):
    with SessionClient.for_url(server.url("/predictions/llava")) as client:
        ghost = Session(client, "0123456789abcdef0123456789abcdef01234567")
        with pytest.raises(SessionNotFound):
            list(ghost.stream("hi"))
        assert ghost.closed  # the server does not know it: nothing to close
        with client.session(image=data_uri(make_image(71))) as s:
            expected = reference.answers(make_image(71), ["ok?"], 2)[0]
            assert s.ask("ok?", max_new_tokens=2).text == expected
