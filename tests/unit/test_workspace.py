"""What a step's forward allocates is bounded by what the budget reserves for it.

Measured, not assumed: the CPU allocator's own events (torch's profiler with `profile_memory`)
give each forward's peak of new bytes, which must stay within `Workspace.forward_bytes` for
chunks, decodes and packed mixes, on grouped-query (Llama, Qwen2) shapes. Then the worst mix
through the engine: a long conversation's long follow-up prefilled beside others, under a
reserve smaller than its chunk would take. Each step's measured peak stays within the reserve
and the batch budget, the chunk is cut to fit, and every answer is still the pipeline's.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import Reference, make_image, peak_bytes

from llava.core.config import ServerConfig
from llava.core.params import GenerationParams
from llava.engine import LlavaEngine
from llava.engine.model.cache import new_cache
from llava.engine.model.packed import Piece, packed_forward
from llava.engine.model.workspace import Workspace

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


@pytest.mark.parametrize("name", ["tiny_checkpoint", "byte_level_checkpoint"])
def test_every_forward_stays_within_its_bound(name: str, request: pytest.FixtureRequest) -> None:
    engine = LlavaEngine.load(Path(request.getfixturevalue(name)), ServerConfig(device="cpu"))
    workspace = engine.runner.workspace
    assert workspace.kv_heads < workspace.heads  # grouped-query: the keys are repeated
    ratios = []
    for mix in MIXES:
        measured = forward_peak(engine, mix)
        bound = workspace.forward_bytes(mix)
        assert measured <= bound, f"{mix}: {measured} bytes measured, bound {bound}"
        ratios.append(measured / bound)
    assert max(ratios) > 0.3  # an upper bound that some forward comes near, not a vacuous one


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
