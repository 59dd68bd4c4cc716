"""The engine in-process on the tiny checkpoint: caches, tiers and batching never change answers."""

from __future__ import annotations

from dataclasses import replace

import pytest
from helpers import Reference, assert_conversation, make_image

from llava.core.config import ServerConfig
from llava.core.errors import SessionExpired
from llava.core.params import GenerationParams
from llava.engines.transformers import LlavaEngine, Tier
from llava.engines.transformers.selfcheck import self_check
from llava.sessions.memory import TieredMemory
from llava.sessions.store import SessionStore

GREEDY = GenerationParams(max_new_tokens=10)
PROMPTS = ["What is this?", "Which colors do you see?", "Is it big?", "Why?"]


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return LlavaEngine.load(tiny_checkpoint, ServerConfig(device="cpu"))


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    return Reference(tiny_checkpoint)


def answer(engine, state, prompt, params=GREEDY, **kw):
    turn = engine.start_turn(state, prompt, params, **kw)
    while not turn.done:
        assert not engine.step([turn])
    engine.finish_turn(turn)
    return turn


def test_follow_ups_prefill_only_their_own_tokens(engine, reference):
    image = make_image(1)
    state = engine.open_session(image)
    turns = [answer(engine, state, p) for p in PROMPTS]
    assert [t.text for t in turns] == reference.answers(image, PROMPTS, 10)
    for turn in turns[1:]:
        assert turn.cached_tokens > state.prefix_len  # the image is never prefilled again
        assert turn.cached_tokens + turn.prefill_tokens == len(turn.ids)


def fed_shape(kwargs):
    """Return (batch, tokens) of what a forward was fed, as ids or as embeddings."""
    fed = kwargs.get("input_ids")
    return tuple((fed if fed is not None else kwargs["inputs_embeds"]).shape[:2])


def test_concurrent_answers_share_one_forward_per_step(tiny_checkpoint):
    # A budget that holds every prefill at once (the calibrated one spreads them over steps).
    engine = LlavaEngine.load(tiny_checkpoint, ServerConfig(device="cpu", step_token_budget=4096))
    images = [make_image(10 + i) for i in range(6)]
    prompts = [PROMPTS[i % 4] * (1 + i % 3) for i in range(6)]  # different lengths
    alone = []
    for image, prompt in zip(images, prompts, strict=True):
        alone.append(answer(engine, engine.open_session(image), prompt).generated)

    states = [engine.open_session(image) for image in images]
    turns = [engine.start_turn(s, p, GREEDY) for s, p in zip(states, prompts, strict=True)]
    calls = []
    hook = engine.runner.replicas[0].model.register_forward_hook(
        lambda module, args, kwargs, out: calls.append(fed_shape(kwargs)), with_kwargs=True
    )
    try:
        assert not engine.step(turns)  # the six prefills packed in one forward, one row
        assert calls == [(1, sum(len(t.ids) - t.cached_tokens for t in turns))]
        calls.clear()
        steps = 0
        while not all(t.done for t in turns):
            assert not engine.step(turns)
            steps += 1
    finally:
        hook.remove()
    for turn in turns:
        engine.finish_turn(turn)
    assert [t.generated for t in turns] == alone
    assert calls[0] == (6, 1)  # one batched forward for six sessions
    assert len(calls) == steps  # never more than one forward per step while all decode


def test_offloaded_and_dropped_caches_give_the_same_answers(engine, reference):
    image = make_image(2)
    state = engine.open_session(image)
    answer(engine, state, PROMPTS[0])
    assert engine.offload(state) > 0 and state.tier is Tier.HOST and state.device_bytes == 0
    second = answer(engine, state, PROMPTS[1])
    assert second.found_in is Tier.HOST and state.tier is Tier.DEVICE
    assert engine.drop_cache(state) > 0 and state.tier is Tier.FEATURES and state.cache is None
    third = answer(engine, state, PROMPTS[2])
    assert third.found_in is Tier.FEATURES and third.cached_tokens == 0
    assert third.prefill_tokens == len(third.ids)  # the whole conversation recomputed
    expected = reference.answers(image, PROMPTS[:3], 10)
    assert [answer.text for answer in (second, third)] == expected[1:]


