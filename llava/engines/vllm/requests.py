"""The turns in flight as vLLM requests: submit, step, route each output to its turn, stop.

Outputs come as deltas of token ids (vLLM does not detokenize them): the kit's own detokenizer
and stop-string cut make the text, so an answer reads the same on either engine, and the ids
that end an answer are the checkpoint's, as on the transformers engine.

A request with pictures is rendered (vLLM's processor run on what it has not seen) on a thread
of its own, as `vllm serve` does, so that opening a photo never holds up the streams the step
thread serves: the step thread adds each rendered request in the order they were rendered (one
rendering thread, as vLLM's own: its processor cache here and the engine core's mirror each
other only if they see the pictures in the same order). A picture vLLM has processed is sent
by its id alone, and its pixels again only if vLLM has let them go.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from llava.core.errors import EngineFailed, EngineRestarting
from llava.engines.conversation.text import finish_answer, show
from llava.engines.vllm.state import VllmTurn

RENDER_WAIT_S = 0.05  # how long an idle step waits for a rendering to finish before returning


@dataclass(eq=False)
class Rendering:
    """A request being rendered: its turn, the engine it is for, and vLLM's input to come."""

    turn: VllmTurn
    llm: Any
    sampling: Any
    refusal: Callable[[BaseException], BaseException]
    future: Future[Any]
    cancelled: bool = False
    resent: bool = False  # rendered again with every picture's pixels (vLLM had let some go)


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
        self._rendering: deque[Rendering] = deque()
        self._added: dict[str, Rendering] = {}  # what each request with pictures was, to resend
        self._renderer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllm-render")
        self.step_started: float | None = (
            None  # when the step in progress began (a watchdog reads it)
        )

    @property
    def max_model_len(self) -> int:
        return int(self.llm.model_config.max_model_len)

    def submit(self, turn: VllmTurn, refusal: Callable[[BaseException], BaseException]) -> None:
        """Add the turn's request: a text-only one at once, one with pictures once rendered
        (`refusal` turns vLLM's refusal of it, then, into the turn's error)."""
        sampling = self._sampling(turn)
        if not turn.images:
            self.llm.add_request(turn.request_id, _prompt(turn, with_pixels=False), sampling)
            self._running[turn.request_id] = turn
            return
        future = self._renderer.submit(_render, self.llm, turn)
        self._rendering.append(Rendering(turn, self.llm, sampling, refusal, future))

    def _resend(self, turn: VllmTurn) -> bool:
        """Render a turn with pictures again with every picture's pixels, once, if vLLM ended it
        with an error before its first token: what vLLM does when its engine core no longer
        holds a picture the kit sent by id (its two processor caches drifted apart; vLLM drops
        the picture from the one here and leaves the retry to its client)."""
        sent = self._added.pop(turn.request_id, None)
        if sent is None or sent.resent or turn.generated:
            return False
        turn.request_id += "-again"
        future = self._renderer.submit(_render, self.llm, turn, True)
        again = Rendering(turn, self.llm, sent.sampling, sent.refusal, future, resent=True)
        self._rendering.append(again)
        return True

    def _sampling(self, turn: VllmTurn) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = turn.params
        return SamplingParams(
            temperature=params.temperature,
            top_p=params.top_p,
            seed=params.seed,
            max_tokens=turn.max_new_tokens,
            stop_token_ids=sorted(self.eos_ids),
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
        )

    def _add_rendered(self) -> None:
        """Add, in the order they were rendered, the requests whose rendering has finished."""
        while self._rendering and self._rendering[0].future.done():
            done = self._rendering.popleft()
            turn = done.turn
            if done.llm is not self.llm:  # rendered for an engine that has died since
                turn.error = EngineRestarting("the model's engine failed during this answer")
                continue
            failed = done.future.exception()
            if failed is not None:
                turn.error = done.refusal(failed)
                continue
            rendered = done.future.result()
            self._running[turn.request_id] = turn
            try:
                self.llm.add_request(turn.request_id, rendered, done.sampling)
            except Exception as exc:
                refusal = done.refusal(exc)
                if refusal is exc:
                    raise  # no refusal (the engine died): the turn is failed with the others
                self._running.pop(turn.request_id, None)
                turn.error = refusal
                continue
            self._added[turn.request_id] = done
            if done.cancelled:  # added all the same: vLLM's caches must see every rendering
                self.abort(turn)

    def step(self) -> None:
        """Run one engine step and give each output to its turn; then take, merged into this
        step's deltas, every step's outputs the engine core made meanwhile (it steps on its own,
        in its own process: a front slower than it must not fall further behind each step).
        With nothing to step but requests being rendered, wait a moment for the first."""
        for running in self._running.values():
            running.delta = ""
        self._add_rendered()
        if not self.llm.has_unfinished_requests() and self._rendering:
            wait([self._rendering[0].future], timeout=RENDER_WAIT_S)
            self._add_rendered()
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
        service rolls the turn back, and the session stays at its last finished turn), unless
        vLLM asks for the pictures again."""
        if reason in ("abort", "error"):
            self._running.pop(turn.request_id, None)
            if reason == "error" and self._resend(turn):
                return
            self._added.pop(turn.request_id, None)
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
        """Stop a turn's request if vLLM still runs it (or once it is rendered)."""
        self._added.pop(turn.request_id, None)
        if self._running.pop(turn.request_id, None) is not None:
            self.llm.abort_request([turn.request_id])
        for rendering in self._rendering:
            if rendering.turn is turn:
                rendering.cancelled = True

    def forget(self, turn: VllmTurn) -> None:
        """Let go of a finished turn."""
        self._running.pop(turn.request_id, None)
        self._added.pop(turn.request_id, None)

    def fail_all(self, error: BaseException) -> None:
        """Fail every turn in flight or being rendered (the engine is gone: nothing to abort)."""
        for turn in [*self._running.values(), *(r.turn for r in self._rendering)]:
            turn.error = error
        self._running.clear()
        self._rendering.clear()
        self._added.clear()

    def replace(self, llm: Any) -> None:
        """Take a new engine (after the old one died)."""
        self._running.clear()
        self._rendering.clear()
        self._added.clear()
        self.llm = llm


