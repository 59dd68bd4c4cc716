"""The vLLM engine: the kit's sessions on vLLM's `LLMEngine` (`engine: vllm`).

A session is its conversation (`state.py`); each turn is one vLLM request with the whole
conversation's token ids, rendered and tokenized exactly as transformers' pipeline does (chat
template, BOS, one image placeholder per picture, which vLLM expands), and its pictures under
their content ids. Only what a turn adds is rendered (`conversation/incremental.py`); vLLM's
prefix cache finds the keys and values it still holds, its encoder cache the pictures' features:

    engine = VllmEngine.load("path/to/checkpoint", ServerConfig(engine="vllm"))
    state = engine.new_session(engine.image_preparer()(image, []))
    turn = engine.start_turn(state, "What is in the picture?", GenerationParams())
    while not turn.done:
        engine.step([turn])
    engine.finish_turn(turn)

Each `step()` is one `LLMEngine.step()`: every request in flight advances together, each output
goes to its turn. A dead engine core (`EngineDeadError`) fails the answers in flight (each rolled
back to its session's last finished turn) and a new engine is started on a thread; meanwhile
requests get 503 `engine_restarting`. Sessions live in the worker: none is lost.
"""

from __future__ import annotations

import itertools
import json
import logging
import re
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from llava.core.config import ServerConfig
from llava.core.errors import ContextLengthExceeded, EngineRestarting, InvalidRequest
from llava.core.families import Family, checkpoint_family
from llava.core.params import GenerationParams
from llava.core.tiers import Tier
from llava.engines.checkpoint import load_processor, model_fingerprint
from llava.engines.conversation import checks
from llava.engines.conversation.chat import ChatFormatter, Exchange, Message, common_prefix
from llava.engines.conversation.text import Detokenizer
from llava.engines.vllm import snapshot
from llava.engines.vllm.images import VllmImage, VllmImagePreparer, pictures
from llava.engines.vllm.requests import Requests
from llava.engines.vllm.starting import (
    client_errors,
    engine_dead_error,
    engine_metrics,
    release_reaper,
    start_engine,
    watch_steps,
)
from llava.engines.vllm.state import VllmSession, VllmTurn

log = logging.getLogger(__name__)

MAX_BACKOFF_S = 30.0  # the longest wait between two tries to start a dead engine again


