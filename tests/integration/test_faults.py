"""Session faults on a real TorchServe: failed opens, a full store, races, a worker that dies.

One TorchServe with room for only two sessions, so that one leaked slot or session shows at
once as a refused open. The worker-death test runs last: it kills the worker on purpose.
"""

from __future__ import annotations

import base64
import io
import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from conftest import assert_no_worker_death, served
from helpers import ask, data_uri, make_image, open_session, post
from PIL import Image

from llava.api.headers import SESSION_HEADER
from llava.fronts.torchserve.launcher import TorchServe

pytestmark = pytest.mark.integration

MAX_SESSIONS = 2


@pytest.fixture(scope="module")
def faults(model_store, tmp_path_factory) -> Iterator[TorchServe]:
    with served(
        model_store,
        tmp_path_factory.mktemp("faults"),
        LLAVA_MAX_SESSIONS=str(MAX_SESSIONS),
        LLAVA_SNAPSHOT_DIR="off",  # sessions die with their worker (test_restart: they don't)
    ) as ts:
        yield ts


def too_many_pixels() -> str:
    buf = io.BytesIO()
    Image.new("1", (8000, 6000)).save(buf, "PNG")  # 48 Mpx: over the 40 Mpx limit, ~6 KB
    return base64.b64encode(buf.getvalue()).decode()


def truncated_png() -> str:
    buf = io.BytesIO()
    make_image(1).save(buf, "PNG")
    return base64.b64encode(buf.getvalue()[:120]).decode()


def failing_opens(port: int) -> list[tuple[str, int, str]]:
    """Open bodies' images that fail at every stage of an open: (image, status, code)."""
    return [
        ("!!!not base64!!!", 400, "invalid_image"),
        (base64.b64encode(b"just some text, no image").decode(), 400, "invalid_image"),
        ("data:text/plain;base64,aGVsbG8=", 400, "invalid_request"),
        (truncated_png(), 400, "invalid_image"),
        (too_many_pixels(), 413, "image_too_large"),
        # Remote references fail in the fetch threads, after the slot was reserved.
        (f"http://127.0.0.1:{port}/ping", 400, "image_url_forbidden"),
        (f"https://127.0.0.1:{port}/ping", 400, "image_url_forbidden"),
        ("https://10.0.0.1/cat.png", 400, "image_url_forbidden"),
        ("https://[fd00:ec2::254]/latest/meta-data/", 400, "image_url_forbidden"),
        ("s3://Not_A_Bucket/key.png", 400, "invalid_request"),
    ]


def test_failed_opens_leave_no_session_and_no_slot_behind(faults, client):
    url = faults.url("/predictions/llava")
    cases = failing_opens(faults.port) * 2

    def attempt(case: tuple[str, int, str], busy_ok: bool = False) -> None:
        image, status, code = case
        with httpx.Client(timeout=60) as c:
            r = post(c, url, {"type": "open_session", "image": image})
        if busy_ok and r.status_code == 429:  # the other attempts hold both slots right now
            assert r.json()["error"]["code"] == "capacity_exceeded"
            return
        assert r.status_code == status, r.text
        error = r.json()["error"]
        assert (error["code"], error["field"]) == (code, "image"), error

    for case in cases:
        attempt(case)
    with ThreadPoolExecutor(8) as pool:  # concurrently: slots are taken and given back at once
        list(pool.map(lambda case: attempt(case, busy_ok=True), cases))

    # Every slot came back: the store's whole capacity opens, and one more is refused.
    sids = [open_session(client, url, data_uri(make_image(i))) for i in range(MAX_SESSIONS)]
    r = post(client, url, {"type": "open_session", "image": data_uri(make_image(9))})
    assert r.status_code == 429, r.text
    error = r.json()["error"]
    assert error["code"] == "capacity_exceeded" and error["retry_after_s"] >= 1
    assert int(r.headers["Retry-After"]) == error["retry_after_s"]
    # A refused open leaks nothing either: closing one session makes room for exactly one.
    assert post(client, url, {"type": "close_session"}, sids.pop()).status_code == 200
    sids.append(open_session(client, url, data_uri(make_image(10))))
    assert (
        post(client, url, {"type": "open_session", "image": data_uri(make_image(11))}).status_code
        == 429
    )
    for sid in sids:
        assert post(client, url, {"type": "close_session"}, sid).status_code == 200
    assert_no_worker_death(faults)


