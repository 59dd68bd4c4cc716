"""bench/paced.py, the engine bench/front.py measures the fronts over: one token per running
answer per step, every answer to its length, the kit's detokenizer making the text."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from llava.core.params import GenerationParams
from llava.tools.tiny.tokenizers import train_llama_tokenizer

# Loaded by its path: bench/ on sys.path would shadow packages with its scripts' names (ray).
_spec = importlib.util.spec_from_file_location(
    "bench_paced", Path(__file__).resolve().parents[2] / "bench" / "paced.py"
)
assert _spec is not None and _spec.loader is not None
paced = sys.modules["bench_paced"] = importlib.util.module_from_spec(_spec)  # its dataclasses
_spec.loader.exec_module(paced)
TEXT, PacedEngine = paced.TEXT, paced.PacedEngine


def test_each_step_gives_every_running_answer_one_token() -> None:
    tokenizer = train_llama_tokenizer()
    engine = PacedEngine(0.0, tokenizer)
    state = engine.new_session(None)
    turns = [engine.start_turn(state, "Q", GenerationParams(max_new_tokens=n)) for n in (2, 3, 5)]
    texts = ["", "", ""]
    for step in range(1, 6):
        running = [not turn.done for turn in turns]
        assert engine.step(turns) == {}
        for i, turn in enumerate(turns):
            assert len(turn.generated) == min(step, turn.params.max_new_tokens)
            texts[i] += turn.delta if running[i] else ""
    assert engine.steps == 5  # a step with nothing running takes no time and counts nothing
    assert engine.step(turns) == {} and engine.steps == 5
    for turn, text in zip(turns, texts, strict=True):
        assert turn.done and turn.finish_reason == "length" and turn.text == text
        assert TEXT.startswith(text.lstrip()) and text
        engine.finish_turn(turn)
    assert [q for q, _ in state.history] == ["Q", "Q", "Q"]
