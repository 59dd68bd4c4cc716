"""The turns in flight as vLLM requests: submit, step, route each output to its turn, stop.

Outputs come as deltas of token ids (vLLM does not detokenize them): the kit's own detokenizer
and stop-string cut make the text, so an answer reads the same on either engine, and the ids
that end an answer are the checkpoint's, as on the transformers engine.
"""

from __future__ import annotations

import time
from typing import Any

from llava.core.errors import EngineFailed
from llava.engines.conversation.text import finish_answer, show
from llava.engines.vllm.state import VllmTurn


def queued(llm: Any) -> int:
    """Count the engine core's step outputs waiting for the front (0 with an in-process core,
    which steps only when asked)."""
    waiting = getattr(llm.engine_core, "outputs_queue", None)
    return waiting.qsize() if waiting is not None else 0


class Requests:
    """Hold vLLM's engine and the turn of each request it runs."""

    def __init__(self, llm: Any, eos_ids: set[int]) -> None:
        self.llm = llm
        self.eos_ids = eos_ids
        self._running: dict[str, VllmTurn] = {}
        self.step_started: float | None = (
            None  # when the step in progress began (a watchdog reads it)
        )

    @property
    def max_model_len(self) -> int:
        return int(self.llm.model_config.max_model_len)

    def submit(self, turn: VllmTurn) -> None:
        """Add the turn's request (vLLM runs its processor here, on what it has not seen)."""
        from vllm import SamplingParams, TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        prompt = TokensPrompt(prompt_token_ids=turn.ids, cache_salt=turn.state.salt)
        if turn.images:
            prompt["multi_modal_data"] = {"image": [image.image for image in turn.images]}
            prompt["multi_modal_uuids"] = {"image": [image.uuid for image in turn.images]}
        params = turn.params
        sampling = SamplingParams(
            temperature=params.temperature,
            top_p=params.top_p,
            seed=params.seed,
            max_tokens=turn.max_new_tokens,
            stop_token_ids=sorted(self.eos_ids),
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
        )
        self.llm.add_request(turn.request_id, prompt, sampling)
        self._running[turn.request_id] = turn

    def step(self) -> None:
        """Run one engine step and give each output to its turn; then take, merged into this
        step's deltas, every step's outputs the engine core made meanwhile (it steps on its own,
        in its own process: a front slower than it must not fall further behind each step)."""
        for running in self._running.values():
            running.delta = ""
        if not self.llm.has_unfinished_requests():
            return
        self._take(self._step())
        for _ in range(queued(self.llm)):
            if not self._running:
                break
            self._take(self._step())

    def _step(self) -> Any:
        self.step_started = time.monotonic()
        try:
            return self.llm.step()
        finally:
            self.step_started = None

    def _take(self, outputs: Any) -> None:
        for output in outputs:
            turn = self._running.get(output.request_id)
            if turn is None:  # aborted meanwhile
                continue
            if output.prompt_token_ids is not None:
                turn.prompt_tokens = len(output.prompt_token_ids)
            turn.cached_tokens = output.num_cached_tokens or 0
            completion = output.outputs[0]
            self._accept(turn, list(completion.token_ids))
            if output.finished and not turn.done:
                self._ended(turn, completion.finish_reason)

    def _ended(self, turn: VllmTurn, reason: str | None) -> None:
        """End a turn vLLM finished before the kit did: at its length limit or end of answer,
        an answer; aborted or failed by vLLM itself, a failure (its text is no answer: the
        service rolls the turn back, and the session stays at its last finished turn)."""
        if reason in ("abort", "error"):
            self._running.pop(turn.request_id, None)
            turn.error = EngineFailed(
                f"the model's engine ended this answer itself ({reason}); the session is at its "
                "last finished turn: ask again"
            )
            return
        self.finish(turn, "length" if reason == "length" else "stop")

    def _accept(self, turn: VllmTurn, tokens: list[int]) -> None:
        if turn.opening:
            return
        for token in tokens:
            if turn.first_token_at is None:
                turn.first_token_at = time.perf_counter()
            if token in self.eos_ids:
                self.finish(turn, "stop")
                return
            turn.generated.append(token)
            turn.detokenizer.add(token)
            if show(turn, final=False):
                self.finish(turn, "stop")
                return
            if len(turn.generated) >= turn.max_new_tokens:
                self.finish(turn, "length")
                return

    def finish(self, turn: VllmTurn, reason: str) -> None:
        """End an answer with the text it has (vLLM stops the request if it still runs)."""
        if turn.done:
            return
        self.abort(turn)
        finish_answer(turn, reason)

    def abort(self, turn: VllmTurn) -> None:
        """Stop a turn's request if vLLM still runs it."""
        if self._running.pop(turn.request_id, None) is not None:
            self.llm.abort_request([turn.request_id])

    def forget(self, turn: VllmTurn) -> None:
        """Let go of a finished turn."""
        self._running.pop(turn.request_id, None)

    def fail_all(self, error: BaseException) -> None:
        """Fail every turn in flight (the engine is gone: nothing to abort)."""
        for turn in self._running.values():
            turn.error = error
        self._running.clear()

    def replace(self, llm: Any) -> None:
        """Take a new engine (after the old one died)."""
        self._running.clear()
        self.llm = llm
