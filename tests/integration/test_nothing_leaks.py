"""On a real TorchServe: request content never reaches a log, requests never reach management."""

from __future__ import annotations

import base64
import io
import json

import httpx
import pytest
from helpers import make_image, open_session, post

from llava.api.headers import SESSION_HEADER
from llava.fronts.torchserve.launcher import TorchServe

pytestmark = pytest.mark.integration

ROUTE = "/predictions/llava"
PROMPT = "Quizzical-marmoset-4417 asks about the ochre lighthouse?"
SYSTEM = "Answer like Zanzibar-heron-9023."
HISTORY = ("Earlier-question-pelican-7702?", "Earlier-answer-walrus-3318.")
SECRET_PATH = "private-bucket-8821/secret-scan.png"
SECRET_QUERY = "token=sig-55c0ffee"


def image_payload() -> str:
    buf = io.BytesIO()
    make_image(4417, (32, 32)).save(buf, "PNG")
    return base64.b64encode(buf.getvalue()).decode()


def all_logs(ts: TorchServe) -> str:
    files = [p for p in ts.log_dir.rglob("*") if p.is_file()]
    files += [ts.workdir / "torchserve.out"]
    assert any(p.name == "model_log.log" for p in files)
    return "\n".join(p.read_text(errors="replace") for p in files if p.exists())


def test_prompts_images_and_urls_are_never_logged(server) -> None:
    url = server.url(ROUTE)
    payload = image_payload()
    with httpx.Client(timeout=60) as client:
        sid = open_session(client, url, f"data:image/png;base64,{payload}", system_prompt=SYSTEM)
        for extra in ({}, {"stream": True}, {"history": False}):
            body = {"type": "query", "prompt": PROMPT, "max_new_tokens": 3, **extra}
            assert post(client, url, body, sid).status_code == 200
        # Failures too: their messages go to the client, not to a log.
        failures = [
            ({"type": "query", "prompt": PROMPT + " word" * 3000}, sid),  # over the token limit
            ({"type": "query", "prompt": PROMPT, "temperature": 9}, sid),
            (
                {"type": "open_session", "image": f"https://10.0.0.1/{SECRET_PATH}?{SECRET_QUERY}"},
                None,
            ),
            ({"type": "open_session", "image": f"http://127.0.0.1:9/{SECRET_PATH}"}, None),
            ({"type": "open_session", "image": payload[:200]}, None),  # truncated: undecodable
            ({"type": "query", "prompt": PROMPT, "bogus": PROMPT}, sid),
        ]
        for body, session in failures:
            assert 400 <= post(client, url, body, session).status_code < 500
        r = post(
            client,
            url,
            {
                "type": "generate",
                "image": payload,  # bare base64
                "prompt": PROMPT,
                "system_prompt": SYSTEM,
                "history": [list(HISTORY)],
                "max_new_tokens": 3,
            },
        )
        assert r.status_code == 200, r.text
        assert post(client, url, {"type": "close_session"}, sid).status_code == 200

    logs = all_logs(server)
    assert "llava handler ready" in logs  # the kit's INFO lines are there to be searched
    secrets = [
        PROMPT,
        "Quizzical-marmoset",
        "Zanzibar-heron",
        "pelican-7702",
        "walrus-3318",
        SECRET_PATH,
        SECRET_QUERY,
        "10.0.0.1",
        payload[100:140],  # any stretch of the image's base64
        payload[-40:],
    ]
    leaked = [s for s in secrets if s in logs]
    assert not leaked, f"request content in TorchServe's logs: {leaked}"


def describe(ts: TorchServe) -> dict:
    r = httpx.get(f"http://127.0.0.1:{ts.management_port}/models/{ts.model}", timeout=10)
    r.raise_for_status()
    [model] = r.json()
    return model


def test_nothing_a_request_sends_changes_the_model_config(server) -> None:
    keys = ("minWorkers", "maxWorkers", "batchSize", "maxBatchDelay", "responseTimeout")
    before = describe(server)
    url = server.url(ROUTE)
    settings = {"minWorkers": "8", "maxWorkers": "8", "batchSize": "64", "min_worker": "8"}
    with httpx.Client(timeout=60) as client:
        sid = open_session(client, url, "data:image/png;base64," + image_payload())
        for name, value in settings.items():
            # As a body field: refused, naming it.
            r = post(client, url, {"type": "query", "prompt": "Hi?", name: value}, sid)
            assert r.status_code == 400 and r.json()["error"]["field"] == name, r.text
            # As a header: ignored.
            body = {"type": "query", "prompt": "Hi?", "max_new_tokens": 1}
            r = client.post(
                url,
                content=json.dumps(body),
                headers={"Content-Type": "application/json", SESSION_HEADER: sid, name: value},
            )
            assert r.status_code == 200, r.text
        post(client, url, {"type": "close_session"}, sid)
    after = describe(server)
    assert {k: after[k] for k in keys} == {k: before[k] for k in keys}
    assert [w["pid"] for w in after["workers"]] == [w["pid"] for w in before["workers"]]