def test_branch_without_history_leaves_the_main_line(engine, reference):
    image = make_image(3)
    state = engine.open_session(image)
    answer(engine, state, PROMPTS[0])
    ids, history = list(state.cache_ids), list(state.history)
    branch = answer(engine, state, PROMPTS[1], history=False)
    assert branch.text == reference.answers(image, [PROMPTS[1]], 10)[0]
    assert state.cache_ids == ids and state.history == history
    assert state.cached == len(ids)
    follow = answer(engine, state, PROMPTS[1])
    assert follow.text == reference.answers(image, PROMPTS[:2], 10)[1]


def test_abort_rolls_the_cache_back(engine, reference):
    image = make_image(4)
    state = engine.open_session(image)
    before = state.cached
    turn = engine.start_turn(state, "Ramble on.", GenerationParams(max_new_tokens=50))
    for _ in range(5):
        engine.step([turn])
    engine.abort_turn(turn)
    assert state.cached == before and state.history == []
    assert answer(engine, state, PROMPTS[0]).text == reference.answers(image, PROMPTS[:1], 10)[0]


def test_pixels_mode_is_the_reference_design_with_the_same_answers(tiny_checkpoint, reference):
    pixels = LlavaEngine.load(tiny_checkpoint, ServerConfig(device="cpu", cache_mode="pixels"))
    image = make_image(5)
    state = pixels.open_session(image)
    assert state.cache is None and state.images.processed is not None
    turns = [answer(pixels, state, p) for p in PROMPTS[:3]]
    assert [t.text for t in turns] == reference.answers(image, PROMPTS[:3], 10)
    assert all(t.cached_tokens == 0 for t in turns)  # everything recomputed every turn


def tiered_store(engine, device_budget, host_budget):
    return SessionStore(
        max_sessions=10,
        memory=TieredMemory(engine, device_budget, host_budget),
        release=lambda session, reason: engine.release(session.state),
    )


def test_tiered_memory_moves_idle_sessions_down_the_tiers(engine, reference):
    probe = engine.open_session(make_image(6))
    kv, features = probe.cache_bytes, probe.host_bytes
    engine.release(probe)
    assert kv > 2 * features
    store = tiered_store(engine, int(kv * 1.5), int(kv + 2.5 * features))
    images = [make_image(20 + i) for i in range(3)]
    sessions = []

    def add(image):
        state = engine.open_session(image)
        sessions.append(store.add(store.reserve(), state, state.nbytes))
        return [s.state.tier for s in sessions]

    assert add(images[0]) == [Tier.DEVICE]
    assert add(images[1]) == [Tier.HOST, Tier.DEVICE]  # over the device budget: offloaded
    assert add(images[2]) == [Tier.FEATURES, Tier.FEATURES, Tier.DEVICE]  # over the host budget
    assert sessions[0].nbytes == features  # only the image features are kept
    for session, image in zip(sessions, images, strict=True):
        found = session.state.tier
        with store.turn(session.id) as s:
            turn = answer(engine, s.state, PROMPTS[0])
        assert turn.found_in is found
        assert turn.text == reference.answers(image, PROMPTS[:1], 10)[0]


def test_past_the_host_budget_sessions_are_evicted(engine):
    probe = engine.open_session(make_image(7))
    features = probe.host_bytes
    engine.release(probe)
    store = tiered_store(engine, 1, int(1.5 * features))
    ids = []
    for i in range(3):
        state = engine.open_session(make_image(30 + i))
        ids.append(store.add(store.reserve(), state, state.nbytes).id)
    for sid in ids[:2]:
        with pytest.raises(SessionExpired, match="evicted"):
            store.get(sid)
    assert store.get(ids[2]).state is not None