class VllmEngine:
    """Run the kit's sessions on vLLM: open, answer step by step, commit or roll back."""

    def __init__(
        self,
        start: Callable[[], Any],
        processor: Any,
        family: Family,
        config: ServerConfig,
        eos_ids: set[int],
        fingerprint: str = "",
    ) -> None:
        self._start = start
        self.requests = Requests(start(), eos_ids)
        self.chat = ChatFormatter(processor)
        self.tokenizer = processor.tokenizer
        self.config = config
        self.fingerprint = fingerprint
        text_model = processor_text_model(self.requests.llm)
        self.multi_image = family.multi_image(text_model)
        self.max_context = self.requests.max_model_len
        self.restarts = 0
        self._failure: str | None = None
        self._restart: threading.Thread | None = None
        self._dead = engine_dead_error()
        self._refusals = client_errors()
        self._ids = itertools.count()
        if config.engine_step_timeout_s:
            watch_steps(self.requests, config.engine_step_timeout_s)

    @classmethod
    def load(cls, model_dir: str | Path, config: ServerConfig) -> VllmEngine:
        """Start vLLM on a checkpoint in llava-hf's hub layout, with its processor beside it."""
        model_dir = Path(model_dir)
        family = checkpoint_family(model_dir)
        processor = load_processor(model_dir)
        return cls(
            lambda: start_engine(model_dir, config),
            processor,
            family,
            config,
            eos_ids(model_dir, processor.tokenizer),
            model_fingerprint(model_dir),
        )

    # -- sessions --------------------------------------------------------------------------
    def image_preparer(self) -> VllmImagePreparer:
        """Return what the image processes run: RGB conversion and the content id."""
        return VllmImagePreparer()

    def earlier_images(self, state: VllmSession) -> list[Any]:
        """Return nothing: vLLM processes a conversation's pictures itself, together."""
        return []

    def new_session(self, image: Any, system_prompt: str | None = None) -> VllmSession:
        """Make a session's state from prepared pictures (or none); nothing runs yet."""
        checks.refuse_placeholder(self.chat, system_prompt, "system_prompt")
        images = () if image is None else pictures(image)
        checks.check_image_count(len(images), self.multi_image, self.config.max_images_per_session)
        return VllmSession(system_prompt, images, self._prefix(system_prompt, len(images)))

    def start_open(self, state: VllmSession, answer_follows: bool = False) -> VllmTurn:
        """Return the turn that prefills a new session's picture and opening (a one-token
        request, so vLLM's caches hold them when the first question comes). None is sent for a
        text-only session, or when an answer follows at once: its own request prefills it all,
        one vLLM request where the open would make two."""
        turn = self._turn(state, "", GenerationParams(max_new_tokens=1), state.prefix_ids)
        turn.opening = True
        if state.images and not answer_follows:
            self._submit(turn)
        else:
            turn.done = True
        return turn

    def replay(self, state: VllmSession, history: list[tuple[str, str]]) -> None:
        """Give a state made by `new_session` earlier questions and answers."""
        for question, _ in history:
            checks.refuse_placeholder(self.chat, question, "history")
        state.history = [Exchange(question, answer) for question, answer in history]

    def release(self, state: VllmSession) -> None:
        """Forget a session (vLLM's caches let its blocks go as they need room)."""
        state.images, state.ids, state.rendered = (), [], None

    def snapshot(self, state: VllmSession, extra: dict[str, Any]) -> Callable[[], bytes]:
        """Capture what rebuilds a session: its conversation and pictures."""
        return snapshot.capture(state, self.fingerprint, extra)

    def resume(self, data: bytes) -> tuple[VllmSession, dict[str, Any]]:
        """Rebuild a session from its snapshot, on any thread; ValueError if not this model's."""
        state, extra = snapshot.restore(data, self.fingerprint, self.config)
        state.prefix_ids = self._prefix(state.system_prompt, state.opening_images)
        return state, extra

    def adopt(self, state: VllmSession) -> None:
        """Nothing to count: vLLM's cache is shared by every session."""

    def offload(self, state: VllmSession) -> int:
        return 0  # nothing of a session is on the device

    def drop_cache(self, state: VllmSession) -> int:
        return 0

    def card(self, state: VllmSession) -> int:
        return 0

    # -- turns -----------------------------------------------------------------------------
    def start_turn(
        self,
        state: VllmSession,
        prompt: str,
        params: GenerationParams,
        *,
        history: bool = True,
        image: Any = None,
    ) -> VllmTurn:
        """Render the conversation's ids (from the last prompt's) and hand vLLM the request."""
        checks.refuse_placeholder(self.chat, prompt, "prompt")
        checks.check_prompt_tokens(self.chat, self.config.max_prompt_tokens, prompt, "prompt")
        images = state.images if history else state.images[: state.opening_images]
        if image is not None:
            refused = None if history else '"history": false'
            checks.check_added_image(
                len(state.images), self.multi_image, self.config.max_images_per_session, refused
            )
            images = (*images, *pictures(image))
        added = len(images) - (len(state.images) if history else state.opening_images)
        past = state.history if history else []
        messages = self.chat.messages(
            state.system_prompt, past, prompt, added, state.opening_images
        )
        held = state.rendered if history else None
        rendered = self.chat.prompt(messages, [1] * len(images), held)
        turn = self._turn(state, prompt, params, rendered.ids, images, past)
        turn.added_images, turn.branch, turn.rendered = added, not history, rendered
        self._submit(turn, "prompt")
        return turn

    def start_chat(
        self, state: VllmSession, chat: Sequence[Message], params: GenerationParams
    ) -> VllmTurn:
        """Answer a client's whole conversation (OpenAI chat completions), rendered as sent."""
        limit = self.config.max_prompt_tokens
        question = checks.check_chat(self.chat, limit, chat, len(state.images))
        rendered = self._chat_prompt(state, chat)
        turn = self._turn(state, question, params, rendered.ids, state.images, state.history)
        turn.records_exchange, turn.rendered = False, rendered
        self._submit(turn, "messages")
        return turn

    def held_of_chat(self, state: VllmSession, chat: Sequence[Message]) -> tuple[int, bool]:
        """Return how many of a chat's ids the session's last turn had, and whether the chat
        carries on its conversation (it holds all of it up to the last answer cue)."""
        if len(state.images) != checks.images_in(chat):
            return 0, False
        held = common_prefix(state.ids, self._chat_prompt(state, chat).ids)
        return held, held >= state.prompt_len

    def fork(self, state: VllmSession, length: int) -> VllmSession:
        """Return a new session with `state`'s pictures and the first `length` of its ids."""
        copy = VllmSession(state.system_prompt, state.images, state.prefix_ids, salt=state.salt)
        copy.history, copy.rendered = list(state.history), state.rendered
        copy.ids = state.ids[:length]
        return copy

    def step(self, turns: list[VllmTurn]) -> dict[int, BaseException]:
        """Run one step of vLLM's engine; return the failures of `turns` by position."""
        try:
            self.requests.step()
        except self._dead as exc:
            self._engine_died(exc)
        return {i: t.error for i, t in enumerate(turns) if t.error is not None}

    def cut_short(self, turn: VllmTurn) -> None:
        """End an answer now with what it has generated (finish reason "length")."""
        self.requests.finish(turn, "length")

    def finish_turn(self, turn: VllmTurn) -> None:
        """Commit a finished answer to its session (a branch leaves no trace)."""
        self.requests.forget(turn)
        if turn.branch:
            return
        state = turn.state
        state.ids = turn.ids + turn.generated
        state.images, state.prompt_len, state.rendered = turn.images, len(turn.ids), turn.rendered
        if not turn.opening and turn.records_exchange:
            state.history = [*turn.past, Exchange(turn.prompt, turn.text, turn.added_images)]

    def abort_turn(self, turn: VllmTurn) -> None:
        """Drop an unfinished answer: vLLM stops it; the session never saw it."""
        self.requests.abort(turn)

    def rollback(self, state: VllmSession) -> int:
        """Undo the last question and answer; return the questions left."""
        if not state.history:
            raise InvalidRequest("the session has no answered question to roll back", field="type")
        if state.history[-1].added_images:
            raise InvalidRequest(
                "the last question added an image, which cannot be rolled back; open a new "
                "session to ask it differently",
                field="type",
            )
        state.history = state.history[:-1]
        state.ids, state.prompt_len = state.ids[: state.prompt_len], 0
        return len(state.history)

    @staticmethod
    def out_of_memory(exc: BaseException) -> bool:
        return False  # vLLM keeps a request it has no room for in its queue

    def free_memory(self) -> None:
        """Nothing to free: vLLM preallocates its cache."""

    # -- internals -------------------------------------------------------------------------
    def _prefix(self, system_prompt: str | None, images: int) -> list[int]:
        return self.chat.tokenize(self.chat.prefix_text(system_prompt, images), [1] * images)

    def _chat_prompt(self, state: VllmSession, chat: Sequence[Message]) -> Any:
        images = [1] * len(state.images)
        return self.chat.chat_prompt(state.system_prompt, chat, images, state.rendered)

    def _turn(
        self,
        state: VllmSession,
        prompt: str,
        params: GenerationParams,
        ids: list[int],
        images: tuple[VllmImage, ...] | None = None,
        past: list[Exchange] | None = None,
    ) -> VllmTurn:
        return VllmTurn(
            state=state,
            request_id=f"turn-{next(self._ids)}",
            prompt=prompt,
            params=params,
            ids=list(ids),
            images=state.images if images is None else images,
            past=list(past or []),
            detokenizer=Detokenizer(self.tokenizer),
            found_in=Tier.FEATURES,
            max_new_tokens=params.max_new_tokens,
        )

    def _submit(self, turn: VllmTurn, field: str = "prompt") -> None:
        """Hand vLLM the turn's request; its refusals are the client's 400s."""
        if self._restart is not None:
            raise EngineRestarting("the model's engine is restarting after a failure")
        checks.check_image_count(
            len(turn.images), self.multi_image, self.config.max_images_per_session
        )
        try:
            self.requests.submit(turn, lambda exc: self._refusal(exc, field))
        except self._dead as exc:
            self._engine_died(exc)
            raise EngineRestarting("the model's engine is restarting after a failure") from exc
        except self._refusals as exc:
            raise refused(exc, field, self.max_context) from exc

    def _refusal(self, exc: BaseException, field: str) -> BaseException:
        """The client's 400 for vLLM's refusal of a rendered request (else what it raised)."""
        return refused(exc, field, self.max_context) if isinstance(exc, self._refusals) else exc

    def _engine_died(self, exc: BaseException) -> None:
        """Fail every answer in flight and start a new engine on a thread."""
        if self._restart is not None:
            return
        log.error("vLLM's engine core died (%s); starting a new one", exc)
        self.requests.fail_all(EngineRestarting("the model's engine failed during this answer"))
        self._restart = threading.Thread(target=self._restart_engine, name="vllm-restart")
        self._restart.start()

    def _restart_engine(self) -> None:
        """Start a new engine, after 1, 2, 4, ... s between failed tries; after
        `engine_restart_attempts` of them the engine has failed (`failure`), and requests keep
        getting 503 while the front reports the instance unhealthy."""
        old = self.requests.llm
        try:
            old.engine_core.shutdown()
        except Exception:  # it is dead already; whatever is left is freed with it
            log.debug("shutting the dead engine down failed", exc_info=True)
        release_reaper(old)  # whatever of the old core still runs is killed
        attempts = self.config.engine_restart_attempts
        for attempt in range(attempts):
            if attempt:
                delay = min(2.0 ** (attempt - 1), MAX_BACKOFF_S)
                log.warning("starting vLLM's engine again in %.0f s (try %d)", delay, attempt + 1)
                time.sleep(delay)
            try:
                self.requests.replace(self._start())
                break
            except Exception as exc:
                log.exception("starting vLLM's engine again failed")
                error = f"{type(exc).__name__}: {exc}"
        else:
            self._failure = f"vLLM's engine did not start again in {attempts} tries ({error})"
            log.critical("%s: this instance can no longer answer", self._failure)
            return
        self.restarts += 1
        self._restart = None
        log.info("vLLM's engine is back; sessions carry on from their last finished turn")

    @property
    def failure(self) -> str | None:
        """Why the engine can no longer serve (it did not start again), else None."""
        return self._failure

    def stats(self) -> dict[str, int]:
        """Return vLLM's own figures (from its Prometheus registry) and the kit's restarts."""
        return {**engine_metrics(), "restarts": self.restarts}


def refused(exc: BaseException, field: str, max_context: int) -> InvalidRequest:
    """Turn vLLM's refusal of a request into the kit's 400 (the context one, where it is)."""
    message = str(exc)
    found = re.search(r"prompt contains (\d+) input tokens|prompt \(length (\d+)\)", message)
    if found:
        tokens = int(found.group(1) or found.group(2))
        return ContextLengthExceeded(
            f"the conversation is {tokens} tokens and the model's context is {max_context}: "
            "open a new session, or shorten the conversation",
            field=field,
            limit=max_context,
            tokens=tokens,
        )
    return InvalidRequest(f"the model's engine refused the request: {message}", field=field)


def processor_text_model(llm: Any) -> str:
    """Return the checkpoint's text model type (which decides if it takes several images)."""
    config = llm.model_config.hf_config
    return str(config.get_text_config().model_type)


def eos_ids(model_dir: Path, tokenizer: Any) -> set[int]:
    """Return the ids that end an answer, as the transformers engine reads them."""
    path = model_dir / "generation_config.json"
    eos = json.loads(path.read_text()).get("eos_token_id") if path.is_file() else None
    if eos is None:
        eos = tokenizer.eos_token_id
    return set(eos if isinstance(eos, list) else [eos])
