"""Soak: open / ask / close cycles must not grow the worker's memory.

After a warm-up of the same cycles (allocator pools, caches and lazy imports settle), the
worker's resident memory is measured, the cycles run, and it must be back within 5% of that
baseline. `make test` runs a small version; `make stress` sets LLAVA_SOAK_CYCLES=1000.
"""

from __future__ import annotations

import os
import statistics
import time

import httpx
import psutil
import pytest
from helpers import data_uri, make_image, post

from llava.fronts.torchserve.launcher import TorchServe

pytestmark = pytest.mark.integration

CYCLES = int(os.environ.get("LLAVA_SOAK_CYCLES", "100"))
WARMUP = int(os.environ.get("LLAVA_SOAK_WARMUP", str(max(20, CYCLES // 5))))
TOLERANCE = 0.05
ROUTE = "/predictions/llava"
IMAGES = [data_uri(make_image(300 + i, (24, 24))) for i in range(8)]
PROMPTS = ["What is this?", "Which colors?", "Describe it.", "Anything odd?"]


def worker_process(ts: TorchServe, timeout_s: float = 30) -> psutil.Process:
    """The model's worker process, found through TorchServe's management API.

    A worker reports its pid a moment after it is ready (-1 until then).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        worker = ts.worker()
        if worker["pid"] > 0 or time.monotonic() > deadline:
            return psutil.Process(worker["pid"])
        time.sleep(0.2)


def rss(process: psutil.Process) -> int:
    """Resident bytes, the median of a few readings a moment apart (after any step settles)."""
    readings = []
    for _ in range(5):
        time.sleep(0.1)
        readings.append(process.memory_info().rss)
    return int(statistics.median(readings))


def cycle(client: httpx.Client, url: str, i: int) -> None:
    r = post(client, url, {"type": "open_session", "image": IMAGES[i % len(IMAGES)]})
    assert r.status_code == 200, r.text
    sid = r.json()["session_id"]
    body = {"type": "query", "prompt": PROMPTS[i % len(PROMPTS)], "max_new_tokens": 2}
    r = post(client, url, body, sid)
    assert r.status_code == 200, r.text
    r = post(client, url, {"type": "close_session"}, sid)
    assert r.status_code == 200, r.text


def test_open_ask_close_cycles_leave_memory_where_it_was(server) -> None:
    url = server.url(ROUTE)
    with httpx.Client(timeout=60) as client:
        for i in range(WARMUP):
            cycle(client, url, i)
        process = worker_process(server)
        baseline = rss(process)
        started = time.perf_counter()
        for i in range(CYCLES):
            cycle(client, url, i)
        wall = time.perf_counter() - started
    after = rss(process)
    delta = (after - baseline) / baseline
    assert worker_process(server).pid == process.pid  # the same worker all along
    print(
        f"\nsoak: {CYCLES} open/ask/close cycles (after {WARMUP} warm-up) in {wall:.1f} s "
        f"({1000 * wall / CYCLES:.0f} ms/cycle); worker RSS baseline {baseline / 2**20:.1f} MiB, "
        f"after {after / 2**20:.1f} MiB, delta {100 * delta:+.2f}% (limit {100 * TOLERANCE:.0f}%)"
    )
    assert abs(delta) <= TOLERANCE, f"worker RSS moved {100 * delta:+.2f}% over {CYCLES} cycles"