def test_two_replicas_pin_sessions_to_the_least_loaded_and_batch_per_replica(
    tiny_checkpoint, engine
):
    """The multi-GPU layout, exercised on CPU: one model copy per device, sessions pinned."""
    from transformers import AutoModelForImageTextToText

    from llava.engines.transformers.state.session import Replica

    replicas = [
        Replica(AutoModelForImageTextToText.from_pretrained(tiny_checkpoint).eval(), r.device)
        for r in engine.runner.replicas * 2
    ]
    two = LlavaEngine(engine.runner.processor, replicas, ServerConfig(device="cpu"))
    images = [make_image(40 + i) for i in range(4)]
    states = [two.open_session(image) for image in images]
    assert [s.replica for s in states] == [replicas[0], replicas[1], replicas[0], replicas[1]]
    alone = [answer(engine, engine.open_session(image), PROMPTS[0]).generated for image in images]
    turns = [two.start_turn(s, PROMPTS[0], GREEDY) for s in states]
    while not all(t.done for t in turns):
        assert not two.step(turns)
    assert [t.generated for t in turns] == alone
    two.release(states[0])
    assert two.open_session(images[0]).replica is replicas[0]  # the least loaded again


def test_the_device_budget_holds_on_each_card_not_pooled(tiny_checkpoint, engine, reference):
    """Two replicas, a budget of one and a half caches per card: each card's older session
    moves to host memory, though the two cards together would hold three. Pooled, the second
    card kept two caches over its budget."""
    from transformers import AutoModelForImageTextToText

    from llava.engines.transformers.state.session import Replica

    replicas = [
        Replica(AutoModelForImageTextToText.from_pretrained(tiny_checkpoint).eval(), r.device)
        for r in engine.runner.replicas * 2
    ]
    two = LlavaEngine(engine.runner.processor, replicas, ServerConfig(device="cpu"))
    probe = two.open_session(make_image(6))
    kv = probe.cache_bytes
    two.release(probe)
    store = tiered_store(two, int(kv * 1.5), None)
    images = [make_image(50 + i) for i in range(4)]
    sessions = []
    for image in images:
        state = two.open_session(image)
        sessions.append(store.add(store.reserve(), state, state.nbytes))
    assert [two.card(s.state) for s in sessions] == [0, 1, 0, 1]
    assert [s.state.tier for s in sessions] == [Tier.HOST, Tier.HOST, Tier.DEVICE, Tier.DEVICE]
    for session, image in zip(sessions, images, strict=True):
        with store.turn(session.id) as s:
            turn = answer(two, s.state, PROMPTS[0])
        assert turn.text == reference.answers(image, PROMPTS[:1], 10)[0]


def test_a_new_session_goes_to_the_card_holding_the_fewest_bytes(tiny_checkpoint, engine):
    """One long conversation on the first card, a short one on the second: the next session
    goes to the second card, though both hold one session (by count it went to the first, whose
    budget the long one already fills); a released session's bytes no longer count."""
    from transformers import AutoModelForImageTextToText

    from llava.engines.transformers.state.session import Replica

    replicas = [
        Replica(AutoModelForImageTextToText.from_pretrained(tiny_checkpoint).eval(), r.device)
        for r in engine.runner.replicas * 2
    ]
    two = LlavaEngine(engine.runner.processor, replicas, ServerConfig(device="cpu"))
    long = two.open_session(make_image(70))
    answer(two, long, "Describe every shape and colour you see, from left to right. " * 8)
    short = two.open_session(make_image(71))
    assert [two.card(long), two.card(short)] == [0, 1]
    assert replicas[0].device_bytes > replicas[1].device_bytes > 0
    third = two.open_session(make_image(72))
    assert two.card(third) == 1
    two.release(long)
    assert replicas[0].device_bytes == 0 and replicas[0].sessions == 0
    assert two.card(two.open_session(make_image(73))) == 0


