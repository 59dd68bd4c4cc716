"""Every piece of a step is bounded and transactional: a failing forward changes no session.

Faults are raised from a middle decoder layer, after the layers before it have written their
part of the cache (how a CUDA out-of-memory error arrives), during a chunked prefill, a single
decode, a batched decode and a packed forward (a chunk beside decodes). Every session is then
compared with the model's own pipeline (transformers' `generate`), which is what an undisturbed
twin answers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from helpers import Reference, SeededImages, make_image, serve_rows

from llava.core.config import ServerConfig
from llava.core.params import GenerationParams
from llava.engines.transformers import LlavaEngine, Tier
from llava.engines.transformers.scheduling.scheduler import IDLE_FACTOR
from llava.server.service import SessionService
from llava.sessions.memory import TieredMemory
from llava.sessions.store import SessionStore

GREEDY = GenerationParams(max_new_tokens=8)
PROMPTS = ["What is this?", "Which colors do you see?", "Is it big?"]
BUDGET = 5  # tokens per step: every prefill is cut into chunks, image runs included


@pytest.fixture(scope="module")
def engine(tiny_checkpoint: Any) -> LlavaEngine:
    config = ServerConfig(device="cpu", step_token_budget=BUDGET)
    return LlavaEngine.load(tiny_checkpoint, config)


@pytest.fixture(scope="module")
def reference(tiny_checkpoint: Any) -> Reference:
    return Reference(tiny_checkpoint)


@contextmanager
def fault(
    engine: LlavaEngine,
    when: Callable[[torch.Size], bool],
    exc: BaseException | None = None,
    times: int = 1,
) -> Iterator[list[int]]:
    """Raise from the middle decoder layer on the next `times` forwards whose hidden states'
    shape matches `when`; yield a list that records each shape it fired on."""
    layers = engine.runner.replicas[0].model.model.language_model.layers
    fired: list[Any] = []

    def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        hidden = args[0] if args else kwargs["hidden_states"]
        if len(fired) < times and when(hidden.shape):
            fired.append(tuple(hidden.shape))
            raise exc if exc is not None else RuntimeError("injected fault")

    handle = layers[len(layers) // 2].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield fired
    finally:
        handle.remove()


def prefill(shape: torch.Size) -> bool:
    return shape[0] == 1 and shape[1] > 1


def single_decode(shape: torch.Size) -> bool:
    return shape[0] == 1 and shape[1] == 1


def batched_decode(shape: torch.Size) -> bool:
    return shape[0] > 1


def consistent(state: Any) -> bool:
    """Every layer of the session's cache holds exactly its cached ids."""
    return all(layer.get_seq_length() == len(state.cache_ids) for layer in state.cache.layers)


def step_until_error(engine: LlavaEngine, turns: list[Any]) -> dict[int, BaseException]:
    for _ in range(500):
        errors = engine.step(turns)
        if errors or all(t.done for t in turns):
            return errors
    raise AssertionError("the turns never finished")


def ask(engine: LlavaEngine, state: Any, prompt: str) -> str:
    return engine.run_to_end(engine.start_turn(state, prompt, GREEDY)).text


def test_chunked_prefill_answers_as_the_models_own_pipeline(engine, reference) -> None:
    image = make_image(1)
    state = engine.new_session(engine.prepare(image))
    opening = engine.start_open(state)
    steps = 0
    while not opening.done:
        assert not engine.step([opening])
        steps += 1
    engine.finish_turn(opening)
    # The vision tower, then chunks of twice the budget (no answer decodes beside it).
    assert steps >= len(opening.ids) // (BUDGET * IDLE_FACTOR)
    assert [ask(engine, state, p) for p in PROMPTS] == reference.answers(image, PROMPTS, 8)


