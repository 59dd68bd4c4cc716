"""Faults at random points of random steps, through the service: every session stands at a
turn it answered.

Hypothesis draws fault plans (the calls at which to raise) over any forward (an error, or an
out-of-memory error the service retries), any sampled token, any row copied out of a stacked
decode batch and any layer copied in a tier move, while sessions open, answer, move between
tiers and come back from their snapshots, and while chat clients send whole chats without a
header. The oracle is transformers' own pipeline on what each session answered.
"""

from __future__ import annotations

import json
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from helpers import Reference, SeededImages, make_image, serve_rows
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from llava.api.headers import SESSION_HEADER
from llava.api.replies import Reply
from llava.core.config import ServerConfig
from llava.engines.transformers import LlavaEngine
from llava.server.service import SessionService
from llava.sessions.memory import TieredMemory
from llava.sessions.snapshots import SnapshotDir, recover
from llava.sessions.store import SessionStore

QUESTIONS = ["What is this?", "Which colors do you see?", "Is it big?", "Where is it?", "Why?"]
IMAGE_URL = "https://images.test/{}"  # SeededImages loads make_image(seed)
BUDGET = 5  # tokens per step: every prefill is cut into chunks


@pytest.fixture(scope="module")
def engine(tiny_checkpoint: Any) -> LlavaEngine:
    return LlavaEngine.load(tiny_checkpoint, ServerConfig(device="cpu", step_token_budget=BUDGET))


@pytest.fixture(scope="module")
def reference(tiny_checkpoint: Any) -> Reference:
    return Reference(tiny_checkpoint)


FAULT_POINTS = {
    # The n-th forward (from its middle decoder layer), sampled token, row copied out of a
    # stacked batch and layer copied in a tier move; undisturbed, the test makes about 41, 54,
    # 36 and 24 of them.
    "forward": st.dictionaries(st.integers(0, 50), st.sampled_from(["error", "oom"]), max_size=4),
    "sample": st.sets(st.integers(0, 60), max_size=3),
    "unstack": st.sets(st.integers(0, 40), max_size=3),
    "move": st.sets(st.integers(0, 30), max_size=3),
}