def test_bf16_session_is_the_bf16_pipeline_up_to_near_ties(tiny_checkpoint):
    """Each turn against `generate` on the same conversation (the kit's earlier answers as its
    history), token by token up to the first near-tie: bf16 rounds differently in a cached
    forward than in a whole one, and random weights give near-flat logits (exact equality held
    on torch 2.13 but not on 2.6, the image's torch, at turn 3)."""
    import torch

    bf16 = LlavaEngine.load(tiny_checkpoint, ServerConfig(device="cpu", dtype="bfloat16"))
    assert bf16.runner.replicas[0].model.dtype == torch.bfloat16
    image = make_image(8)
    state = bf16.open_session(image, "Answer briefly.")
    turns = [answer(bf16, state, p) for p in PROMPTS]
    oracle = Reference(tiny_checkpoint, dtype=torch.bfloat16)
    assert_conversation(
        oracle, image, PROMPTS, turns, GREEDY.max_new_tokens, system_prompt="Answer briefly."
    )


@pytest.mark.parametrize(
    ("capability", "expected"), [((7, 5), "float16"), ((7, 0), "float16"), ((8, 0), "bfloat16")]
)
def test_cuda_uses_bf16_only_where_the_gpu_computes_it_natively(monkeypatch, capability, expected):
    """T4 (7.5) and V100 (7.0) report bf16 support but emulate it: they get float16."""
    import torch

    from llava.engines.transformers.model import loading

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    dtype = loading.resolve_dtype(ServerConfig(), torch.device("cuda", 0))
    assert dtype == getattr(torch, expected)


def test_unsupported_model_types_are_refused_before_loading(tmp_path):
    import json

    from llava.core.families import UnsupportedModel

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_vl"}))
    with pytest.raises(UnsupportedModel, match="llava_next.*llava_onevision"):
        LlavaEngine.load(tmp_path, ServerConfig(device="cpu"))


def test_worker_start_fails_when_image_features_are_silently_ignored(engine, monkeypatch):
    """How an older LlavaModel.forward behaved: features dropped, no error, wrong answers."""
    from llava.engines.transformers.model import forward as forward_module

    def embed_without_image(model, ids, token_id, features, offset):
        import torch

        return model.get_input_embeddings()(torch.tensor([ids]))

    self_check(engine.runner)  # the real path passes
    monkeypatch.setattr(forward_module, "embed", embed_without_image)
    with pytest.raises(RuntimeError, match=r"transformers 5\.\d+.*pyproject\.toml"):
        self_check(engine.runner)


@pytest.mark.parametrize("image_processes", [0, 2])
def test_the_tower_runs_in_a_step_or_with_the_processor_and_answers_agree(
    tiny_checkpoint, reference, image_processes, monkeypatch
):
    """On a CPU with image processes, the processor's process runs the tower too (an open then
    holds no step for it); without them the tower is a piece of a step. Both give the
    pipeline's answers, and the steps feed the pacer that sizes the budget."""
    config = ServerConfig(device="cpu", image_processes=image_processes)
    engine = LlavaEngine.load(tiny_checkpoint, config)  # step_token_budget 0: calibrated
    assert engine.runner.pacer is not None
    image = make_image(3)
    state = engine.new_session(engine.prepare(image))
    opening = engine.start_open(state)
    assert (opening.tower_tokens > 0) == (image_processes == 0)
    engine.run_to_end(opening)
    pacer = engine.runner.pacer
    observed = []  # the plans of the steps whose times reached the pacer
    real_observe = pacer.observe
    monkeypatch.setattr(
        pacer,
        "observe",
        lambda plan, *a, **kw: (observed.append(plan), real_observe(plan, *a, **kw)),
    )
    turns = [answer(engine, state, p) for p in PROMPTS[:2]]
    assert [t.text for t in turns] == reference.answers(image, PROMPTS[:2], 10)
    # Every token after an answer's first is a step that only decodes, and each one was timed.
    decode_only = [p for p in observed if p.decode and not p.prefill and not p.encode]
    assert len(decode_only) == sum(len(t.generated) - 1 for t in turns)


