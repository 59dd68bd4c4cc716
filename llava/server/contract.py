"""The engine contract the service relies on: every call the step loop makes, fully typed.

Pure (no torch): the service and its unit tests' fake engine depend on this, never on an
engine's module. Both engines satisfy it (`llava.engines.transformers.LlavaEngine` and
`llava.engines.vllm.VllmEngine`, checked by mypy where `fronts/assembly.py` builds them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

from llava.core.params import GenerationParams


class EngineState(Protocol):
    """A session's state as the service sees it: opaque, with a size."""

    @property
    def nbytes(self) -> int: ...


class EngineTurn(Protocol):
    """One answer being generated, as the service reads it after each step."""

    done: bool
    delta: str  # the text the last step produced
    text: str
    finish_reason: str | None

    @property
    def generated(self) -> Sequence[Any]:
        """The tokens sampled so far: empty while the prompt is still being prefilled."""
        ...

    def usage(self) -> dict[str, Any]: ...


StateT = TypeVar("StateT", bound=EngineState)
TurnT = TypeVar("TurnT", bound=EngineTurn)


class Engine(Protocol[StateT, TurnT]):
    """Open sessions, start answers, advance them one step at a time, commit or roll back."""

    def image_preparer(self) -> Callable[[Any, list[Any]], Any]:
        """Return what turns a decoded image (and the earlier images it is processed with) into
        the input `new_session` and `start_turn` take: picklable, run in image processes or
        threads, never on the step loop."""
        ...

    def earlier_images(self, state: StateT) -> list[Any]:
        """Return the images an image added to `state`'s conversation is processed with."""
        ...

    def new_session(self, image: Any, system_prompt: str | None = None) -> StateT:
        """Make a new session's state from a prepared image (None: a text-only session);
        computes nothing yet."""
        ...

    def start_open(self, state: StateT, answer_follows: bool = False) -> TurnT:
        """Return the turn that encodes and prefills a new session (stepped like an answer);
        `answer_follows`: an answer is started on it as soon as it is open (a client's first
        chat message), so an engine may leave the prefill to that answer."""
        ...

    def replay(self, state: StateT, history: list[tuple[str, str]]) -> None:
        """Give a state made by `new_session` earlier questions and answers."""
        ...

    def out_of_memory(self, exc: BaseException) -> bool:
        """Tell whether a step failed for lack of device memory (worth one retry)."""
        ...

    def free_memory(self) -> None:
        """Return the memory the engine holds between steps (stacked batches, allocator cache)."""
        ...

    @property
    def failure(self) -> str | None:
        """Why the engine can no longer serve (it failed to start again), else None: the fronts
        then report the instance unhealthy, so it is replaced."""
        ...

    def release(self, state: StateT) -> None:
        """Free a session's state."""
        ...

    def rollback(self, state: StateT) -> int:
        """Undo the last question and answer (InvalidRequest if there is none to undo); return
        the questions left."""
        ...

    def snapshot(self, state: StateT, extra: dict[str, Any]) -> Callable[[], bytes] | None:
        """Capture what rebuilds a session (cheap, on the step thread); the returned call
        serialises it with `extra` on another thread. None: this engine keeps no snapshots."""
        ...

    def resume(self, data: bytes) -> tuple[StateT, dict[str, Any]]:
        """Rebuild a session and its `extra` from a snapshot, on any thread (a reader's: the
        step loop never parses one); ValueError if it is not one of this model's."""
        ...

    def adopt(self, state: StateT) -> None:
        """Take a state `resume` built into the engine's own books, on the step thread."""
        ...

    def start_turn(
        self,
        state: StateT,
        prompt: str,
        params: GenerationParams,
        *,
        history: bool = True,
        image: Any = None,
    ) -> TurnT:
        """Prepare an answer (adding a prepared `image` to the conversation); refuse what the
        model cannot take with `InvalidRequest`."""
        ...

    def start_chat(
        self, state: StateT, chat: Sequence[dict[str, Any]], params: GenerationParams
    ) -> TurnT:
        """Prepare an answer to a client's whole conversation (messages in the chat template's
        format, after the system prompt), reusing what the session's cache holds of it."""
        ...

    def held_of_chat(self, state: StateT, chat: Sequence[dict[str, Any]]) -> tuple[int, bool]:
        """Return how many of a chat's ids the session's cache holds, and whether the chat
        carries on the session's conversation."""
        ...

    def fork(self, state: StateT, length: int) -> StateT:
        """Return a new state with `state`'s images and the first `length` ids of its cache."""
        ...

    def step(self, turns: list[TurnT]) -> dict[int, BaseException]:
        """Advance every unfinished turn once; return each failure by position."""
        ...

    def cut_short(self, turn: TurnT) -> None:
        """End an answer now with what it has generated, as if it reached its length limit."""
        ...

    def finish_turn(self, turn: TurnT) -> None:
        """Commit a finished answer to its session."""
        ...

    def abort_turn(self, turn: TurnT) -> None:
        """Roll a session back to before an unfinished answer."""
        ...