def test_a_fault_in_a_prefill_chunk_leaves_the_session_as_before(engine, reference) -> None:
    image = make_image(2)
    state = engine.open_session(image)
    first = ask(engine, state, PROMPTS[0])
    turn = engine.start_turn(state, PROMPTS[1], GREEDY)
    before = list(state.cache_ids)  # what the new question shares with the cache
    assert not engine.step([turn])  # one chunk in: the fault hits a later one
    with fault(engine, prefill) as fired:
        errors = step_until_error(engine, [turn])
    assert fired and list(errors) == [0]
    engine.abort_turn(turn)
    assert state.cache_ids == before and consistent(state)
    rest = [ask(engine, state, p) for p in PROMPTS[1:]]
    assert [first, *rest] == reference.answers(image, PROMPTS, 8)


def test_a_fault_while_opening_frees_the_state_and_the_next_open_works(engine, reference) -> None:
    image = make_image(3)
    held = set(engine.runner.replicas[0].states)
    with fault(engine, prefill) as fired, pytest.raises(RuntimeError, match="injected"):
        engine.open_session(image)
    assert fired and not set(engine.runner.replicas[0].states) - held  # the state was released
    state = engine.open_session(image)
    assert [ask(engine, state, p) for p in PROMPTS] == reference.answers(image, PROMPTS, 8)


def test_a_fault_in_a_single_decode_step_leaves_the_session_as_before(engine, reference) -> None:
    image = make_image(4)
    state = engine.open_session(image)
    turn = engine.start_turn(state, PROMPTS[0], GREEDY)
    before = list(state.cache_ids)
    while turn.prefilling or len(turn.generated) < 3:  # fail in the middle of the answer
        assert not engine.step([turn])
    with fault(engine, single_decode) as fired:
        errors = step_until_error(engine, [turn])
    assert fired and list(errors) == [0]
    engine.abort_turn(turn)
    assert state.cache_ids == before and consistent(state)
    assert [ask(engine, state, p) for p in PROMPTS] == reference.answers(image, PROMPTS, 8)


LONG = GenerationParams(max_new_tokens=40)  # the first answers still decode when the last starts


def batch_of_three(engine: LlavaEngine) -> tuple[list[Any], list[Any], list[Any]]:
    """Three sessions whose second answers are all decoding, in one batch."""
    images = [make_image(20 + i) for i in range(3)]
    states = [engine.open_session(image) for image in images]
    for state in states:
        ask(engine, state, PROMPTS[0])
    turns = [engine.start_turn(s, PROMPTS[1 + i % 2], LONG) for i, s in enumerate(states)]
    while any(t.prefilling for t in turns):  # prefills are chunked, one after another
        assert not engine.step(turns)
    assert not any(t.done for t in turns)
    return images, states, turns


def expected(reference: Reference, image: Any, i: int) -> list[str]:
    [first] = reference.answers(image, PROMPTS[:1], 8)
    messages = reference.messages(None, [(PROMPTS[0], first)], PROMPTS[1 + i % 2])
    return [first, reference.answer([image], messages, 40)]


def test_a_fault_in_a_batched_decode_changes_no_answer_in_the_batch(engine, reference) -> None:
    images, states, turns = batch_of_three(engine)
    failures = engine.runner.decoder.stack_failures
    with fault(engine, batched_decode) as fired:
        errors = step_until_error(engine, turns)  # the batch is retried one answer at a time
    assert fired and not errors
    # not silent: counted (the LlavaDecodedAlone gauge, reason "failure") and logged
    assert engine.runner.decoder.stack_failures > failures
    while not all(t.done for t in turns):
        assert not engine.step(turns)
    for i, (image, state, turn) in enumerate(zip(images, states, turns, strict=True)):
        engine.finish_turn(turn)
        assert consistent(state)
        assert [state.history[0].answer, turn.text] == expected(reference, image, i)


