"""The kit on its real home: 7B-shaped models in bf16 on a GPU (`make test-gpu`).

Every answer is compared with the model's own pipeline (transformers' `apply_chat_template` +
processor + `generate`) on the same device and dtype, as vLLM compares (`Greedy.assert_close`):
token for token up to the first difference, where the kit's token must be among the pipeline's
top ones (bf16 kernels differ, and near-flat random logits tie); each turn's conversation is the
one the kit had, its own earlier answers included. Without CUDA these run on the CPU with tiny
shapes when `LLAVA_GPU_LOGIC=cpu` (the test of their logic), else they skip.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from gpu_setting import Setting
from helpers import (
    Reference,
    SeededImages,
    assert_conversation,
    data_uri,
    make_image,
    peak_bytes,
    serve_rows,
    step_all,
)

from llava.api.headers import SESSION_HEADER
from llava.core.config import ServerConfig
from llava.core.params import GenerationParams
from llava.engines.transformers import LlavaEngine, Tier
from llava.engines.transformers.model.cache import OFFLOADING
from llava.fronts.torchserve.launcher import TorchServe
from llava.server.service import SessionService
from llava.sessions.memory import TieredMemory
from llava.sessions.store import SessionStore
from llava.tools.archive import build_archive

TOKENS = 12
GREEDY = GenerationParams(max_new_tokens=TOKENS)
PROMPTS = ["What is this?", "Which colors do you see?", "Describe it in detail."]
SIZES = [(640, 480), (480, 640), (800, 600), (336, 336)]


def image(i: int) -> Any:
    return make_image(40 + i, SIZES[i % len(SIZES)])


class Oracle:
    """The pipeline on the device, never beside the engine: a 7B engine and a 7B reference do
    not fit one 24 GB card together. The reference waits in host memory; for a check the
    engine's weights step out to host memory, the reference's step in, and back after."""

    def __init__(self, engine: LlavaEngine, checkpoint: Path, gpu: Setting) -> None:
        self.engine, self.device = engine, torch.device(gpu.device)
        self.reference = Reference(checkpoint, dtype=gpu.torch_dtype, device="cpu")
        self.processor = self.reference.processor

    @staticmethod
    def messages(*args: Any) -> list[dict[str, Any]]:
        return Reference.messages(*args)

    def greedy(self, images: list[Any], messages: list[dict[str, Any]], tokens: int) -> Any:
        models = [replica.model for replica in self.engine.runner.replicas]
        for model in models:
            model.to("cpu")
        self.reference.model.to(self.device)
        try:
            return self.reference.greedy(images, messages, tokens)
        finally:
            self.reference.model.to("cpu")
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            for model, replica in zip(models, self.engine.runner.replicas, strict=True):
                model.to(replica.device)


@pytest.fixture(scope="module", params=[0, 1], ids=["llava15", "second-family"])
def family(request: pytest.FixtureRequest, gpu: Setting, checkpoints: dict[str, Path]):
    """An engine and the oracle, for each of the two families."""
    checkpoint = checkpoints[gpu.profiles[request.param]]
    config = ServerConfig(device=gpu.device, dtype=gpu.dtype)
    engine = LlavaEngine.load(checkpoint, config)
    oracle = Oracle(engine, checkpoint, gpu)
    yield engine, oracle
    del engine, oracle
    if gpu.device == "cuda":
        torch.cuda.empty_cache()


def test_sessions_and_batched_decode_answer_as_the_pipeline(family) -> None:
    engine, reference = family
    states = [engine.open_session(image(i)) for i in range(4)]
    answered: list[list[Any]] = [[] for _ in states]
    for prompt in PROMPTS:
        turns = [engine.start_turn(state, prompt, GREEDY) for state in states]
        step_all(engine, turns)
        for i, turn in enumerate(turns):
            answered[i].append(turn)
    for i, state in enumerate(states):
        assert_conversation(reference, image(i), PROMPTS, answered[i], TOKENS, where=f"session {i}")
        engine.release(state)


def test_an_open_rides_the_forward_of_the_answers_decoding(family) -> None:
    # Packed steps on the device: the image's prefill chunks go in the stacked decode's forward.
    engine, reference = family
    assert engine.runner.packs  # the start-up check found a packed forward equal to the pieces' own
    long = GenerationParams(max_new_tokens=4 * TOKENS)
    states = [engine.open_session(image(i)) for i in range(2)]
    turns = [engine.start_turn(state, PROMPTS[0], long) for state in states]
    while any(turn.prefilling for turn in turns):
        assert engine.step(turns) == {}
    opened = engine.new_session(engine.prepare(image(2)))
    opening = engine.start_open(opened)
    packed = []
    hook = engine.runner.replicas[0].model.register_forward_hook(
        lambda module, args, kwargs, out: packed.append("packing" in kwargs), with_kwargs=True
    )
    try:
        while not opening.done:
            assert engine.step([*turns, opening]) == {}
    finally:
        hook.remove()
    assert any(packed) and not any(turn.done for turn in turns)
    engine.finish_turn(opening)
    step_all(engine, turns)
    for i, turn in enumerate(turns):
        assert_conversation(reference, image(i), PROMPTS[:1], [turn], 4 * TOKENS, f"answer {i}")
    follow = engine.start_turn(opened, PROMPTS[1], GREEDY)
    step_all(engine, [follow])
    assert_conversation(
        reference, image(2), PROMPTS[1:2], [follow], TOKENS, where="the opened session"
    )
    for state in [*states, opened]:
        engine.release(state)


def test_tiers_device_to_pinned_host_to_features_and_back(family, gpu: Setting) -> None:
    engine, reference = family
    state = engine.open_session(image(0))
    turns = [engine.run_to_end(engine.start_turn(state, PROMPTS[0], GREEDY))]
    engine.offload(state)
    assert state.tier is Tier.HOST and state.device_bytes == 0
    # On a GPU the copy runs on a side stream, the step not waiting; whatever reads the cache
    # next waits for it (settle).
    assert (getattr(state.cache, OFFLOADING, None) is not None) == (gpu.device == "cuda")
    keys = state.cache.layers[0].keys
    assert keys.device.type == "cpu"
    assert keys.is_pinned() == (gpu.device == "cuda")  # pinned: the copy back is asynchronous
    turns.append(engine.run_to_end(engine.start_turn(state, PROMPTS[1], GREEDY)))
    assert turns[-1].found_in is Tier.HOST
    engine.offload(state)
    engine.drop_cache(state)
    assert state.tier is Tier.FEATURES and state.cache is None
    turns.append(engine.run_to_end(engine.start_turn(state, PROMPTS[2], GREEDY)))
    assert turns[-1].found_in is Tier.FEATURES
    assert_conversation(reference, image(0), PROMPTS, turns, TOKENS, where="through the tiers")
    engine.release(state)


def step_peak(engine: LlavaEngine, turns: list[Any], device: str) -> int:
    """Run one step; return the most bytes it held at once beyond what was allocated before
    (on CUDA the allocator's peak, on the CPU its events)."""
    if device != "cuda":
        return peak_bytes(lambda: engine.step(turns))
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    assert engine.step(turns) == {}
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def test_a_step_allocates_no_more_than_the_budget_reserves(family, gpu: Setting) -> None:
    """A long conversation's long follow-up prefills beside two answers decoding, under a step
    workspace that fits a 128-token chunk: every step's allocations stay within that workspace
    and the decode batch's budget, and every answer is still the pipeline's."""
    engine, reference = family
    long = "Describe every shape, colour and corner you can see in this picture. " * 8
    states = [engine.open_session(image(i)) for i in range(3)]
    first = engine.run_to_end(engine.start_turn(states[0], long, GREEDY))
    engine.finish_turn(first)
    context = len(states[0].cache_ids)
    reserve = engine.runner.workspace.forward_bytes([(context, 128)])
    batch = 256 << 20 if gpu.device == "cuda" else 256 << 10
    engine.limit_workspace(reserve)
    engine.limit_batches(batch)
    try:
        turns = [engine.start_turn(s, PROMPTS[0], GREEDY) for s in states[1:]]
        while any(turn.prefilling for turn in turns):
            assert engine.step(turns) == {}
        turns.insert(0, engine.start_turn(states[0], long, GREEDY))
        peaks = []
        while not all(turn.done for turn in turns):
            peaks.append(step_peak(engine, [t for t in turns if not t.done], gpu.device))
        for turn in turns:
            engine.finish_turn(turn)
    finally:
        engine.limit_workspace(None)
        engine.limit_batches(None)
    assert max(peaks) <= reserve + batch, (max(peaks), reserve, batch)
    assert_conversation(reference, image(0), [long, long], [first, turns[0]], TOKENS, "long")
    for i, turn in enumerate(turns[1:], start=1):
        assert_conversation(reference, image(i), PROMPTS[:1], [turn], TOKENS, f"answer {i}")
    for state in states:
        engine.release(state)


def test_a_real_out_of_memory_error_leaves_every_session_intact(family, gpu: Setting) -> None:
    """Fill the GPU but for a sliver, ask a long question: the forward runs out of memory for
    real; the service moves idle sessions to host memory and retries; nothing is corrupted."""
    if gpu.device != "cuda":
        pytest.skip("a real CUDA out-of-memory error needs CUDA (test_step_faults injects one)")
    engine, reference = family
    store = SessionStore(memory=TieredMemory(engine, None, None), release=lambda s, r: None)
    service = SessionService(engine, store, SeededImages(image), limits=engine.runner.config.limits)
    try:
        opens = [
            (f"o{i}", {"type": "open_session", "image": f"https://images.test/{i}"}, {})
            for i in range(4)
        ]
        sids = [serve_rows(service, opens)[f"o{i}"][1]["session_id"] for i in range(4)]
        question = "Describe every detail. " * 60  # a long prefill: large activations
        header = {SESSION_HEADER: sids[0]}
        torch.cuda.synchronize()
        free, _ = torch.cuda.mem_get_info()
        blocker = torch.empty(free - (64 << 20), dtype=torch.uint8, device="cuda")
        try:
            asked = {"type": "query", "prompt": question, "max_new_tokens": TOKENS}
            status, body = serve_rows(service, [("q", asked, header)])["q"]
        finally:
            del blocker
            torch.cuda.empty_cache()
        # The retry, after the three idle sessions (about 300 MB of cache each at these shapes)
        # moved to host memory, finds room for the question's activations.
        assert status == 200, body
        idle = [store.get(sid).state.tier for sid in sids[1:]]
        assert set(idle) == {Tier.HOST}, idle  # moved off the device to make room
        # Every session, the one that ran out included, is exactly as before (plus the long
        # answer the retry got): its next answer is the pipeline's.
        for i, sid in enumerate(sids):
            asked = {"type": "query", "prompt": PROMPTS[0], "max_new_tokens": TOKENS}
            got, answer = serve_rows(service, [(f"a{i}", asked, {SESSION_HEADER: sid})])[f"a{i}"]
            assert got == 200, answer
            prompts, texts = [PROMPTS[0]], [answer["text"]]
            if i == 0:
                prompts, texts = [question, *prompts], [body["text"], *texts]
            assert_conversation(reference, image(i), prompts, texts, TOKENS, where=f"session {i}")
    finally:
        service.close()


def test_a_session_flow_through_torchserve(gpu: Setting, checkpoints, tmp_path: Path) -> None:
    if shutil.which("java") is None:
        pytest.skip("TorchServe needs Java 17 on PATH (bench/gpu_carry.sh packs a small one)")
    checkpoint = checkpoints[gpu.profiles[0]]
    build_archive(checkpoint, tmp_path / "store", name="llava")
    # This suite is the transformers engine's: `auto` would pick vLLM where it is installed.
    env = {"LLAVA_ENGINE": "transformers", "LLAVA_DEVICE": gpu.device, "LLAVA_DTYPE": gpu.dtype}
    ts = TorchServe(tmp_path / "store", "llava", workdir=tmp_path / "ts", env=env).start()
    try:
        url = ts.url("/predictions/llava")
        with httpx.Client(timeout=300) as client:
            r = client.post(url, json={"type": "open_session", "image": data_uri(image(1))})
            assert r.status_code == 200, r.text
            sid = r.json()["session_id"]
            texts = []
            for prompt in PROMPTS:
                body = {"type": "query", "prompt": prompt, "max_new_tokens": TOKENS}
                r = client.post(url, json=body, headers={SESSION_HEADER: sid})
                assert r.status_code == 200, r.text
                texts.append(r.json()["text"])
            r = client.post(url, json={"type": "close_session"}, headers={SESSION_HEADER: sid})
            assert r.status_code == 200
    finally:
        ts.stop()
    reference = Reference(checkpoint, dtype=gpu.torch_dtype, device=gpu.device)
    assert_conversation(reference, image(1), PROMPTS, texts, TOKENS, where="through TorchServe")


LOAD_AND_WATCH = """
import sys, threading, time
from pathlib import Path
import torch
from llava.core.config import ServerConfig
from llava.engines.transformers.model.loading import load_model

def anonymous() -> int:  # what the process holds of its own, not the checkpoint's mapped pages
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon")

torch.zeros(1, device="cuda")  # the CUDA context first: it is not the weights
before, peak, done = anonymous(), [0], threading.Event()

def watch() -> None:
    while not done.is_set():
        peak[0] = max(peak[0], anonymous())
        time.sleep(0.01)

threading.Thread(target=watch, daemon=True).start()
load_model(Path(sys.argv[1]), torch.device("cuda"), ServerConfig(device="cuda", dtype="bfloat16"))
done.set()
print(max(peak[0], anonymous()) - before)
"""


def test_weights_stream_to_the_card_not_through_host_memory(gpu: Setting, checkpoints) -> None:
    """A 7B model's 14 GB in bf16 must not pass whole through host memory (an ml.g5.xlarge has
    16 GB): loading one replica grows the process's own (anonymous) memory by well under the
    weights' size."""
    if gpu.device != "cuda":
        pytest.skip("on the CPU the weights are in host memory by definition")
    import subprocess
    import sys

    checkpoint = checkpoints[gpu.profiles[0]]
    weights = sum(f.stat().st_size for f in checkpoint.glob("*.safetensors"))
    out = subprocess.run(
        [sys.executable, "-c", LOAD_AND_WATCH, str(checkpoint)],
        capture_output=True,
        text=True,
        check=True,
    )
    grown = int(out.stdout.split()[-1])
    assert grown < weights / 4, f"host memory grew {grown >> 20} MiB for {weights >> 20} MiB"
