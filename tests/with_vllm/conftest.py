"""vLLM in this process for the engine tests: eager, float32, a small KV cache (`make test`
runs these in the vLLM environment, `docker/vllm-cpu/install.sh`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from engine_under_test import VLLM_SERVER_ENV

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # one process: starts in seconds


def vllm_config(**overrides: Any) -> Any:
    """The kit's settings for vLLM in tests (the compile time is not what they test), with the
    servers' small KV cache: the engine tests hold an engine and an oracle per family at once."""
    from llava.core.config import ServerConfig

    values: dict[str, Any] = {
        "engine": "vllm",
        "dtype": "float32",
        "enforce_eager": True,
        "max_context_tokens": 1024,
        "kv_cache_gb": float(VLLM_SERVER_ENV["LLAVA_KV_CACHE_GB"]),
    }
    return ServerConfig(**{**values, **overrides})


class Oracle:
    """vLLM's own offline `generate` on a whole conversation (vllm_reference.VllmReference),
    called with the messages first and answering with token ids, as the engine tests compare."""

    def __init__(self, checkpoint: Path, dtype: str = "float32", **engine: Any) -> None:
        from vllm_reference import VllmReference

        self.reference = VllmReference(checkpoint, dtype, **engine)
        self.processor = self.reference.processor
        self.llm = self.reference.llm

    def answer(self, messages: list[dict[str, Any]], pictures: list[Any], tokens: int) -> list[int]:
        """Return the greedy answer's ids (without the end-of-answer id)."""
        return list(self.reference.greedy(pictures, messages, tokens).tokens)

    def greedy(self, messages: list[dict[str, Any]], pictures: list[Any], tokens: int) -> Any:
        """Return the greedy answer with each step's top tokens (a `helpers.Greedy`), for
        answers computed in bf16, where near-ties may fall either way."""
        return self.reference.greedy(pictures, messages, tokens)


@pytest.fixture(scope="session")
def built(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Build a profile's checkpoint once per run."""
    from llava.tools.tiny import build_checkpoint

    cache: dict[str, Path] = {}

    def build(profile: str) -> Path:
        if profile not in cache:
            cache[profile] = build_checkpoint(tmp_path_factory.mktemp("ckpt") / profile, profile)
        return cache[profile]

    return build


# The kit on vLLM in tests' servers: eager, float32, a small KV cache.
KIT_ENV = VLLM_SERVER_ENV


def expected_text(
    oracle: Oracle, history: list[tuple[str, str]], question: str, pic: Any, tokens: int
) -> str:
    """vLLM's offline answer, as text, to a conversation opened with `pic`."""
    from helpers import Reference

    ids = oracle.answer(Reference.messages(None, history, question), [pic], tokens)
    return str(oracle.processor.tokenizer.decode(ids, skip_special_tokens=True))


def kill_under_stream(
    client: Any, url: str, sid: str, pid: int, sig: int | None = None
) -> list[dict[str, Any]]:
    """Stream a long answer, send `pid` `sig` (SIGKILL) once it has begun; return its JSON
    lines."""
    import json
    import signal
    import threading

    from llava.api.headers import SESSION_HEADER

    started, lines = threading.Event(), []

    def stream() -> None:
        body = {"type": "query", "prompt": "Tell me more.", "max_new_tokens": 900, "stream": True}
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
    os.kill(pid, signal.SIGKILL if sig is None else sig)
    streamer.join(120)
    return lines


def until_engine_back(client: Any, url: str, sid: str, body: dict[str, Any]) -> Any:
    """Post `body` until the engine is back: meanwhile every answer must be a 503
    `engine_restarting` with a Retry-After; return the first other response."""
    import time

    from llava.api.headers import SESSION_HEADER

    deadline = time.monotonic() + 180
    while True:
        r = client.post(url, json=body, headers={SESSION_HEADER: sid})
        if r.status_code != 503:
            return r
        assert r.json()["error"]["code"] == "engine_restarting" and r.headers["Retry-After"]
        assert time.monotonic() < deadline, "the engine did not come back"
        time.sleep(float(r.headers["Retry-After"]) / 10)