@pytest.mark.parametrize("together", [False, True])
def test_a_generated_image_token_is_text_and_the_session_goes_on(
    engine, reference, monkeypatch, together
):
    """Sampling can pick the image token itself (at OpenAI's default temperature it happened on
    the first question of a chat client). It is fed back as text, as transformers' `generate`
    does; the answer's text leaves it out, and the next turn is the pipeline's."""
    from llava.engines.transformers.decoding import decoder as decoder_module

    image = make_image(41)
    states = [engine.open_session(image) for _ in range(2 if together else 1)]
    real = decoder_module.next_token
    picked: list[int] = []

    def first_pick_is_the_image_token(logits, params, generator):
        if len(picked) < len(states):  # each answer's second token
            picked.append(engine.runner.image_token_id)
            return engine.runner.image_token_id
        return real(logits, params, generator)

    turns = [engine.start_turn(s, "What is this?", GREEDY) for s in states]
    while any(not t.done for t in turns):  # the first tokens come from the prefill
        if all(t.generated for t in turns):
            monkeypatch.setattr(decoder_module, "next_token", first_pick_is_the_image_token)
        assert not engine.step([t for t in turns if not t.done])
    for turn in turns:
        engine.finish_turn(turn)
        assert engine.runner.image_token_id in turn.generated
        assert engine.runner.chat.image_token not in turn.text
    monkeypatch.setattr(decoder_module, "next_token", real)
    answer_1 = turns[0].text
    follow = answer(engine, states[0], "And the colors?").text
    oracle = reference.answer(
        [image], reference.messages(None, [("What is this?", answer_1)], "And the colors?"), 10
    )
    assert follow == oracle


def test_a_text_only_session_answers_and_takes_its_first_image_later(engine, reference):
    """A session may open without an image; on a single-image model its first image may come
    with any question, and every answer is the pipeline's on the same conversation."""
    state = engine.new_session(None)
    engine.run_to_end(engine.start_open(state))
    first = answer(engine, state, "Hello, who are you?").text
    assert first == reference.answer(
        [], reference.messages(None, [], "Hello, who are you?", [0]), 10
    )
    image = make_image(12)
    second = answer(engine, state, "What is in this picture?", image=image).text
    expected = reference.answer(
        [image],
        reference.messages(
            None, [("Hello, who are you?", first)], "What is in this picture?", [0, 1]
        ),
        10,
    )
    assert second == expected
    with pytest.raises(Exception, match="one image per conversation"):
        engine.start_turn(state, "And this one?", GREEDY, image=make_image(13))


def test_an_answer_that_spells_the_image_placeholder_stays_text(engine, reference):
    """Sampled piece by piece, an answer can spell the image placeholder; read back as an image
    it made every later question in the session fail (500). It stays text, and the next
    answer is the pipeline's on the conversation as the kit renders it."""
    image = make_image(14)
    state = engine.open_session(image)
    answer(engine, state, "What is this?")
    token = engine.runner.chat.image_token
    state.history[-1] = replace(state.history[-1], answer=f"A cat {token} here")
    follow = answer(engine, state, "And the colors?").text
    kept = engine.runner.chat.as_text(f"A cat {token} here")
    assert token not in kept
    messages = reference.messages(None, [("What is this?", kept)], "And the colors?")
    assert follow == reference.answer([image], messages, 10)


def test_a_client_chat_holding_the_image_placeholder_is_a_400_naming_messages(engine):
    from llava.core.errors import InvalidRequest

    state = engine.open_session(make_image(15))
    token = engine.runner.chat.image_token
    chat = (
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]},
        {"role": "assistant", "content": [{"type": "text", "text": f"see {token}"}]},
        {"role": "user", "content": [{"type": "text", "text": "And?"}]},
    )
    with pytest.raises(InvalidRequest) as info:
        engine.start_chat(state, chat, GREEDY)
    assert info.value.status == 400 and info.value.field == "messages"