@contextmanager
def faults_at(engine: LlavaEngine, plan: dict[str, Any]) -> Iterator[Counter[str]]:
    """Raise at the planned calls of every fault point; yield how many faults each raised."""
    from llava.engines.transformers import stepping as stepping_module
    from llava.engines.transformers.decoding import batch as batch_module
    from llava.engines.transformers.decoding import decoder as decoder_module
    from llava.engines.transformers.model import cache as cache_module

    calls: Counter[str] = Counter()
    raised: Counter[str] = Counter()

    def failing(point: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls[point] += 1
            if calls[point] - 1 in plan[point]:
                raised[point] += 1
                raise RuntimeError(f"injected fault ({point})")
            return real(*args, **kwargs)

        return call

    def forward_hook(module: Any, args: Any, kwargs: Any) -> None:
        calls["forward"] += 1
        kind = plan["forward"].get(calls["forward"] - 1)
        if kind is not None:
            raised["forward"] += 1
            if kind == "oom":  # the service frees memory and retries once
                raise torch.OutOfMemoryError("CUDA out of memory (injected)")
            raise RuntimeError("injected fault (forward)")

    layers = engine.runner.replicas[0].model.model.language_model.layers
    handle = layers[len(layers) // 2].register_forward_pre_hook(forward_hook, with_kwargs=True)
    with pytest.MonkeyPatch.context() as patch:
        for module in (decoder_module, stepping_module):
            patch.setattr(module, "next_token", failing("sample", module.next_token))
        patch.setattr(batch_module, "_row", failing("unstack", batch_module._row))
        patch.setattr(cache_module, "_copy", failing("move", cache_module._copy))
        try:
            yield raised
        finally:
            handle.remove()


@settings(
    max_examples=30,
    deadline=None,
    derandomize=True,  # the same plans every run: a failure reproduces
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(plan=st.fixed_dictionaries(FAULT_POINTS), restart=st.booleans())
# Found by this test. A row's sampling failed, then rolling its answer back unstacked the
# batch, whose copy failed: the session was lost (now an abandoned row is left behind, no copy).
@example(plan={"forward": {}, "sample": {2}, "unstack": {0}, "move": set()}, restart=False)
# A finished answer's copy out of the batch failed: its work was already dropped, so its
# session kept the answer's positions uncommitted and its next answer was wrong.
@example(plan={"forward": {}, "sample": set(), "unstack": {0, 1}, "move": {0}}, restart=False)
def test_faults_anywhere_leave_every_session_at_a_turn_it_answered(
    engine: LlavaEngine, reference: Reference, plan: dict[str, Any], restart: bool
) -> None:
    """Three sessions open and answer three rounds of questions together, through the
    service, while faults strike at planned calls of any forward (an error, or an
    out-of-memory error the service retries), any sampled token, any row copied out of the
    stacked batch and any copy of a session moving to host memory (a device budget of about
    two caches keeps moving them). A request that fails gets an error and commits nothing (a
    failed open is sent again); one that succeeds is the pipeline's answer. Afterwards each
    session answers its next question as the pipeline does after exactly the questions it
    answered: none stands between two turns. With `restart`, the worker dies first and a new
    one restores every session from its snapshot on disk, which must hold that same turn."""
    probe = engine.open_session(make_image(90))
    budget = int(probe.cache_bytes * 2.2)
    engine.release(probe)
    folder = tempfile.TemporaryDirectory()
    snapshots = SnapshotDir(folder.name, 1 << 30)

    def serving() -> tuple[SessionStore, SessionService[Any, Any]]:
        def release(session: Any, reason: str) -> None:
            engine.release(session.state)
            snapshots.remove(session.id)

        store = SessionStore(memory=TieredMemory(engine, budget, None), release=release)
        limits = engine.runner.config.limits
        return store, SessionService(
            engine, store, SeededImages(), limits=limits, snapshots=snapshots
        )

    store, service = serving()
    seeds = [91, 92, 93]
    sids: dict[int, str] = {}
    try:
        answered: dict[int, list[tuple[str, str]]] = {s: [] for s in seeds}
        with faults_at(engine, plan) as raised:
            for attempt in range(10):  # opens, under faults too: a failed one is sent again
                opens = [
                    (f"o{attempt}-{s}", {"type": "open_session", "image": IMAGE_URL.format(s)}, {})
                    for s in seeds
                    if s not in sids
                ]
                opened = serve_rows(service, opens)
                for (rid, _, _), s in zip(opens, [s for s in seeds if s not in sids], strict=True):
                    status, reply = opened[rid]
                    assert status in (200, 500, 503), (status, reply)
                    if status == 200:
                        sids[s] = reply["session_id"]
            assert len(sids) == len(seeds)
            for round_ in range(3):
                rows = []
                for s in seeds:
                    prompt = QUESTIONS[len(answered[s])]
                    body = {"type": "query", "prompt": prompt, "max_new_tokens": 6}
                    rows.append((f"q{round_}-{s}", body, {SESSION_HEADER: sids[s]}))
                replies = serve_rows(service, rows)
                for (rid, body, _), s in zip(rows, seeds, strict=True):
                    status, reply = replies[rid]
                    assert status in (200, 500, 503), (status, reply)
                    if status == 200:
                        answered[s].append((body["prompt"], reply["text"]))
        if restart:  # the worker dies; a new one restores the sessions left open
            snapshots.flush()
            for sid in sids.values():
                engine.release(store.get(sid).state)
            service.close()
            store, service = serving()
            counts = recover(snapshots, engine, store, sids.values())
            assert counts["restored"] == len(seeds), counts
        for s in seeds:  # faults over: the next question of each
            prompt = QUESTIONS[len(answered[s])]
            body = {"type": "query", "prompt": prompt, "max_new_tokens": 6}
            status, reply = serve_rows(service, [("last", body, {SESSION_HEADER: sids[s]})])["last"]
            assert status == 200, reply
            asked = [p for p, _ in answered[s]] + [prompt]
            said = [t for _, t in answered[s]] + [reply["text"]]
            assert said == reference.answers(make_image(s), asked, 6), (s, dict(raised))
    finally:
        service.close()
        snapshots.close()
        folder.cleanup()


def stream_rows(service: Any, rows: list[Any]) -> dict[str, tuple[int, str | None]]:
    """Step the service until every chat completion has its whole reply, streamed or not;
    return its status and answer text by request id (None: it failed, also in-band)."""
    from llava.server.service import Incoming

    parts: dict[str, list[Reply]] = {rid: [] for rid, _, _ in rows}
    for _ in range(2000):
        waiting = [row for row in rows if not parts[row[0]] or parts[row[0]][-1].last is False]
        if not waiting:
            break
        batch = [
            Incoming(rid, None if parts[rid] else json.dumps(body).encode(), headers)
            for rid, body, headers in waiting
        ]
        for (rid, _, _), reply in zip(waiting, service.step(batch), strict=True):
            if reply is not None:
                parts[rid].append(reply)
    else:
        raise AssertionError("the service never finished answering")
    out: dict[str, tuple[int, str | None]] = {}
    for rid, replies in parts.items():
        status = replies[0].status
        if replies[0].last is None and not replies[0].body.startswith(b"data: "):  # whole JSON
            body = json.loads(replies[0].body)
            out[rid] = (status, body["choices"][0]["message"]["content"] if status == 200 else None)
            continue
        events = [
            json.loads(line[6:])
            for reply in replies
            for line in reply.body.decode().splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"
        ]
        failed = status != 200 or any("error" in event for event in events)
        text = "".join(
            choice["delta"].get("content") or "" for e in events for choice in e.get("choices", [])
        )
        out[rid] = (status, None if failed else text)
    return out


@settings(
    max_examples=20,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(plan=st.fixed_dictionaries(FAULT_POINTS), stream=st.booleans())
def test_faults_anywhere_never_change_what_a_chat_sent_whole_is_answered(
    engine: LlavaEngine, reference: Reference, plan: dict[str, Any], stream: bool
) -> None:
    """Two chats sent as chat clients send them (no session header, the whole conversation
    every turn, streamed or not, a title request over it between turns), while faults strike
    anywhere: what the instance holds of each chat is reused, forked and moved between tiers
    meanwhile. Every answer that comes back whole (a stream: up to its last chunk, with no
    error line) is the pipeline's answer to the messages sent; a failed one is re-sent as a
    client's retry; after the faults, each chat's next answer is still the pipeline's."""
    probe = engine.open_session(make_image(90))
    budget = int(probe.cache_bytes * 2.2)
    engine.release(probe)
    store = SessionStore(
        memory=TieredMemory(engine, budget, None), release=lambda s, r: engine.release(s.state)
    )
    service = SessionService(engine, store, SeededImages(), limits=engine.runner.config.limits)
    seeds = [94, 95]
    urls = {s: IMAGE_URL.format(s) for s in seeds}
    chats: dict[int, list[dict[str, Any]]] = {
        s: [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": urls[s]}},
                    {"type": "text", "text": QUESTIONS[0]},
                ],
            }
        ]
        for s in seeds
    }

    def send(rows: list[tuple[str, list[dict[str, Any]]]]) -> dict[str, str | None]:
        """Send chats at once; return each answer's text (None: it failed), checked."""
        fields = {"max_tokens": 6, "temperature": 0, "stream": stream}
        bodies = [(rid, {"model": "llava", "messages": sent, **fields}, {}) for rid, sent in rows]
        replies = stream_rows(service, bodies)
        out: dict[str, str | None] = {}
        for rid, sent in rows:
            status, text = replies[rid]
            assert status in (200, 500, 503), (status, text)
            if text is not None:
                pictures = {url: make_image(int(url.rsplit("/", 1)[1])) for url in urls.values()}
                assert text == reference.chat_answer(sent, pictures, 6), (rid, text)
            out[rid] = text
        return out

    def title(s: int) -> list[dict[str, Any]]:
        """A title side request quoting the chat, as Open WebUI sends between turns."""
        quoted = "\n".join(str(m["content"]) for m in chats[s] if isinstance(m["content"], str))
        return [{"role": "user", "content": f"Give this chat a title: {quoted}"}]

    try:
        with faults_at(engine, plan):
            for round_ in range(3):
                answers = send([(f"c{round_}-{s}", chats[s]) for s in seeds])
                for s in seeds:
                    text = answers[f"c{round_}-{s}"]
                    if text is not None:  # else the client sends the same chat again
                        asked = sum(1 for m in chats[s] if m["role"] == "user")
                        chats[s] += [
                            {"role": "assistant", "content": text},
                            {"role": "user", "content": QUESTIONS[asked]},
                        ]
                send([(f"t{round_}-{s}", title(s)) for s in seeds])
        answers = send([(f"last-{s}", chats[s]) for s in seeds])
        assert all(text is not None for text in answers.values()), answers
    finally:
        service.close()
