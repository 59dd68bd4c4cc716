"""What a step's forward allocates is bounded by what the budget reserves for it.

Measured, not assumed: the CPU allocator's own events (torch's profiler with `profile_memory`)
give each forward's peak of new bytes, which must stay within `Workspace.forward_bytes` for
chunks, decodes and packed mixes, on grouped-query (Llama, Qwen2) shapes. Then the worst mix
through the engine: a long conversation's long follow-up prefilled beside others, under a
reserve smaller than its chunk would take. Each step's measured peak stays within the reserve
and the batch budget, the chunk is cut to fit, and every answer is still the pipeline's.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import Reference, make_image, peak_bytes
from torch.nn.attention import SDPBackend, sdpa_kernel

from llava.core.config import ServerConfig
from llava.core.params import GenerationParams
from llava.engines.transformers import LlavaEngine
from llava.engines.transformers.decoding.batch import DecodeBatch
from llava.engines.transformers.model.cache import new_cache
from llava.engines.transformers.model.packed import Piece, packed_forward
from llava.engines.transformers.model.workspace import Workspace
from llava.engines.transformers.state.session import Turn

GREEDY = GenerationParams(max_new_tokens=8)
LONG = "Describe every shape, colour and corner you can see in this picture, please. " * 12
MIXES = [
    [(128, 16)],
    [(128, 300)],
    [(1000, 200)],
    [(3000, 500)],
    [(0, 700)],
    [(100, 50), (900, 1), (300, 1)],
    [(2000, 300), (500, 120), (40, 1), (40, 1)],
]


def forward_peak(engine: LlavaEngine, mix: list[tuple[int, int]]) -> int:
    """Measure one forward over `mix` ((cached tokens, new tokens) per piece), packed if several."""
    runner, replica = engine.runner, engine.runner.replicas[0]
    with torch.inference_mode():
        caches = []
        for context, _ in mix:
            cache = new_cache(runner.num_layers)
            if context:
                runner.forward(replica, cache, [5] * context, None, 0)
            caches.append(cache)
        pieces = [Piece(c, [5] * n) for c, (_, n) in zip(caches, mix, strict=True)]
        if len(pieces) == 1:
            return peak_bytes(partial(runner.forward, replica, caches[0], pieces[0].ids, None, 0))
        return peak_bytes(partial(packed_forward, replica.model, pieces, runner.image_token_id))


def kernel(name: str) -> AbstractContextManager[object]:
    """Run SDPA as it chooses ("chosen": on the CPU a fused kernel), or in its math kernel:
    what a GPU falls back to for attention no fused kernel takes, holding every score."""
    return sdpa_kernel(SDPBackend.MATH) if name == "math" else nullcontext()


@pytest.fixture(scope="module")
def grouped_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny with 8 query heads per key head (Qwen2-0.5B, OneVision's text: 7): the most a
    repeated key or an unfolded query head could cost."""
    from llava.tools.tiny import build_checkpoint
    from llava.tools.tiny.profiles import PROFILES

    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(PROFILES, "grouped", replace(PROFILES["tiny"], text_heads=8, text_kv_heads=1))
        return build_checkpoint(tmp_path_factory.mktemp("models") / "grouped", profile="grouped")


@pytest.mark.parametrize("name", ["tiny_checkpoint", "byte_level_checkpoint", "grouped_checkpoint"])
def test_every_forward_stays_within_its_bound(name: str, request: pytest.FixtureRequest) -> None:
    engine = LlavaEngine.load(Path(request.getfixturevalue(name)), ServerConfig(device="cpu"))
    workspace = engine.runner.workspace
    assert workspace.kv_heads < workspace.heads  # grouped-query: the keys are repeated
    assert not workspace.fused  # the CPU is bounded as unfused, whichever kernel SDPA picks
    ratios = []
    for mix in MIXES:
        for name in ("chosen", "math"):
            with kernel(name):
                measured = forward_peak(engine, mix)
            bound = workspace.forward_bytes(mix)
            assert measured <= bound, f"{mix}, {name}: {measured} bytes measured, bound {bound}"
            ratios.append(measured / bound)
    assert max(ratios) > 0.6  # an upper bound that some forward comes near, not a vacuous one


def decoding(engine: LlavaEngine, count: int) -> list[Turn]:
    """`count` answers decoding, every other one after a long question."""
    states = [engine.open_session(make_image(400 + i)) for i in range(count)]
    turns = [
        engine.start_turn(s, LONG if i % 2 else "What is this?", GenerationParams(max_new_tokens=6))
        for i, s in enumerate(states)
    ]
    while any(t.prefilling for t in turns):
        assert not engine.step([t for t in turns if t.prefilling])
    return turns


@pytest.mark.parametrize("name", ["chosen", "math"])
def test_a_stacked_decode_stays_within_its_bound(grouped_checkpoint: Path, name: str) -> None:
    """Answers decoding together attend as one piece, their rows padded to the longest: every
    row's scores count (not the longest row's alone), run through transformers or packed."""
    engine = LlavaEngine.load(grouped_checkpoint, ServerConfig(device="cpu"))
    runner, model = engine.runner, engine.runner.replicas[0].model
    turns = decoding(engine, 6)
    widths = [t.cache.get_seq_length() for t in turns]
    bound = runner.workspace.stacked_bytes(widths)
    with torch.inference_mode(), kernel(name):
        alone = peak_bytes(partial(DecodeBatch(turns).forward, model))
        piece = DecodeBatch(turns).piece()
        packed = peak_bytes(partial(packed_forward, model, [piece], runner.image_token_id))
    assert max(alone, packed) <= bound, (alone, packed, bound)
    assert packed <= runner.workspace.forward_bytes([(w, 1) for w in widths])
    assert name == "chosen" or max(alone, packed) > bound / 4  # not a vacuous bound