def _prompt(turn: VllmTurn, with_pixels: bool) -> Any:
    """The turn's prompt for vLLM: its ids, its session's cache salt, and its pictures by id,
    with the pixels of each picture not yet processed (of every picture, `with_pixels`)."""
    from vllm import TokensPrompt

    prompt = TokensPrompt(prompt_token_ids=turn.ids, cache_salt=turn.state.salt)
    if turn.images:
        data = [i.pixels() if with_pixels else i.fresh for i in turn.images]
        prompt["multi_modal_data"] = {"image": data}
        prompt["multi_modal_uuids"] = {"image": [image.uuid for image in turn.images]}
    return prompt


def _render(llm: Any, turn: VllmTurn, with_pixels: bool = False) -> Any:
    """Run vLLM's processor on a turn's prompt (on the rendering thread); sending the pixels
    only of pictures vLLM has not processed, and all of them if it has let some go (or
    `with_pixels`). Only the encoded pictures are kept afterwards, whatever the outcome."""
    renderer = llm.input_processor.renderer
    by_id = not with_pixels and any(image.fresh is None for image in turn.images)
    try:
        try:
            (rendered,) = renderer.render_cmpl([_prompt(turn, with_pixels=not by_id)])
        except ValueError as exc:
            if not by_id or "Cache miss" not in str(exc):  # vLLM 0.32's words for it
                raise
            (rendered,) = renderer.render_cmpl([_prompt(turn, with_pixels=True)])
    finally:
        for image in turn.images:
            image.processed()
    return rendered
