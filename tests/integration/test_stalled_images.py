"""A stalled image server holds up nothing but its own opens, whatever the URL's spelling.

A server on loopback answers with headers and then one byte a second. Seven opens name it with
the scheme in capitals, after spaces, in mixed case; while they wait, an open session keeps
answering questions, and each of the seven gets `image_fetch_failed` by the image deadline. The
worker never dies, and no slot is left behind.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from conftest import assert_no_worker_death, served
from helpers import ask, data_uri, make_image, open_session, post

from llava.fronts.torchserve.launcher import TorchServe

pytestmark = pytest.mark.integration

DEADLINE_S = 3.0
MAX_SESSIONS = 8  # the seven stalled opens hold a slot each while they wait
SPELLINGS = [
    "HTTP://{host}/a.png",
    "  http://{host}/b.png",
    "Http://{host}/c.png",
    "\thttp://{host}/d.png",
    "hTTp://{host}/e.png",
    "HTTP://{host}/f.png ",
    "http://{host}/g.png",
]


class Dripping(BaseHTTPRequestHandler):
    """Promise a large PNG, then send one byte a second until the client goes."""

    stop = threading.Event()

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", "100000")
        self.end_headers()
        while not self.stop.wait(1.0):
            try:
                self.wfile.write(b"\x89")
                self.wfile.flush()
            except OSError:  # the kit gave up on us: the point of the test
                return

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def dripping() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Dripping)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        Dripping.stop.set()
        server.shutdown()


@pytest.fixture(scope="module")
def stalled(model_store, tmp_path_factory) -> Iterator[TorchServe]:
    with served(
        model_store,
        tmp_path_factory.mktemp("stalled"),
        LLAVA_MAX_SESSIONS=str(MAX_SESSIONS),
        LLAVA_IMAGE_ALLOW_HTTP="true",
        LLAVA_IMAGE_ALLOW_HOSTS="127.0.0.1",
        LLAVA_IMAGE_TIMEOUT_S=str(DEADLINE_S),
    ) as ts:
        yield ts


def test_stalled_images_fail_by_their_deadline_and_hold_up_no_one(stalled, dripping) -> None:
    url = stalled.url("/predictions/llava")
    with httpx.Client(timeout=60) as client:
        sid = open_session(client, url, data_uri(make_image(1)))

        def open_stalled(ref: str) -> tuple[int, dict, float]:
            with httpx.Client(timeout=60) as own:
                began = time.monotonic()
                r = post(own, url, {"type": "open_session", "image": ref})
                return r.status_code, r.json(), time.monotonic() - began

        refs = [spelling.format(host=dripping) for spelling in SPELLINGS]
        with ThreadPoolExecutor(len(refs)) as pool:
            futures = [pool.submit(open_stalled, ref) for ref in refs]
            answered = []  # questions answered while the stalled opens wait
            while not all(f.done() for f in futures):
                began = time.monotonic()
                ask(client, url, sid, "What is this?", max_new_tokens=4)
                answered.append(time.monotonic() - began)
            results = [f.result() for f in futures]

        for ref, (status, body, took) in zip(refs, results, strict=True):
            assert status == 400, (ref, body)
            assert body["error"]["code"] == "image_fetch_failed", (ref, body)
            assert body["error"]["field"] == "image"
            assert took < DEADLINE_S + 5, (ref, took)  # by its deadline, not TorchServe's
        assert len(answered) >= 3, answered  # the session kept answering the whole time
        assert max(answered) < DEADLINE_S, answered  # no question waited for the stalled images

        # Every slot came back: as many sessions open now as the store holds.
        opened = [open_session(client, url, data_uri(make_image(i))) for i in range(2, 9)]
        assert len(set(opened)) == MAX_SESSIONS - 1
        assert ask(client, url, sid, "Still there?", max_new_tokens=4)["session_id"] == sid
    assert_no_worker_death(stalled)
