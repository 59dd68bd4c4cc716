"""Run one conversation turn by turn under each caching strategy, in-process or over HTTP.

Strategies:
- stateless: every turn sends the image and the conversation so far; the server decodes the
  image, runs the vision tower and prefills everything (the kit's one-shot `generate`);
- pixels: the reference design - the session keeps the processed image; every turn re-runs the
  vision tower and prefills the whole conversation (a server with `cache_mode: pixels`);
- session: this kit - the session keeps its KV cache; a turn prefills only its new tokens.
Turn 1 of the two session strategies includes opening the session.
"""

from __future__ import annotations

import base64
import json
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from llava.api.headers import SESSION_HEADER
from llava.core.params import GenerationParams

STRATEGIES = ("stateless", "pixels", "session")
TRAINED = "shapes"  # the model that answers truly: its follow-ups are what a real model's are
# A conversation about a drawn scene, in the words the trained model knows.
SCENE_PROMPTS = [
    "What colour is the circle?",
    "And the other one?",
    "How many shapes are there?",
    "Which shape is on the left?",
    "Is there a triangle?",
    "What shape is blue?",
]


def scene_uri(seed: int, fmt: str = "PNG") -> str:
    """Return a drawn scene (what the trained model sees truly) as a data: URI."""
    from llava.tools.tiny.scenes import draw_scene

    data = draw_scene(random.Random(seed)).encode(fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(data).decode()


@dataclass
class TurnResult:
    """One answered question: latencies, bytes on the wire and token counts."""

    turn: int
    ttft_ms: float
    total_ms: float
    bytes_sent: int
    prefill_tokens: int
    cached_tokens: int
    generated_tokens: int
    server_ttft_ms: float | None = None
    floor_ms: float | None = None

    def row(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class LoadResult:
    """Several questions answered together (or one at a time)."""

    sessions: int
    mode: str  # "concurrent" or "sequential"
    wall_s: float
    tokens: int
    latencies_ms: list[float] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s


def open_body(image_uri: str) -> bytes:
    return json.dumps({"type": "open_session", "image": image_uri}).encode()


def query_body(prompt: str, max_new_tokens: int, stream: bool = False) -> bytes:
    return json.dumps(
        {"type": "query", "prompt": prompt, "max_new_tokens": max_new_tokens, "stream": stream}
    ).encode()


def generate_body(
    image_uri: str,
    history: list[tuple[str, str]],
    prompt: str,
    max_new_tokens: int,
    stream: bool = False,
) -> bytes:
    return json.dumps(
        {
            "type": "generate",
            "image": image_uri,
            "prompt": prompt,
            "history": [list(pair) for pair in history],
            "max_new_tokens": max_new_tokens,
            "stream": stream,
        }
    ).encode()


class InProcess:
    """Drive the engines directly: no server, the model's own cost."""

    def __init__(self, engines: dict[str, Any], images: Any) -> None:
        self.engines = engines  # "kv" and "pixels" engines over the same checkpoint
        self.images = images  # an ImageLoader, to decode data: URIs as a server would

    def conversation(
        self, strategy: str, image_uri: str, prompts: list[str], max_new_tokens: int
    ) -> list[TurnResult]:
        """Answer `prompts` in order under `strategy`; one result per turn."""
        engine = self.engines["pixels" if strategy == "pixels" else "kv"]
        params = GenerationParams(max_new_tokens=max_new_tokens)
        results, history, state = [], [], None
        for turn_no, prompt in enumerate(prompts, 1):
            sent = len(query_body(prompt, max_new_tokens))
            floor = None
            if strategy == "session" and state is not None:
                floor = self._floor(engine, state, prompt)
            started = time.perf_counter()
            if strategy == "stateless":
                sent = len(generate_body(image_uri, history, prompt, max_new_tokens))
                image = engine.prepare(self.images.load(image_uri))
                state = engine.new_session(image)
                engine.replay(state, history)
            elif state is None:
                sent += len(open_body(image_uri))
                state = engine.open_session(self.images.load(image_uri))
            started_turn = time.perf_counter()
            turn = engine.start_turn(state, prompt, params)
            while not turn.done:
                engine.step([turn])
            engine.finish_turn(turn)
            ttft = (turn.first_token_at - started) * 1000
            total = (turn.finished_at - started) * 1000
            results.append(
                TurnResult(
                    turn_no,
                    ttft,
                    total,
                    sent,
                    turn.prefill_tokens,
                    turn.cached_tokens,
                    len(turn.generated),
                    server_ttft_ms=(turn.first_token_at - started_turn) * 1000,
                    floor_ms=floor,
                )
            )
            history.append((prompt, turn.text))
            if strategy == "stateless":
                engine.release(state)
                state = None
        if state is not None:
            engine.release(state)
        return results

    @staticmethod
    def _floor(engine: Any, state: Any, prompt: str) -> float:
        """Time one bare forward over just this turn's new tokens on a copy of the cache."""
        import torch
        from transformers import DynamicCache

        turn = engine.start_turn(state, prompt, GenerationParams(max_new_tokens=1))
        cache = DynamicCache(
            ddp_cache_data=[(layer.keys, layer.values) for layer in state.cache.layers]
        )
        model = state.replica.model
        ids = torch.tensor([turn.pending], device=state.replica.device)
        with torch.inference_mode():
            started = time.perf_counter()
            model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            return (time.perf_counter() - started) * 1000

    def load(
        self, image_uris: list[str], prompt: str, max_new_tokens: int, concurrent: bool
    ) -> LoadResult:
        """Answer one question in each of len(image_uris) sessions, together or one by one."""
        engine = self.engines["kv"]
        states = [engine.open_session(self.images.load(uri)) for uri in image_uris]
        params = GenerationParams(max_new_tokens=max_new_tokens)
        started = time.perf_counter()
        turns = []
        if concurrent:
            turns = [engine.start_turn(s, prompt, params) for s in states]
            while not all(t.done for t in turns):
                engine.step(turns)
        else:
            for state in states:
                turn = engine.start_turn(state, prompt, params)
                while not turn.done:
                    engine.step([turn])
                turns.append(turn)
        wall = time.perf_counter() - started
        for turn in turns:
            engine.finish_turn(turn)
        for state in states:
            engine.release(state)
        latencies = [(t.finished_at - started) * 1000 for t in turns]
        return LoadResult(
            len(states),
            "concurrent" if concurrent else "sequential",
            wall,
            sum(len(t.generated) for t in turns),
            latencies,
        )


class OverHttp:
    """Drive real TorchServe instances (one per cache mode) with streamed HTTP requests."""

    def __init__(self, urls: dict[str, str]) -> None:
        self.urls = urls  # "kv" and "pixels" -> .../predictions/llava
        self.client = httpx.Client(timeout=300)

    def _stream(self, url: str, body: bytes, sid: str | None) -> tuple[float, float, dict, str]:
        """Send one streamed request; return (ttft_ms, total_ms, usage, text)."""
        headers = {"Content-Type": "application/json"}
        if sid:
            headers[SESSION_HEADER] = sid
        started = time.perf_counter()
        first, usage, text = None, {}, []
        with self.client.stream("POST", url, content=body, headers=headers) as r:
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:300]!r}")
            for line in r.iter_lines():
                if not line:
                    continue
                event = json.loads(line)
                if first is None:
                    first = time.perf_counter()
                if "error" in event:
                    raise RuntimeError(str(event["error"]))
                if "text" in event:
                    text.append(event["text"])
                usage = event.get("usage", usage)
        end = time.perf_counter()
        return ((first or end) - started) * 1000, (end - started) * 1000, usage, "".join(text)

    def _open(self, url: str, image_uri: str) -> tuple[str, float]:
        started = time.perf_counter()
        r = self.client.post(
            url, content=open_body(image_uri), headers={"Content-Type": "application/json"}
        )
        r.raise_for_status()
        return r.json()["session_id"], (time.perf_counter() - started) * 1000

    def _close(self, url: str, sid: str) -> None:
        self.client.post(
            url,
            content=b'{"type": "close_session"}',
            headers={"Content-Type": "application/json", SESSION_HEADER: sid},
        )

    def conversation(
        self, strategy: str, image_uri: str, prompts: list[str], max_new_tokens: int
    ) -> list[TurnResult]:
        """Answer `prompts` in order under `strategy`; one result per turn."""
        url = self.urls["pixels" if strategy == "pixels" else "kv"]
        results, history, sid = [], [], None
        for turn_no, prompt in enumerate(prompts, 1):
            opened_ms, sent = 0.0, 0
            if strategy == "stateless":
                body = generate_body(image_uri, history, prompt, max_new_tokens, stream=True)
            else:
                if sid is None:
                    sid, opened_ms = self._open(url, image_uri)
                    sent += len(open_body(image_uri))
                body = query_body(prompt, max_new_tokens, stream=True)
            sent += len(body)
            ttft, total, usage, text = self._stream(url, body, sid)
            results.append(
                TurnResult(
                    turn_no,
                    opened_ms + ttft,
                    opened_ms + total,
                    sent,
                    usage.get("prefill_tokens", 0),
                    usage.get("cached_tokens", 0),
                    usage.get("generated_tokens", 0),
                    server_ttft_ms=usage.get("ttft_ms"),
                )
            )
            history.append((prompt, text))
        if sid is not None:
            self._close(url, sid)
        return results

    def load(
        self, image_uris: list[str], prompt: str, max_new_tokens: int, concurrent: bool
    ) -> LoadResult:
        """Answer one question in each of len(image_uris) sessions, together or one by one."""
        from concurrent.futures import ThreadPoolExecutor

        url = self.urls["kv"]
        sids = [self._open(url, uri)[0] for uri in image_uris]
        body = query_body(prompt, max_new_tokens, stream=True)
        started = time.perf_counter()

        def ask(sid: str) -> tuple[float, int]:
            _, _, usage, _ = self._stream(url, body, sid)
            return (time.perf_counter() - started) * 1000, usage.get("generated_tokens", 0)

        if concurrent:
            with ThreadPoolExecutor(len(sids)) as pool:
                done = list(pool.map(ask, sids))
        else:
            done = [ask(sid) for sid in sids]
        wall = time.perf_counter() - started
        for sid in sids:
            self._close(url, sid)
        return LoadResult(
            len(sids),
            "concurrent" if concurrent else "sequential",
            wall,
            sum(n for _, n in done),
            [ms for ms, _ in done],
        )