def race(url: str, sid: str, stream: bool, delay: float) -> tuple[httpx.Response, httpx.Response]:
    """Send a query and, `delay` seconds after it, a close of the same session."""
    barrier = threading.Barrier(2)
    body = {"type": "query", "prompt": "Describe it.", "max_new_tokens": 16, "stream": stream}

    def query() -> httpx.Response:
        with httpx.Client(timeout=30) as c:
            barrier.wait()
            return post(c, url, body, sid)

    def close() -> httpx.Response:
        with httpx.Client(timeout=30) as c:
            barrier.wait()
            time.sleep(delay)
            return post(c, url, {"type": "close_session"}, sid)

    with ThreadPoolExecutor(2) as pool:
        q, c = pool.submit(query), pool.submit(close)
        return q.result(timeout=60), c.result(timeout=60)


@pytest.mark.parametrize("stream", [False, True])
def test_a_query_racing_a_close_is_safe(faults, stream):
    """Whichever lands first, no 5xx, no hang, and the session ends up closed."""
    url = faults.url("/predictions/llava")
    rng = random.Random(7)
    for round_ in range(5):
        with httpx.Client(timeout=30) as c:
            sid = open_session(c, url, data_uri(make_image(100 + round_)))
        delay = rng.choice([0.0, 0.01, 0.03, 0.08])
        q_response, c_response = race(url, sid, stream, delay)
        assert c_response.status_code == 200, c_response.text
        if q_response.status_code == 200:
            text = q_response.text.strip().splitlines()[-1]
            assert '"usage"' in text and '"error"' not in text, text
        else:
            assert q_response.status_code == 400, q_response.text
            assert q_response.json()["error"]["code"] == "session_closed"
        with httpx.Client(timeout=30) as c:
            r = post(c, url, {"type": "query", "prompt": "Still there?"}, sid)
        assert r.status_code == 400 and r.json()["error"]["code"] == "session_closed", r.text
    # The closed sessions' slots are free again.
    with httpx.Client(timeout=30) as c:
        sids = [open_session(c, url, data_uri(make_image(i))) for i in range(MAX_SESSIONS)]
        for sid in sids:
            post(c, url, {"type": "close_session"}, sid)
    assert_no_worker_death(faults)


def test_a_dead_workers_sessions_answer_session_lost(faults, client):
    """Without snapshots, kill the worker: its sessions answer 400 session_lost, then new
    sessions work."""
    url = faults.url("/predictions/llava")
    sids = [open_session(client, url, data_uri(make_image(200 + i))) for i in range(2)]
    ask(client, url, sids[0], "What is this?", max_new_tokens=4)
    before = faults.worker()
    assert before["status"] == "READY"

    os.kill(before["pid"], signal.SIGKILL)
    started = time.monotonic()
    now = faults.wait_for_new_worker(before["pid"])
    restart_s = time.monotonic() - started
    print(f"\nworker {before['pid']} killed; worker {now['pid']} ready after {restart_s:.1f} s")

    for sid in sids:
        for body in ({"type": "query", "prompt": "Hello again?"}, {"type": "close_session"}):
            r = post(client, url, body, sid)
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["code"] == "session_lost" and sid in error["message"], error
    # The lost sessions hold no slot in the new worker: its whole capacity opens.
    fresh = [open_session(client, url, data_uri(make_image(210 + i))) for i in range(MAX_SESSIONS)]
    assert ask(client, url, fresh[0], "What is this?", max_new_tokens=4)["usage"]
    for sid in fresh:
        assert post(client, url, {"type": "close_session"}, sid).status_code == 200
    r = post(client, url, {"type": "query", "prompt": "x"}, sids[0], **{SESSION_HEADER: sids[0]})
    assert r.json()["error"]["code"] == "session_lost"  # still known after new traffic
