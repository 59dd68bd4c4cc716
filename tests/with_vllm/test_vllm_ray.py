"""`engine: vllm` behind the Ray Serve front (two replicas, each with its own vLLM engine):
sessions stick to their replica and answer as vLLM's offline `generate` does.

Ray binds the machine's own address: `make test` runs this in a private network namespace."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM runs in its own environment: make test-vllm")

import httpx  # noqa: E402
from conftest import Oracle  # noqa: E402
from helpers import ask, data_uri, in_private_network, open_session  # noqa: E402

from llava.core.paths import CHECKOUT  # noqa: E402
from llava.fronts.ray.launcher import RayServe  # noqa: E402
from llava.tools.tiny.scenes import draw_scene  # noqa: E402

SHAPES = CHECKOUT / "models" / "shapes"
TOKENS = 8
QUESTIONS = ["What colour is the circle?", "And the other one?"]


@pytest.fixture(scope="module")
def front(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayServe]:
    if not in_private_network():
        pytest.skip("Ray runs only in a private network namespace: run `make test` as root")
    env = {
        "LLAVA_ENGINE": "vllm",
        "LLAVA_DTYPE": "float32",
        "LLAVA_ENFORCE_EAGER": "true",
        "LLAVA_MAX_CONTEXT_TOKENS": "1024",
        "VLLM_CPU_KVCACHE_SPACE": "1",
    }
    with RayServe(SHAPES, replicas=2, workdir=tmp_path_factory.mktemp("ray"), env=env) as ray:
        yield ray


def test_sessions_on_two_vllm_replicas_answer_as_vllm_does(front: RayServe) -> None:
    oracle = Oracle(SHAPES)
    url = front.url("/predictions/llava")
    pictures = [draw_scene(random.Random(20 + i), count=2).draw() for i in range(4)]
    with httpx.Client(timeout=120) as client:
        sids = [open_session(client, url, data_uri(p)) for p in pictures]
        for sid, pic in zip(sids, pictures, strict=True):
            history: list[tuple[str, str]] = []
            for question in QUESTIONS:
                text = ask(client, url, sid, question, max_new_tokens=TOKENS)["text"]
                messages: list[dict[str, Any]] = []
                for i, (q, a) in enumerate([*history, (question, None)]):
                    image: list[dict[str, str]] = [{"type": "image"}] if i == 0 else []
                    content = [*image, {"type": "text", "text": q}]
                    messages.append({"role": "user", "content": content})
                    if a is not None:
                        messages.append(
                            {"role": "assistant", "content": [{"type": "text", "text": a}]}
                        )
                want = oracle.answer(messages, [pic], TOKENS)
                assert text == oracle.processor.tokenizer.decode(want, skip_special_tokens=True)
                history.append((question, text))


@pytest.fixture(scope="module")
def own_process_front(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayServe]:
    """One replica whose vLLM engine core runs in a process of its own, as in production."""
    if not in_private_network():
        pytest.skip("Ray runs only in a private network namespace: run `make test` as root")
    env = {
        "LLAVA_ENGINE": "vllm",
        "LLAVA_DTYPE": "float32",
        "LLAVA_ENFORCE_EAGER": "true",
        "LLAVA_MAX_CONTEXT_TOKENS": "1024",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
    }
    with RayServe(SHAPES, replicas=1, workdir=tmp_path_factory.mktemp("ray1"), env=env) as ray:
        yield ray


def test_a_killed_engine_core_under_ray_costs_no_finished_turn(own_process_front: RayServe) -> None:
    import json
    import os
    import signal
    import threading
    import time

    import psutil

    from llava.api.headers import SESSION_HEADER

    oracle = Oracle(SHAPES)
    url = own_process_front.url("/predictions/llava")
    pic = draw_scene(random.Random(30), count=2).draw()
    with httpx.Client(timeout=120) as client:
        sid = open_session(client, url, data_uri(pic))
        first = ask(client, url, sid, QUESTIONS[0], max_new_tokens=TOKENS)["text"]
        [core] = [p for p in psutil.process_iter(["name"]) if p.info["name"] == "VLLM::EngineCore"]
        started, lines = threading.Event(), []

        def stream() -> None:
            body = {
                "type": "query",
                "prompt": "Tell me more.",
                "max_new_tokens": 900,
                "stream": True,
            }
            headers = {"Content-Type": "application/json", SESSION_HEADER: sid}
            with client.stream("POST", url, json=body, headers=headers) as r:
                for line in r.iter_lines():
                    if line:
                        lines.append(json.loads(line))
                        started.set()
            started.set()

        streamer = threading.Thread(target=stream)
        streamer.start()
        assert started.wait(60)
        os.kill(core.pid, signal.SIGKILL)
        streamer.join(120)
        assert lines[-1].get("error", {}).get("code") == "engine_restarting", lines[-3:]
        deadline = time.monotonic() + 180
        body = {"type": "query", "prompt": QUESTIONS[1], "max_new_tokens": TOKENS}
        while True:  # 503 with Retry-After while the engine starts again
            r = client.post(url, json=body, headers={SESSION_HEADER: sid})
            if r.status_code != 503:
                break
            assert r.json()["error"]["code"] == "engine_restarting"
            assert time.monotonic() < deadline, "the engine did not come back"
            time.sleep(float(r.headers["Retry-After"]) / 10)
        assert r.status_code == 200, r.text
        messages = [
            {
                "role": "user",
                "content": [{"type": "image"}, {"type": "text", "text": QUESTIONS[0]}],
            },
            {"role": "assistant", "content": [{"type": "text", "text": first}]},
            {"role": "user", "content": [{"type": "text", "text": QUESTIONS[1]}]},
        ]
        want = oracle.processor.tokenizer.decode(
            oracle.answer(messages, [pic], TOKENS), skip_special_tokens=True
        )
        assert r.json()["text"] == want
