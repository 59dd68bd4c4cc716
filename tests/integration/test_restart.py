"""A worker killed with `kill -9` under traffic loses no finished turn of any conversation.

Sessions at different turns and a stream in flight; the worker is killed; TorchServe starts a
new one, which restores every session from its snapshot. Each session's next answer equals the
model's own pipeline over the whole conversation (what an undisturbed twin answers); the answer
being streamed at the crash is lost and its conversation stays at its last finished turn.
Closing the sessions leaves no snapshot on disk.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import served
from engine_under_test import oracle
from helpers import Reference, ask, data_uri, make_image, open_session, post

from llava.api.headers import SESSION_HEADER
from llava.fronts.torchserve.launcher import TorchServe

pytestmark = pytest.mark.integration

PROMPTS = ["What is this?", "Which colors do you see?", "Is it big?", "Where is it?"]
TOKENS = 8


@pytest.fixture(scope="module")
def reference(tiny_checkpoint) -> Reference:
    return oracle(tiny_checkpoint)


@pytest.fixture(scope="module")
def restartable(model_store, tmp_path_factory) -> Iterator[TorchServe]:
    with served(model_store, tmp_path_factory.mktemp("restart")) as ts:
        yield ts


def snapshot_files(ts: TorchServe) -> list[Path]:
    # The launcher points TMPDIR at the server's workdir: snapshots go to <tmp>/llava-snapshots.
    return sorted((ts.workdir / "llava-snapshots" / "llava").glob("*.snap"))


def stream_until_cut(url: str, sid: str, started: threading.Event, out: list[dict]) -> None:
    """Stream a long answer, recording each JSON line, until the server cuts it."""
    body = {"type": "query", "prompt": "Tell me a long story.", "max_new_tokens": 1024}
    headers = {"Content-Type": "application/json", SESSION_HEADER: sid}
    try:
        with (
            httpx.Client(timeout=120) as client,
            client.stream("POST", url, json=body | {"stream": True}, headers=headers) as r,
        ):
            for line in r.iter_lines():
                if line:
                    out.append(json.loads(line))
                    started.set()
    except httpx.HTTPError:
        pass  # the worker died mid-stream: the connection ends
    finally:
        started.set()


def test_sessions_survive_a_killed_worker(restartable, reference) -> None:
    ts = restartable
    url = ts.url("/predictions/llava")
    images = [make_image(300 + i) for i in range(4)]
    with httpx.Client(timeout=60) as client:
        sids = [open_session(client, url, data_uri(image)) for image in images]
        # Sessions 0, 1, 2 have finished 0, 1 and 2 turns; session 3 streams at the crash.
        turns = [0, 1, 2, 1]
        first = {}
        for i, sid in enumerate(sids):
            for t in range(turns[i]):
                body = ask(client, url, sid, PROMPTS[t], max_new_tokens=TOKENS)
                first[i] = body
        assert first[2]["usage"]["snapshot_bytes"] > 0  # the open's snapshot was on disk
        started, lines = threading.Event(), []
        streamer = threading.Thread(target=stream_until_cut, args=(url, sids[3], started, lines))
        streamer.start()
        assert started.wait(60)
        before = ts.worker()
        os.kill(before["pid"], signal.SIGKILL)
        streamer.join(120)
        assert not any("usage" in line for line in lines), "the stream finished before the kill"

        began = time.monotonic()
        ts.wait_for_new_worker(before["pid"])
        restart_s = time.monotonic() - began

        for i, sid in enumerate(sids):
            began = time.monotonic()
            body = ask(client, url, sid, PROMPTS[turns[i]], max_new_tokens=TOKENS)
            took = time.monotonic() - began
            expected = reference.answers(images[i], PROMPTS[: turns[i] + 1], TOKENS)
            assert body["text"] == expected[-1], (i, body)
            assert body["usage"]["session_tier"] == "features"  # rebuilt from the features
            print(f"\nsession {i}: first turn after the restart {took * 1000:.0f} ms")
        again = ask(client, url, sids[2], PROMPTS[3], max_new_tokens=TOKENS)
        assert again["text"] == reference.answers(images[2], PROMPTS, TOKENS)[3]
        assert again["usage"]["snapshot_bytes"] > 0
        print(f"worker back after {restart_s:.1f} s")

        metrics = (ts.log_dir / "model_metrics.log").read_text()
        assert "LlavaSnapshotBytes" in metrics
        files = snapshot_files(ts)
        assert len(files) == len(sids)
        assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in files)
        for sid in sids:
            assert post(client, url, {"type": "close_session"}, sid).status_code == 200
    deadline = time.monotonic() + 30  # removals are written by the snapshot thread
    while snapshot_files(ts) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert snapshot_files(ts) == []
