"""`engine: vllm` where it is meant to run (`make test-gpu`): a LLaVA-1.5-7B-shaped model in bf16
on a GPU, beside the transformers engine on the same checkpoint.

Four sessions answer three turns each, their decodes batched, on both engines; every turn of
each is held to vLLM's own offline `generate` on that session's whole conversation (the oracle),
token for token up to a near-tie (bf16 kernels differ and near-flat random logits tie: the
first differing token must be among the oracle's top ones, as vLLM's own `check_logprobs_close`).
The figures (time per engine) are printed, not asserted. Without CUDA, `make test` runs the same
steps on the CPU with the tiny shape in float32 (`LLAVA_GPU_LOGIC=cpu`, in the vLLM
environment); elsewhere the module skips.
"""

from __future__ import annotations

import gc
import random
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM runs in its own environment: make test-vllm")

from conftest import Oracle, vllm_config  # noqa: E402
from gpu_setting import Setting, setting  # noqa: E402
from helpers import Reference, step_all  # noqa: E402

from llava.core.config import ServerConfig  # noqa: E402
from llava.core.params import GenerationParams  # noqa: E402
from llava.tools.tiny.scenes import draw_scene  # noqa: E402

GPU = setting()
pytestmark = pytest.mark.skipif(
    GPU is None,
    reason="no CUDA device: the GPU tests skip (LLAVA_GPU_LOGIC=cpu runs their logic here)",
)
SESSIONS = 4
PROMPTS = ["What is this?", "Which colors do you see?", "Describe it in detail."]
TOKENS = 12
# On a GPU the engine and the oracle share the card: each takes this share of its memory.
SHARE = 0.4


def picture(i: int) -> Any:
    return draw_scene(random.Random(60 + i), count=1 + i % 3).draw()


@pytest.fixture(scope="module")
def gpu() -> Setting:
    assert GPU is not None
    return GPU


@pytest.fixture(scope="module")
def checkpoint(gpu: Setting, built: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The llava-1.5-shaped checkpoint: 7B, built on the card in bf16; tiny on the CPU."""
    from llava.tools.tiny import build_checkpoint

    if gpu.device == "cpu":
        return Path(built(gpu.vllm_profile))
    root = tmp_path_factory.mktemp("gpu-vllm") / gpu.vllm_profile
    return Path(build_checkpoint(root, gpu.vllm_profile, device="cuda", dtype=gpu.dtype))


def converse(engine: Any) -> tuple[list[list[tuple[list[int], str]]], float]:
    """Open the sessions, ask every prompt of all of them together; return each session's
    answers (ids and text: nothing that holds on to the engine) and the seconds it took."""
    params = GenerationParams(max_new_tokens=TOKENS)
    started = time.perf_counter()
    states = []
    for i in range(SESSIONS):
        state = engine.new_session(engine.image_preparer()(picture(i), []))
        step_all(engine, [engine.start_open(state)])
        states.append(state)
    answered: list[list[tuple[list[int], str]]] = [[] for _ in states]
    for prompt in PROMPTS:
        turns = [engine.start_turn(state, prompt, params) for state in states]
        step_all(engine, turns)
        for i, turn in enumerate(turns):
            answered[i].append((list(turn.generated), turn.text))
    seconds = time.perf_counter() - started
    for state in states:
        engine.release(state)
    return answered, seconds


def test_both_engines_answer_as_vllms_offline_generate(gpu: Setting, checkpoint: Path) -> None:
    from llava.engines.transformers import LlavaEngine
    from llava.engines.vllm import VllmEngine

    reference = LlavaEngine.load(checkpoint, ServerConfig(device=gpu.device, dtype=gpu.dtype))
    by_engine = {"transformers": converse(reference)}
    del reference
    gc.collect()
    if gpu.device == "cuda":
        import torch

        torch.cuda.empty_cache()
    cuda = gpu.device == "cuda"  # on a card, vLLM sizes its KV cache by its share of it
    on_card: dict[str, Any] = {"gpu_memory_utilization": SHARE} if cuda else {}
    config = vllm_config(
        dtype=gpu.dtype, enforce_eager=not cuda, **on_card, **({"kv_cache_gb": 0} if cuda else {})
    )
    engine = VllmEngine.load(checkpoint, config)
    by_engine["vllm"] = converse(engine)
    sized = {"kv_cache_memory_bytes": None} if cuda else {}
    oracle = Oracle(checkpoint, dtype=gpu.dtype, **on_card, **sized)
    for name, (answered, seconds) in by_engine.items():
        print(f"\n{name}: {SESSIONS} sessions x {len(PROMPTS)} turns in {seconds:.2f} s")
        for i, turns in enumerate(answered):
            past: list[tuple[str, str]] = []
            for n, (prompt, (ids, text)) in enumerate(zip(PROMPTS, turns, strict=True)):
                assert ids, f"{name}, session {i}, turn {n + 1}: no answer"
                chat = Reference.messages(None, past, prompt)
                greedy = oracle.greedy(chat, [picture(i)], TOKENS)
                greedy.assert_close(ids, f"{name}, session {i}, turn {n + 1}")
                past.append((prompt, text))
    assert engine.stats()["restarts"] == 0
