"""A paced engine: the engine contract with a step of a set time and one token per running
answer per step, so a front can be measured as if a GPU were behind it (`bench/front.py`).

Its step sleeps `step_s` (the interpreter lock released, as while a GPU computes) and gives
every unfinished answer one token of a fixed text, decoded by the kit's own detokenizer; opens
cost nothing. It lives with the benchmarks, never in the serving path, and stands in for no
test of answers: its answers are a fixed text cut to length.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llava.core.params import GenerationParams
from llava.core.tiers import Tier
from llava.engines.conversation.text import Detokenizer, answer_usage, finish_answer, show

TEXT = "The circle is red and the square is blue; the triangle sits between them. "


@dataclass(eq=False)
class PacedState:
    """A session: only its questions and answers."""

    history: list[tuple[str, str]] = field(default_factory=list)
    tier: Tier = Tier.FEATURES
    device_bytes: int = 0
    host_bytes: int = 0
    nbytes: int = 0


@dataclass(eq=False)
class PacedTurn:
    """One answer: a token per step until `max_new_tokens`."""

    state: PacedState
    prompt: str
    params: GenerationParams
    detokenizer: Detokenizer
    records: bool = True
    generated: list[int] = field(default_factory=list)
    text: str = ""
    delta: str = ""
    done: bool = False
    finish_reason: str | None = None
    started: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    finished_at: float | None = None

    def usage(self) -> dict[str, Any]:
        times = (self.started, self.first_token_at, self.finished_at)
        return {
            **answer_usage(0, 0, len(self.generated), times),
            "finish_reason": self.finish_reason,
        }


def no_preparation(image: Any, earlier: list[Any]) -> None:
    """The paced engine keeps no picture (module level: image processes pickle it)."""
    return None


class PacedEngine:
    """The engine contract at a set pace (see the module's docstring)."""

    def __init__(self, step_s: float, tokenizer: Any) -> None:
        self.step_s = step_s
        self.tokenizer = tokenizer
        self.ids: list[int] = tokenizer(TEXT * 4, add_special_tokens=False)["input_ids"]
        self.steps = 0

    # -- sessions: nothing to compute
    def image_preparer(self) -> Callable[[Any, list[Any]], Any]:
        return no_preparation

    def earlier_images(self, state: PacedState) -> list[Any]:
        return []

    def new_session(self, image: Any, system_prompt: str | None = None) -> PacedState:
        return PacedState()

    def start_open(self, state: PacedState, answer_follows: bool = False) -> PacedTurn:
        turn = self._turn(state, "", GenerationParams(max_new_tokens=1))
        turn.done, turn.finish_reason = True, "stop"
        return turn

    def replay(self, state: PacedState, history: list[tuple[str, str]]) -> None:
        state.history = list(history)

    def release(self, state: PacedState) -> None:
        state.history = []

    def rollback(self, state: PacedState) -> int:
        state.history = state.history[:-1]
        return len(state.history)

    def snapshot(self, state: PacedState, extra: dict[str, Any]) -> None:
        return None

    def resume(self, data: bytes) -> tuple[PacedState, dict[str, Any]]:
        raise ValueError("the paced engine keeps no snapshots")

    def adopt(self, state: PacedState) -> None:
        raise AssertionError("the paced engine resumes nothing")

    def offload(self, state: PacedState) -> int:
        return 0

    def drop_cache(self, state: PacedState) -> int:
        return 0

    def card(self, state: PacedState) -> int:
        return 0

    def out_of_memory(self, exc: BaseException) -> bool:
        return False

    def free_memory(self) -> None:
        """Nothing held."""

    @property
    def failure(self) -> None:
        return None

    # -- answers: one token per step each
    def start_turn(
        self,
        state: PacedState,
        prompt: str,
        params: GenerationParams,
        *,
        history: bool = True,
        image: Any = None,
    ) -> PacedTurn:
        turn = self._turn(state, prompt, params)
        turn.records = history
        return turn

    def start_chat(
        self, state: PacedState, chat: Sequence[dict[str, Any]], params: GenerationParams
    ) -> PacedTurn:
        turn = self._turn(state, "", params)
        turn.records = False
        return turn

    def held_of_chat(self, state: PacedState, chat: Sequence[dict[str, Any]]) -> tuple[int, bool]:
        return 0, False

    def fork(self, state: PacedState, length: int) -> PacedState:
        return PacedState(list(state.history))

    def step(self, turns: list[PacedTurn]) -> dict[int, BaseException]:
        """Take `step_s` (sleeping, as a front waits on a GPU), then a token for each answer."""
        running = [t for t in turns if not t.done]
        if not running:
            return {}
        if self.step_s:
            time.sleep(self.step_s)
        self.steps += 1
        for turn in running:
            turn.delta = ""
            token = self.ids[len(turn.generated) % len(self.ids)]
            turn.generated.append(token)
            if turn.first_token_at is None:
                turn.first_token_at = time.perf_counter()
            turn.detokenizer.add(token)
            show(turn, final=False)
            if len(turn.generated) >= turn.params.max_new_tokens:
                finish_answer(turn, "length")
        return {}

    def cut_short(self, turn: PacedTurn) -> None:
        finish_answer(turn, "length")

    def finish_turn(self, turn: PacedTurn) -> None:
        if turn.records and turn.prompt:
            turn.state.history.append((turn.prompt, turn.text))

    def abort_turn(self, turn: PacedTurn) -> None:
        """Nothing to undo: an answer is committed only by `finish_turn`."""

    def _turn(self, state: PacedState, prompt: str, params: GenerationParams) -> PacedTurn:
        return PacedTurn(state, prompt, params, Detokenizer(self.tokenizer))


def paced_engine(model_dir: Path, config: Any) -> tuple[Any, Any, Any, Any]:
    """What `assembly.load_engine` returns, for the paced engine at LLAVA_PACED_STEP_MS."""
    from transformers import AutoTokenizer

    from llava.sessions.memory import TieredMemory

    step_s = float(os.environ.get("LLAVA_PACED_STEP_MS", "7")) / 1000
    engine = PacedEngine(step_s, AutoTokenizer.from_pretrained(model_dir))
    return engine, TieredMemory(engine, None, None), None, None


def install() -> None:
    """Make this process's fronts load the paced engine instead of the model's."""
    from llava.fronts import assembly

    assembly.load_engine = paced_engine
