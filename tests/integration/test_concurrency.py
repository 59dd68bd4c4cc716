"""Many sessions and requests at once through one worker's continuous batching."""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from conftest import assert_no_worker_death, start_server
from engine_under_test import oracle
from helpers import ask, data_uri, make_image, open_session, post

from llava.api.headers import SESSION_HEADER

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    return oracle(tiny_checkpoint)


def test_interleaved_sessions_each_keep_their_own_conversation(server, reference):
    url = server.url("/predictions/llava")
    prompts = ["What is this?", "Which colors?", "Anything else?"]
    seeds = list(range(20, 26))

    def converse(seed: int) -> list[str]:
        with httpx.Client(timeout=120) as client:
            sid = open_session(client, url, data_uri(make_image(seed)))
            answers = []
            for prompt in prompts:
                answers.append(ask(client, url, sid, prompt, max_new_tokens=10)["text"])
            post(client, url, {"type": "close_session"}, sid)
            return answers

    with ThreadPoolExecutor(len(seeds)) as pool:
        results = dict(zip(seeds, pool.map(converse, seeds), strict=True))
    for seed, answers in results.items():
        assert answers == reference.answers(make_image(seed), prompts, 10), f"session {seed}"
    assert len({tuple(a) for a in results.values()}) == len(seeds)


def test_a_short_answer_is_not_blocked_by_a_long_one(server):
    url = server.url("/predictions/llava")
    with httpx.Client(timeout=120) as client:
        long_sid = open_session(client, url, data_uri(make_image(30)))
        short_sid = open_session(client, url, data_uri(make_image(31)))
    finished: dict[str, float] = {}
    long_started = threading.Event()

    def run_long() -> dict:
        # Streamed, so the short question is sent once the long answer is being generated.
        # A very high temperature makes an early end-of-sequence unlikely.
        body = {"type": "query", "prompt": "Go on.", "max_new_tokens": 400, "stream": True}
        body |= {"temperature": 2.0, "seed": 7}
        with (
            httpx.Client(timeout=120) as client,
            client.stream("POST", url, json=body, headers={SESSION_HEADER: long_sid}) as r,
        ):
            lines = []
            for line in r.iter_lines():
                if line:
                    lines.append(json.loads(line))
                    long_started.set()
        finished["long"] = time.perf_counter()
        return lines[-1]

    def run_short() -> dict:
        assert long_started.wait(60)
        with httpx.Client(timeout=120) as client:
            body = ask(client, url, short_sid, "Go on.", max_new_tokens=3, temperature=2.0, seed=7)
        finished["short"] = time.perf_counter()
        return body

    with ThreadPoolExecutor(2) as pool:
        long, short = pool.submit(run_long), pool.submit(run_short)
        long_last, short_body = long.result(), short.result()
    assert short_body["usage"]["generated_tokens"] <= 3
    assert long_last["usage"]["generated_tokens"] > 50, long_last["usage"]
    assert finished["short"] < finished["long"]


def test_one_batch_mixing_good_and_bad_requests(server):
    url = server.url("/predictions/llava")
    with httpx.Client(timeout=60) as client:
        sids = [open_session(client, url, data_uri(make_image(40 + i))) for i in range(4)]
    requests = []
    for i, sid in enumerate(sids):
        requests.append(
            ("good", {"type": "query", "prompt": f"Question {i}?", "max_new_tokens": 6}, sid)
        )
        requests.append(("bad", {"type": "query", "prompt": "", "max_new_tokens": 6}, sid))
        requests.append(("bad", {"type": "query", "prompt": "x", "top_p": 7}, "f" * 40))
        requests.append(("unknown", {"type": "query", "prompt": "x"}, "a" * 40))
    barrier = threading.Barrier(len(requests))

    def send(item):
        kind, body, sid = item
        with httpx.Client(timeout=60) as client:
            barrier.wait()
            return kind, post(client, url, body, sid)

    with ThreadPoolExecutor(len(requests)) as pool:
        results = list(pool.map(send, requests))
    for kind, response in results:
        if kind == "good":
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["generated_tokens"] >= 1
        else:
            assert response.status_code == 400, response.text
            code = response.json()["error"]["code"]
            assert code == ("session_not_found" if kind == "unknown" else "invalid_request")


