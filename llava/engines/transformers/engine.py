"""The model engine: a llava-hf model, a KV cache per session, step-wise generation.

Opening a session runs the vision tower once and prefills the system prompt and image tokens;
each question re-renders the whole conversation with the model's chat template, tokenizes it
whole (so the ids are exactly those of transformers' own pipeline), reuses the session's cache
for the longest common prefix and prefills only the rest. Every `step()` runs what the scheduler
(`scheduler.py`) chose under the step's token budget: one token for every answer decoding
(answers on the same replica share one batched forward), vision-tower runs and prefill chunks.
A forward that fails leaves every cache as it was before it.

    engine = LlavaEngine.load("path/to/checkpoint", ServerConfig())
    state = engine.open_session(image, system_prompt=None)   # in-process: runs the open's steps
    turn = engine.start_turn(state, "What is in the picture?", GenerationParams())
    while not turn.done:
        engine.step([turn])
    engine.finish_turn(turn)         # commits the answer to the session's history

A server never blocks a step on an open: it runs `image_preparer()` in its image processes,
then calls `new_session` and `start_open`, and steps the open's turn with everyone else's.

`cache_mode="pixels"` is the reference design kept for comparison: the session keeps only the
processed image, and every question re-runs the vision tower and prefills the whole conversation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from llava.core.config import ServerConfig
from llava.core.families import checkpoint_family
from llava.core.params import GenerationParams
from llava.core.tiers import Tier
from llava.engines.checkpoint import load_processor, model_fingerprint
from llava.engines.conversation import checks
from llava.engines.conversation.chat import Exchange, Message, common_prefix
from llava.engines.transformers import turns
from llava.engines.transformers.model.cache import crop_to
from llava.engines.transformers.model.loading import load_model, resolve_devices
from llava.engines.transformers.runner import ModelRunner
from llava.engines.transformers.scheduling.calibrate import calibrate
from llava.engines.transformers.selfcheck import self_check
from llava.engines.transformers.state import snapshot, tiers
from llava.engines.transformers.state.imageset import EMPTY, ImagePreparer, PreparedImages
from llava.engines.transformers.state.session import Replica, SessionState, Turn, place
from llava.engines.transformers.stepping import run_step


class LlavaEngine:
    """Run LLaVA sessions: open, answer step by step, move state between memory tiers."""

    def __init__(self, processor: Any, replicas: list[Replica], config: ServerConfig) -> None:
        self.runner = ModelRunner(processor, replicas, config)
        self.fingerprint = ""  # the checkpoint's identity, for snapshots (set by `load`)

    @classmethod
    def load(cls, model_dir: str | Path, config: ServerConfig) -> LlavaEngine:
        """Load the processor and one model replica per device from a checkpoint directory.

        Replicas load one after another: transformers' loader sets process-wide state while it
        builds a model (the default dtype, its patched weight initialisers), which two loads
        in threads would leave wrong. Each streams its tensors straight to its own card, and
        after the first the checkpoint is read from the page cache."""
        model_dir = Path(model_dir)
        checkpoint_family(model_dir)
        processor = load_processor(model_dir)
        replicas = [Replica(load_model(model_dir, d, config), d) for d in resolve_devices(config)]
        engine = cls(processor, replicas, config)
        engine.fingerprint = model_fingerprint(model_dir)
        self_check(engine.runner)
        if not config.step_token_budget:  # 0: size it from this machine's speed, and follow it
            engine.runner.pacer = calibrate(engine.runner)
        return engine

    # -- sessions --------------------------------------------------------------------------
    def image_preparer(self) -> ImagePreparer:
        """Return what runs the processor on an image: servers run it in their image processes
        (it is picklable) or threads, never on the step loop."""
        return self.runner.images.preparer

    def earlier_images(self, state: SessionState) -> list[Any]:
        """Return the images an image added to `state`'s conversation is processed with."""
        return self.runner.images.earlier(state.images)

    def prepare(self, image: Any, state: SessionState | None = None) -> PreparedImages:
        """Run the processor on a new image (for `state`'s conversation, if it joins one)."""
        return self.runner.images.prepare(image, state.images if state is not None else None)

    def new_session(
        self, image: PreparedImages | None, system_prompt: str | None = None
    ) -> SessionState:
        """Make a session's state from a prepared image (or none); nothing is computed yet."""
        turns.refuse_placeholder(self.runner, system_prompt, "system_prompt")
        replica = place(self.runner.replicas)
        images = EMPTY if image is None else self.runner.images.start(image, replica.device)
        self.runner.images.check_count(len(images.tokens))
        chat = self.runner.chat
        prefix = chat.tokenize(chat.prefix_text(system_prompt, len(images.tokens)), images.tokens)
        state = SessionState(replica, system_prompt, images, prefix)
        state.tier = Tier.FEATURES if self.runner.keeps_kv else Tier.DEVICE
        replica.states.add(state)
        return state

    @torch.inference_mode()
    def start_open(self, state: SessionState, answer_follows: bool = False) -> Turn:
        """Return the turn that encodes a new session's image and prefills its opening.

        Stepped like an answer (in tower runs and chunks), it generates nothing; `finish_turn`
        commits it. In `pixels` mode there is nothing to compute: the turn is already done.
        """
        turn = turns.new_turn(
            self.runner, state, "", GenerationParams(), state.prefix_ids, [], state.images, 0, 0
        )
        turn.opening = True
        if not self.runner.keeps_kv:
            turn.done = True
        return turn

    def open_session(self, image: Any, system_prompt: str | None = None) -> SessionState:
        """Open a session in-process: prepare, encode and prefill at once (not for servers)."""
        state = self.new_session(self.prepare(image), system_prompt)
        try:
            self.run_to_end(self.start_open(state))
        except BaseException:
            self.release(state)
            raise
        return state

    def run_to_end(self, turn: Turn) -> Turn:
        """Step one turn until it is done and commit it (in-process use)."""
        while not turn.done:
            errors = self.step([turn])
            if errors:
                self.abort_turn(turn)
                raise errors[0]
        self.finish_turn(turn)
        return turn

    def replay(self, state: SessionState, history: list[tuple[str, str]]) -> None:
        """Give a state made by `new_session` earlier questions and answers."""
        if state.cache is not None:
            raise ValueError("replay needs a state without a cache (made by new_session)")
        for question, _ in history:
            turns.refuse_placeholder(self.runner, question, "history")
        state.history = [Exchange(question, answer) for question, answer in history]

    def release(self, state: SessionState) -> None:
        """Free a session's state."""
        state.replica.states.discard(state)
        state.cache, state.cache_ids = None, []
        state.images = EMPTY

    def snapshot(self, state: SessionState, extra: dict[str, Any]) -> Callable[[], bytes] | None:
        """Capture what rebuilds a session (None in pixels mode, which keeps no features);
        the returned call serialises it, on any thread."""
        if not self.runner.keeps_kv:
            return None
        return snapshot.capture(state, self.fingerprint, extra)

    def resume(self, data: bytes) -> tuple[SessionState, dict[str, Any]]:
        """Rebuild a session from its snapshot, in the FEATURES tier (host tensors only: on
        any thread); ValueError if it is not a snapshot of this model."""
        anywhere = self.runner.replicas[0]  # placed by `adopt`: features are on the host
        return snapshot.restore(data, self.fingerprint, anywhere, self.runner.config)

    def adopt(self, state: SessionState) -> None:
        """Place a resumed session on a replica and count it there (what places the next)."""
        state.replica = place(self.runner.replicas)
        state.replica.states.add(state)

    def offload(self, state: SessionState) -> int:
        """Move a session's cache to host memory; return the device bytes freed."""
        return tiers.offload(state)

    def drop_cache(self, state: SessionState) -> int:
        """Keep only the image features of a session; return the bytes freed."""
        return tiers.drop_cache(state)

    def card(self, state: SessionState) -> int:
        """Return which replica's device holds a session (its device budget is that card's)."""
        return self.runner.replicas.index(state.replica)

    # -- turns -----------------------------------------------------------------------------
    @torch.inference_mode()
    def start_turn(
        self,
        state: SessionState,
        prompt: str,
        params: GenerationParams,
        *,
        history: bool = True,
        image: Any = None,
    ) -> Turn:
        """Tokenize the whole conversation and find what the cache already holds of it.

        `image` adds a picture to the conversation with this question (multi-image families),
        prepared by `prepare(image, state)`.
        """
        runner = self.runner
        turns.refuse_placeholder(runner, prompt, "prompt")
        turns.check_prompt_tokens(runner, prompt, "prompt")
        if image is not None and not isinstance(image, PreparedImages):  # in-process callers
            image = self.prepare(image, state)
        images, reencoded = runner.images.for_turn(state.images, image, history)
        if not history and state.opening_images == 0:  # the question alone: no image at all
            images, reencoded = EMPTY, False
        added = 0 if image is None else 1
        past = state.history if history else []
        messages = runner.chat.messages(
            state.system_prompt, past, prompt, added, state.opening_images
        )
        rendered = runner.chat.prompt(messages, images.tokens, state.rendered if history else None)
        ids = rendered.ids
        room = turns.room_for_answer(runner, ids, "prompt")
        common = turns.reusable(runner, state, ids)
        if reencoded:  # the image tokens match but their features changed: recompute them
            common = min(common, ids.index(runner.image_token_id))
        turn = turns.new_turn(
            self.runner, state, prompt, params, ids, past, images, common, added, history
        )
        turn.max_new_tokens = min(params.max_new_tokens, room)
        turn.rendered = rendered
        return turn

    @torch.inference_mode()
    def start_chat(
        self, state: SessionState, chat: Sequence[Message], params: GenerationParams
    ) -> Turn:
        """Answer a client's whole conversation (OpenAI chat completions), rendered as sent.

        `chat` is every message after the system prompt, in the chat template's format, with
        as many image parts as the session has images. The cache is kept for as long as it
        agrees with the conversation's ids; the session's own history is left as it is.
        """
        runner = self.runner
        limit = runner.config.max_prompt_tokens
        question = checks.check_chat(runner.chat, limit, chat, len(state.images.tokens))
        rendered = runner.chat.chat_prompt(
            state.system_prompt, chat, state.images.tokens, state.rendered
        )
        ids = rendered.ids
        room = turns.room_for_answer(runner, ids, "messages")
        common = turns.reusable(runner, state, ids)
        turn = turns.new_turn(
            self.runner, state, question, params, ids, state.history, state.images, common, 0
        )
        turn.records_exchange = False
        turn.max_new_tokens = min(params.max_new_tokens, room)
        turn.rendered = rendered
        return turn

    def held_of_chat(self, state: SessionState, chat: Sequence[Message]) -> tuple[int, bool]:
        """Return how many of a chat's ids the session's cache holds, and whether the chat
        carries on the session's conversation (it holds all of it up to the last answer cue).

        A re-sent chat with one more question carries on; a side request or an edited chat
        over the same start shares a prefix only, and is answered in a `fork`."""
        if self.runner.images.keep_pixels or len(state.images.tokens) != checks.images_in(chat):
            return 0, False
        chat_prompt = self.runner.chat.chat_prompt
        ids = chat_prompt(state.system_prompt, chat, state.images.tokens, state.rendered).ids
        held = common_prefix(state.cache_ids, ids)
        return held, held >= state.prompt_len

    @torch.inference_mode()
    def fork(self, state: SessionState, length: int) -> SessionState:
        """Return a new session state with `state`'s images and the first `length` ids of its
        cache (a copy: `state` is left as it is, even mid-answer)."""
        copy = SessionState(state.replica, state.system_prompt, state.images, state.prefix_ids)
        copy.history = list(state.history)
        copy.rendered = state.rendered
        length = min(length, len(state.cache_ids))
        if state.cache is not None and length:
            copy.cache = tiers.prefix_copy(state.cache, length, self.runner.num_layers)
            copy.cache_ids = state.cache_ids[:length]
            copy.tier = state.tier
        else:
            copy.tier = Tier.FEATURES
        state.replica.states.add(copy)
        return copy

    def step(self, turns: list[Turn]) -> dict[int, BaseException]:
        """Run this step's share of every turn, as the scheduler plans it (`stepping.py`);
        return errors by position. A failing piece fails its own turn only, and leaves its
        cache as it was."""
        return run_step(self.runner, turns)

    @torch.inference_mode()
    def finish_turn(self, turn: Turn) -> None:
        """Commit a finished answer to the session's main line (branches leave no trace)."""
        self.runner.decoder.detach(turn)
        if turn.branch:
            return
        state = turn.state
        if self.runner.keeps_kv:
            state.cache_ids = turn.fed
        state.images = turn.images
        state.prompt_len = len(turn.ids)
        state.rendered = turn.rendered
        if not turn.opening and turn.records_exchange:  # an open or a client's chat adds none
            state.history = [*turn.past, Exchange(turn.prompt, turn.text, turn.added_images)]

    def cut_short(self, turn: Turn) -> None:
        """End an answer now with what it has generated (finish reason "length")."""
        self.runner.decoder.cut_short(turn)

    @torch.inference_mode()
    def rollback(self, state: SessionState) -> int:
        """Undo the last question and answer; return the questions left (see tiers.rollback)."""
        return tiers.rollback(state, self.runner.chat)

    @torch.inference_mode()
    def abort_turn(self, turn: Turn) -> None:
        """Drop an unfinished answer and roll the session's cache back to before it (its own
        cache, never what a stacked batch holds of it: nothing is copied, so nothing fails)."""
        self.runner.decoder.drop(turn)
        if turn.branch or turn.cache is not turn.state.cache:
            return
        crop_to(turn.cache, turn.start_len)
        turn.state.cache_ids = turn.fed[: turn.start_len]

    def limit_batches(self, budget: int | None) -> None:
        """Bound what a stacked decode batch may allocate (the device budget's reserved half);
        answers it has no room for decode alone."""
        self.runner.decoder.batch_budget = budget

    def limit_workspace(self, reserve: int | None) -> None:
        """Bound what a step's forward may allocate beyond the caches (the activation reserve
        the device budget leaves): prefill chunks are cut to fit (`workspace.py`)."""
        self.runner.decoder.workspace_reserve = reserve

    @property
    def failure(self) -> None:
        """None: this engine runs in the worker, so what kills it kills the worker, which its
        front restarts."""
        return None

    @staticmethod
    def out_of_memory(exc: BaseException) -> bool:
        """Tell a device out-of-memory error (worth a retry once memory is freed)."""
        return isinstance(exc, torch.OutOfMemoryError)

    @torch.inference_mode()
    def free_memory(self) -> None:
        """Unstack the decode batches and hand the allocator's cached blocks back."""
        self.runner.decoder.split_all()
        if any(r.device.type == "cuda" for r in self.runner.replicas):
            torch.cuda.empty_cache()


__all__ = ["LlavaEngine", "SessionState", "Tier", "Turn"]