def test_a_batched_fault_that_persists_fails_one_answer_and_no_other(engine, reference) -> None:
    images, states, turns = batch_of_three(engine)
    # The batched forward fails, then so does the first answer's retry on its own.
    with fault(engine, lambda shape: shape[1] == 1, times=2) as fired:
        errors = step_until_error(engine, turns)
    assert len(fired) == 2 and list(errors) == [0]
    engine.abort_turn(turns[0])
    assert consistent(states[0]) and len(states[0].history) == 1
    while not all(t.done for t in turns[1:]):
        assert not engine.step(turns[1:])
    for i in (1, 2):
        engine.finish_turn(turns[i])
        assert [states[i].history[0].answer, turns[i].text] == expected(reference, images[i], i)
    again = engine.run_to_end(engine.start_turn(states[0], PROMPTS[1], LONG)).text
    assert [states[0].history[0].answer, again] == expected(reference, images[0], 0)


def packed_step(shape: torch.Size) -> bool:
    """A forward with the three decodes and a chunk beside them (one row, several tokens)."""
    return shape[0] == 1 and shape[1] > 3


def follow_up_beside_batch(engine: LlavaEngine) -> tuple[Any, Any, list[Any]]:
    """A session's follow-up question, prefilled in chunks beside three decoding answers."""
    image = make_image(29)
    state = engine.open_session(image)
    ask(engine, state, PROMPTS[0])
    images, states, turns = batch_of_three(engine)
    follow = engine.start_turn(state, PROMPTS[1], GREEDY)
    return (image, state), (images, states), [*turns, follow]


def test_a_fault_in_a_packed_forward_changes_no_answer(engine, reference) -> None:
    (image, state), (images, states), turns = follow_up_beside_batch(engine)
    with fault(engine, packed_step) as fired:
        errors = step_until_error(engine, turns)  # its pieces are retried, each alone
    assert fired and not errors
    for turn in turns:
        engine.finish_turn(turn)
    for i in range(3):
        assert [states[i].history[0].answer, turns[i].text] == expected(reference, images[i], i)
    assert turns[3].text == reference.answers(image, PROMPTS[:2], 8)[1]


def test_a_packed_fault_that_persists_fails_only_its_culprit(engine, reference) -> None:
    (image, state), (images, states), turns = follow_up_beside_batch(engine)
    before = list(state.cache_ids)
    # The packed forward fails, then so does the chunk's retry on its own.
    with fault(engine, lambda shape: shape[0] == 1 and shape[1] > 1, times=2) as fired:
        errors = step_until_error(engine, turns)
    assert len(fired) == 2 and list(errors) == [3]
    engine.abort_turn(turns[3])
    assert state.cache_ids == before and consistent(state)
    while not all(t.done for t in turns[:3]):
        assert not engine.step(turns[:3])
    for i in range(3):
        engine.finish_turn(turns[i])
        assert [states[i].history[0].answer, turns[i].text] == expected(reference, images[i], i)
    assert ask(engine, state, PROMPTS[1]) == reference.answers(image, PROMPTS[:2], 8)[1]


# -- out of memory, through the service -----------------------------------------------------


def test_out_of_memory_frees_idle_sessions_and_retries_once(engine, reference) -> None:
    memory = TieredMemory(engine, None, None)
    store = SessionStore(memory=memory, release=lambda s, r: engine.release(s.state))
    service = SessionService(engine, store, SeededImages(), limits=engine.runner.config.limits)
    try:
        opens = [
            (f"o{i}", {"type": "open_session", "image": f"https://images.test/{30 + i}"}, {})
            for i in range(3)
        ]
        opened = serve_rows(service, opens)  # by request id (they finish in any order)
        sids = [opened[f"o{i}"][1]["session_id"] for i in range(3)]
        asked = {"type": "query", "prompt": PROMPTS[0], "max_new_tokens": 8}
        header = {"X-Amzn-SageMaker-Session-Id": sids[0]}
        oom = torch.OutOfMemoryError("CUDA out of memory (injected)")
        with fault(engine, single_decode, oom) as fired:
            status, body = serve_rows(service, [("q", asked, header)])["q"]
        assert len(fired) == 1 and status == 200
        assert body["text"] == reference.answers(make_image(30), PROMPTS[:1], 8)[0]
        idle = [store.get(sid).state.tier for sid in sids[1:]]
        assert idle == [Tier.HOST, Tier.HOST]  # moved off the device to make room

        with fault(engine, single_decode, oom, times=5) as fired:  # the retry runs out too
            status, body = serve_rows(service, [("q2", asked | {"prompt": PROMPTS[1]}, header)])[
                "q2"
            ]
        assert len(fired) == 2 and status == 503
        assert body["error"]["code"] == "out_of_device_memory"
        status, body = serve_rows(service, [("q3", asked | {"prompt": PROMPTS[1]}, header)])["q3"]
        assert body["text"] == reference.answers(make_image(30), PROMPTS[:2], 8)[1]
    finally:
        service.close()