def test_a_client_that_disconnects_mid_answer_frees_its_session(server, reference):
    url = server.url("/invocations")
    image = make_image(50)
    with httpx.Client(timeout=60) as client:
        sid = open_session(client, url, data_uri(image))
    body = json.dumps(
        {
            "type": "query",
            "prompt": "Talk.",
            "max_new_tokens": 500,
            "temperature": 2.0,
            "seed": 3,
            "stream": True,
        }
    ).encode()
    request = (
        f"POST /invocations HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"{SESSION_HEADER}: {sid}\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    gone = "Connection to client got closed"  # TorchServe drops the request from its batch
    dropped_before = server.logs().count(gone)
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(request)
        head = sock.recv(4096)
        assert head.startswith(b"HTTP/1.1 200"), head[:200]
    # Once TorchServe has dropped the request, the next step drops its answer before it admits
    # anything: the session is free and unchanged, its next answer the conversation's first.
    server.wait_for_log(gone, seen=dropped_before)
    with httpx.Client(timeout=60) as client:
        r = post(
            client, url, {"type": "query", "prompt": "What is this?", "max_new_tokens": 8}, sid
        )
        assert r.status_code == 200, r.text
        assert r.json()["text"] == reference.answers(image, ["What is this?"], 8)[0]
    assert "left the batch" in server.logs()


def test_idle_sessions_expire_without_any_new_request(model_store, tmp_path):
    ts = start_server(
        model_store, tmp_path, LLAVA_SESSION_TTL_S="1.5", LLAVA_REAPER_INTERVAL_S="0.2"
    )
    try:
        url = ts.url("/predictions/llava")
        with httpx.Client(timeout=60) as client:
            sid = open_session(client, url, data_uri(make_image(60)))
            ts.wait_for_log(
                f"session {sid} expired", timeout_s=30
            )  # freed by the reaper, unprompted
            r = post(client, url, {"type": "query", "prompt": "hi"}, sid)
            assert r.status_code == 400 and r.json()["error"]["code"] == "session_expired"
        assert_no_worker_death(ts)
    finally:
        ts.stop()


def test_past_max_opening_opens_get_429_with_retry_after_and_conversations_go_on(
    model_store, tmp_path
):
    # Overload as a burst: 12 opens at once against room for 2 opening. Each open is answered
    # (opened or refused with Retry-After, none left hanging), and a conversation held
    # through the burst answers every question.
    ts = start_server(model_store, tmp_path, LLAVA_MAX_OPENING="2")
    try:
        url = ts.url("/predictions/llava")
        with httpx.Client(timeout=120) as client:
            held = open_session(client, url, data_uri(make_image(70)))

            def opener(seed: int) -> httpx.Response:
                with httpx.Client(timeout=120) as own:
                    body = {"type": "open_session", "image": data_uri(make_image(seed, (640, 400)))}
                    return own.post(url, json=body)

            with ThreadPoolExecutor(12) as pool:
                burst = [pool.submit(opener, 100 + i) for i in range(12)]
                asked = [
                    ask(client, url, held, f"Question {i}?", max_new_tokens=4) for i in range(3)
                ]
                opens = [f.result() for f in burst]
            assert all(a["text"] is not None for a in asked)  # every question answered
            statuses = sorted(r.status_code for r in opens)
            assert set(statuses) == {200, 429}, statuses
            for refused in (r for r in opens if r.status_code == 429):
                assert refused.headers["Retry-After"] == "1"
                assert refused.json()["error"]["code"] == "capacity_exceeded"
                assert "max_opening" in refused.json()["error"]["message"]
            for opened in (r for r in opens if r.status_code == 200):
                post(client, url, {"type": "close_session"}, opened.json()["session_id"])
            # Once the burst is over, opens are welcome again.
            open_session(client, url, data_uri(make_image(71)))
        assert_no_worker_death(ts)
    finally:
        ts.stop()
