"""Load: many sessions at once over loopback, each answer equal to its sequential twin.

Every session opens on its own image and asks a few greedy questions while all the others do
the same; with temperature 0 each answer must be exactly what recomputing that conversation
alone, from scratch, gives (`helpers.Reference`). `make test` runs a small version;
`make stress` sets LLAVA_STRESS_SESSIONS=32.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from conftest import assert_no_worker_death
from engine_under_test import oracle
from helpers import data_uri, make_image, post

pytestmark = pytest.mark.integration

SESSIONS = int(os.environ.get("LLAVA_STRESS_SESSIONS", "8"))
QUESTIONS = ["What is this?", "Which colors stand out?", "What else?"]
MAX_NEW_TOKENS = 8
ROUTE = "/predictions/llava"


def converse(url: str, seed: int, barrier: threading.Barrier) -> tuple[list[str], list[int]]:
    """Open a session, ask 2-3 questions, close it; return the answers and the statuses."""
    questions = QUESTIONS[: 2 + seed % 2]
    statuses: list[int] = []
    with httpx.Client(timeout=300) as client:
        barrier.wait()  # every session opens at once
        r = post(client, url, {"type": "open_session", "image": data_uri(make_image(seed))})
        statuses.append(r.status_code)
        assert r.status_code == 200, r.text
        sid = r.json()["session_id"]
        answers = []
        for prompt in questions:
            body = {"type": "query", "prompt": prompt, "max_new_tokens": MAX_NEW_TOKENS}
            r = post(client, url, body, sid)
            statuses.append(r.status_code)
            assert r.status_code == 200, r.text
            answers.append(r.json()["text"])
        r = post(client, url, {"type": "close_session"}, sid)
        statuses.append(r.status_code)
        assert r.status_code == 200, r.text
    return answers, statuses


def test_concurrent_sessions_answer_exactly_as_alone(server, tiny_checkpoint) -> None:
    url = server.url(ROUTE)
    seeds = [500 + i for i in range(SESSIONS)]
    barrier = threading.Barrier(SESSIONS)
    started = time.perf_counter()
    with ThreadPoolExecutor(SESSIONS) as pool:
        futures = {seed: pool.submit(converse, url, seed, barrier) for seed in seeds}
        results = {seed: f.result(timeout=600) for seed, f in futures.items()}
    wall = time.perf_counter() - started

    reference = oracle(tiny_checkpoint)
    checked = 0
    for seed, (answers, statuses) in results.items():
        assert all(s == 200 for s in statuses), statuses
        twin = reference.answers(make_image(seed), QUESTIONS[: len(answers)], MAX_NEW_TOKENS)
        assert answers == twin, f"session {seed}: {answers} != sequential {twin}"
        checked += len(answers)
    assert len({tuple(a) for a, _ in results.values()}) > SESSIONS // 2  # answers really differ
    requests = sum(len(s) for _, s in results.values())
    print(
        f"\nload: {SESSIONS} concurrent sessions, {requests} requests in {wall:.1f} s, "
        f"{checked} answers checked against their sequential twins, 0 errors"
    )
    assert_no_worker_death(server)