def test_a_stacked_forward_keeps_within_the_reserve(
    either_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a reserve that the short answers' stacked forward fits and not the long one's, the
    long one decodes alone (counted), each stacked forward's measured peak (SDPA's math kernel)
    stays within the reserve, and every answer is still the pipeline's."""
    from llava.engines.transformers.decoding import batch as batch_module

    engine = LlavaEngine.load(either_checkpoint, ServerConfig(device="cpu"))
    turns = decoding(engine, 4)
    shorts = [t for i, t in enumerate(turns) if i % 2 == 0]
    reserve = engine.runner.workspace.stacked_bytes([t.cache.get_seq_length() + 6 for t in shorts])
    assert reserve < engine.runner.workspace.stacked_bytes(
        [t.cache.get_seq_length() for t in turns]
    )
    peaks: list[int] = []
    real = batch_module.DecodeBatch.forward

    def measured(self: DecodeBatch, model: Any) -> torch.Tensor:
        out: list[torch.Tensor] = []
        peaks.append(peak_bytes(lambda: out.append(real(self, model))))
        return out[0]

    monkeypatch.setattr(batch_module.DecodeBatch, "forward", measured)
    engine.limit_workspace(reserve)
    before = engine.runner.decoder.alone_for_room
    with kernel("math"):
        while any(not t.done for t in turns):
            assert not engine.step([t for t in turns if not t.done])
    assert peaks and max(peaks) <= reserve
    assert engine.runner.decoder.alone_for_room > before
    reference = Reference(either_checkpoint)
    for i, turn in enumerate(turns):
        engine.finish_turn(turn)
        asked = LONG if i % 2 else "What is this?"
        assert turn.text == reference.answers(make_image(400 + i), [asked], 6)[0]


def test_room_is_the_largest_chunk_within_the_reserve() -> None:
    workspace = Workspace(64, 4, 2, 16, 128, 770, 2, 4)
    beside = [(300, 1), (40, 20)]
    reserve = workspace.forward_bytes([*beside, (900, 100)])
    room = workspace.room(900, beside, reserve)
    assert room == 100 or workspace.forward_bytes([*beside, (900, room + 1)]) > reserve
    assert workspace.forward_bytes([*beside, (900, room)]) <= reserve
    assert workspace.room(900, beside, 0) == 0
    # In half precision on a GPU the fused kernels hold no scores: a chunk costs less there.
    fused = Workspace(64, 4, 2, 16, 128, 770, 2, 2, fused=True)
    assert fused.attention(4000, 500) < Workspace(64, 4, 2, 16, 128, 770, 2, 2).attention(4000, 500)


def test_the_worst_mix_stays_within_the_reserve_and_answers_as_the_pipeline(
    either_checkpoint: Any,
) -> None:
    """A conversation already hundreds of tokens long asks a long follow-up while two others
    open and answer. Unbounded, its chunk's forward takes more than the reserve; bounded, every
    step's measured peak is within the reserve plus the decode batch's budget."""
    reference = Reference(either_checkpoint)
    engine = LlavaEngine.load(either_checkpoint, ServerConfig(device="cpu", step_token_budget=512))
    images = [make_image(300 + i) for i in range(3)]
    prompts = [[LONG, LONG, LONG], ["What is this?"], [LONG]]

    def run(reserve: int | None, batch: int | None) -> tuple[list[int], list[list[str]]]:
        engine.limit_workspace(reserve)
        engine.limit_batches(batch)
        states = [engine.open_session(image) for image in images]
        for prompt in prompts[0][:-1]:  # the long conversation so far
            turn = engine.start_turn(states[0], prompt, GREEDY)
            while not turn.done:
                assert not engine.step([turn])
            engine.finish_turn(turn)
        turns = [engine.start_turn(s, p[-1], GREEDY) for s, p in zip(states, prompts, strict=True)]
        peaks = []
        while any(not t.done for t in turns):
            peaks.append(peak_bytes(partial(engine.step, [t for t in turns if not t.done])))
        for turn in turns:
            engine.finish_turn(turn)
        answers = [[e.answer for e in s.history] for s in states]
        for state in states:
            engine.release(state)
        return peaks, answers

    unbounded, expected = run(None, None)
    batch = 64 * 1024
    reserve = engine.runner.workspace.forward_bytes([(400, 48)])
    bounded, answers = run(reserve, batch)
    assert max(unbounded) > reserve + batch  # the mix needs the bound
    assert max(bounded) <= reserve + batch
    assert len(bounded) > len(unbounded)  # the long follow-up was cut into more chunks
    assert answers == expected
    for image, asked, said in zip(images, prompts, answers, strict=True):
        assert said == reference.answers(image, asked, GREEDY.max_new_tokens)