@pytest.mark.parametrize("which", ["first", "last"])
def test_a_tier_move_that_fails_midway_leaves_the_whole_cache_where_it_was(
    engine: LlavaEngine, reference: Reference, monkeypatch: pytest.MonkeyPatch, which: str
) -> None:
    """Offloading copies layer after layer: a copy failing at any layer (out of memory) must
    not leave the session split across devices, or marked as moved; its next answer is the
    pipeline's."""
    from llava.engines.transformers.model import cache as cache_module

    image = make_image(77)
    state = engine.open_session(image)
    first = engine.run_to_end(engine.start_turn(state, "What is this?", GREEDY)).text
    before = [t.clone() for t in cache_module.cache_tensors(state.cache)]
    fail_at = 1 if which == "first" else len(before)  # a key or value buffer of each layer
    real_copy, calls = cache_module._copy, []

    def failing_copy(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        calls.append(1)
        if len(calls) == fail_at:
            raise torch.OutOfMemoryError("injected: no room for this layer")
        return real_copy(tensor, device)

    monkeypatch.setattr(cache_module, "_copy", failing_copy)
    with pytest.raises(torch.OutOfMemoryError):
        cache_module.move_cache(state.cache, torch.device("meta"))
    monkeypatch.setattr(cache_module, "_copy", real_copy)
    after = cache_module.cache_tensors(state.cache)
    assert len(calls) == fail_at and len(after) == len(before)
    assert all(
        a.device == b.device and torch.equal(a, b) for a, b in zip(after, before, strict=True)
    )
    assert state.tier is Tier.DEVICE
    follow = engine.run_to_end(engine.start_turn(state, "And the colors?", GREEDY)).text
    assert [first, follow] == reference.answers(image, ["What is this?", "And the colors?"], 8)


def test_a_row_whose_sampling_fails_fails_its_own_answer_only(
    engine: LlavaEngine, reference: Reference, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Answers decoding together share one forward; a row whose choice fails (a NaN row)
    fails its own answer, the others go on to the pipeline's answers, and the failed session
    stands at its previous turn."""
    from llava.engines.transformers.decoding import decoder as decoder_module

    images = [make_image(80 + i) for i in range(3)]
    states = [engine.open_session(image) for image in images]
    doomed = GenerationParams(max_new_tokens=8, seed=99)  # greedy: the seed only marks it
    real, picks = decoder_module.next_token, []

    def nan_row(logits: torch.Tensor, params: GenerationParams, generator: Any) -> int:
        if params is doomed:
            picks.append(1)
            if len(picks) == 3:
                raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return real(logits, params, generator)

    monkeypatch.setattr(decoder_module, "next_token", nan_row)
    turns = [
        engine.start_turn(s, "What is this?", doomed if i == 1 else GREEDY)
        for i, s in enumerate(states)
    ]
    failures: dict[int, BaseException] = {}
    while any(not t.done for i, t in enumerate(turns) if i not in failures):
        live = [i for i, t in enumerate(turns) if not t.done and i not in failures]
        errors = engine.step([turns[i] for i in live])
        failures.update({live[k]: exc for k, exc in errors.items()})
    assert list(failures) == [1] and "nan" in str(failures[1])
    engine.abort_turn(turns[1])
    monkeypatch.setattr(decoder_module, "next_token", real)
    for i in (0, 2):
        engine.finish_turn(turns[i])
        assert turns[i].text == reference.answers(images[i], ["What is this?"], 8)[0]
    again = engine.run_to_end(engine.start_turn(states[1], "What is this?", GREEDY)).text
    assert again == reference.answers(images[1], ["What is this?"], 8)[0]


@pytest.mark.parametrize("fail_at_row", [0, 2])
def test_unstacking_that_fails_at_any_row_leaves_the_batch_whole(
    engine: LlavaEngine, reference: Reference, monkeypatch: pytest.MonkeyPatch, fail_at_row: int
) -> None:
    """Out-of-memory recovery unstacks the decode batch; a copy failing at any row must not
    leave later rows without the tokens decoded while stacked. The batch stays whole, and every
    answer goes on to the pipeline's."""
    from llava.engines.transformers.decoding import batch as batch_module

    images = [make_image(90 + i) for i in range(3)]
    states = [engine.open_session(image) for image in images]
    turns = [engine.start_turn(s, "What is this?", GREEDY) for s in states]
    while not engine.runner.decoder.stacked or min(len(t.generated) for t in turns) < 3:
        assert not engine.step([t for t in turns if not t.done])
    real_row, rows_copied = batch_module._row, []

    def failing_row(tensor: torch.Tensor, row: int, start: int, stop: int) -> torch.Tensor:
        rows_copied.append(row)
        if row == fail_at_row:
            raise torch.OutOfMemoryError("injected: no room to copy this row")
        return real_row(tensor, row, start, stop)

    monkeypatch.setattr(batch_module, "_row", failing_row)
    with pytest.raises(torch.OutOfMemoryError):
        engine.free_memory()
    monkeypatch.setattr(batch_module, "_row", real_row)
    assert engine.runner.decoder.stacked  # still whole, still decoding together
    while any(not t.done for t in turns):
        assert not engine.step([t for t in turns if not t.done])
    for turn, image in zip(turns, images, strict=True):
        engine.finish_turn(turn)
        assert turn.text == reference.answers(image, ["What is this?"], 8)[0]


def test_a_long_conversation_among_short_ones_keeps_the_batch_within_its_budget(
    engine: LlavaEngine, reference: Reference, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worst mix: one long conversation decoding beside short ones would pad every row of
    the stacked batch to its length. With a batch budget, what the batch allocates (measured:
    its tensors) stays within it, the long answer decodes alone (counted), and every answer is
    still the pipeline's."""
    from llava.engines.transformers.decoding import batch as batch_module
    from llava.engines.transformers.decoding.batch import batch_bytes
    from llava.engines.transformers.model.cache import cache_tensors

    short_prompt, long_prompt = "What is this?", "Describe everything you see. " * 40
    images = [make_image(100 + i) for i in range(4)]
    states = [engine.open_session(image) for image in images]
    prompts = [short_prompt, short_prompt, short_prompt, long_prompt]
    turns = [engine.start_turn(s, p, GREEDY) for s, p in zip(states, prompts, strict=True)]
    shorts = turns[:3]
    engine.limit_batches(batch_bytes(shorts) + 1)  # room for the short ones stacked, not the long
    allocated: list[int] = []
    real_init = batch_module.DecodeBatch.__init__

    def measured(self: Any, members: list[Any]) -> None:
        real_init(self, members)
        allocated.append(sum(t.numel() * t.element_size() for t in cache_tensors(self.cache)))

    monkeypatch.setattr(batch_module.DecodeBatch, "__init__", measured)
    before = engine.runner.decoder.alone_for_room
    try:
        while any(not t.done for t in turns):
            assert not engine.step([t for t in turns if not t.done])
    finally:
        engine.limit_batches(None)
    assert allocated and max(allocated) <= batch_bytes(shorts) + 1
    assert engine.runner.decoder.alone_for_room > before
    for turn, image, prompt in zip(turns, images, prompts, strict=True):
        engine.finish_turn(turn)
        assert turn.text == reference.answers(image, [prompt], 8)[0]
