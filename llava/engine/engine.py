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
from llava.core.errors import InvalidRequest
from llava.core.families import checkpoint_family
from llava.core.params import GenerationParams
from llava.core.tiers import Tier
from llava.engine.decoding.sampling import Detokenizer, make_generator
from llava.engine.model.cache import crop_to
from llava.engine.model.loading import load_model, load_processor, resolve_devices
from llava.engine.runner import ModelRunner
from llava.engine.scheduling.calibrate import calibrate
from llava.engine.selfcheck import self_check
from llava.engine.state import snapshot, tiers
from llava.engine.state.chat import Exchange, common_prefix
from llava.engine.state.imageset import EMPTY, ImagePreparer, ImageSet, PreparedImages
from llava.engine.state.session import Replica, SessionState, Turn
from llava.engine.stepping import run_step


class LlavaEngine:
    """Run LLaVA sessions: open, answer step by step, move state between memory tiers."""

    def __init__(self, processor: Any, replicas: list[Replica], config: ServerConfig) -> None:
        self.runner = ModelRunner(processor, replicas, config)
        self.fingerprint = ""  # the checkpoint's identity, for snapshots (set by `load`)

    @classmethod
    def load(cls, model_dir: str | Path, config: ServerConfig) -> LlavaEngine:
        """Load the processor and one model replica per device from a checkpoint directory."""
        model_dir = Path(model_dir)
        checkpoint_family(model_dir)
        processor = load_processor(model_dir)
        replicas = [Replica(load_model(model_dir, d, config), d) for d in resolve_devices(config)]
        engine = cls(processor, replicas, config)
        engine.fingerprint = snapshot.model_fingerprint(model_dir)
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

    def new_session(self, image: PreparedImages, system_prompt: str | None = None) -> SessionState:
        """Make a session's state from a prepared image; nothing is computed yet."""
        self._refuse_placeholder(system_prompt, "system_prompt")
        replica = min(self.runner.replicas, key=lambda r: r.sessions)
        images = self.runner.images.start(image, replica.device)
        prefix = self.runner.chat.tokenize(
            self.runner.chat.prefix_text(system_prompt), images.tokens
        )
        state = SessionState(replica, system_prompt, images, prefix)
        state.tier = Tier.FEATURES if self.runner.keeps_kv else Tier.DEVICE
        replica.sessions += 1
        return state

    @torch.inference_mode()
    def start_open(self, state: SessionState) -> Turn:
        """Return the turn that encodes a new session's image and prefills its opening.

        Stepped like an answer (in tower runs and chunks), it generates nothing; `finish_turn`
        commits it. In `pixels` mode there is nothing to compute: the turn is already done.
        """
        turn = self._new_turn(
            state, "", GenerationParams(), state.prefix_ids, [], state.images, 0, 0
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
            self._refuse_placeholder(question, "history")
        state.history = [Exchange(question, answer) for question, answer in history]

    def release(self, state: SessionState) -> None:
        """Free a session's state."""
        state.replica.sessions -= 1
        state.cache, state.cache_ids = None, []
        state.images = EMPTY

    def snapshot(self, state: SessionState, extra: dict[str, Any]) -> Callable[[], bytes] | None:
        """Capture what rebuilds a session (None in pixels mode, which keeps no features);
        the returned call serialises it, on any thread."""
        if not self.runner.keeps_kv:
            return None
        return snapshot.capture(state, self.fingerprint, extra)

    def resume(self, data: bytes) -> tuple[SessionState, dict[str, Any]]:
        """Rebuild a session from its snapshot, in the FEATURES tier; ValueError if it is not
        a snapshot of this model."""
        replica = min(self.runner.replicas, key=lambda r: r.sessions)
        state, extra = snapshot.restore(data, self.fingerprint, replica)
        replica.sessions += 1
        return state, extra

    def offload(self, state: SessionState) -> int:
        """Move a session's cache to host memory; return the device bytes freed."""
        return tiers.offload(state)

    def drop_cache(self, state: SessionState) -> int:
        """Keep only the image features of a session; return the bytes freed."""
        return tiers.drop_cache(state)

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
        conversation: Sequence[tuple[str, str]] | None = None,
    ) -> Turn:
        """Tokenize the whole conversation and find what the cache already holds of it.

        `image` adds a picture to the conversation with this question (multi-image families),
        prepared by `prepare(image, state)`.
        `conversation` replaces the session's earlier turns with the client's (a client that
        re-sends the whole chat): the cache is kept for as long as they agree.
        """
        runner = self.runner
        self._refuse_placeholder(prompt, "prompt")
        for question, _ in conversation or []:
            self._refuse_placeholder(question, "messages")
        prompt_tokens = runner.chat.count_tokens(prompt)
        if prompt_tokens > runner.config.max_prompt_tokens:
            raise InvalidRequest(
                f"prompt is {prompt_tokens} tokens, the limit is {runner.config.max_prompt_tokens}",
                field="prompt",
            )
        if image is not None and not isinstance(image, PreparedImages):  # in-process callers
            image = self.prepare(image, state)
        images, reencoded = runner.images.for_turn(
            state.images, image, history and conversation is None
        )
        added = 0 if image is None else 1
        past = state.history if history else []
        if conversation is not None:
            past = [Exchange(question, answer) for question, answer in conversation]
        text = runner.chat.render(runner.chat.messages(state.system_prompt, past, prompt, added))
        ids = runner.chat.tokenize(text, images.tokens)
        room = runner.max_context - len(ids)
        if room < 1:
            raise InvalidRequest(
                f"the conversation has reached the model's {runner.max_context}-token context; "
                'open a new session or ask with "history": false',
                field="prompt",
            )
        common = min(common_prefix(state.cache_ids, ids), len(ids) - 1) if runner.keeps_kv else 0
        if reencoded:  # the image tokens match but their features changed: recompute them
            common = min(common, ids.index(runner.image_token_id))
        turn = self._new_turn(state, prompt, params, ids, past, images, common, added, history)
        turn.max_new_tokens = min(params.max_new_tokens, room)
        return turn

    def _new_turn(
        self,
        state: SessionState,
        prompt: str,
        params: GenerationParams,
        ids: list[int],
        past: list[Exchange],
        images: ImageSet,
        common: int,
        added: int,
        history: bool = True,
    ) -> Turn:
        """Bring the session's cache back, keep its first `common` ids and plan the rest."""
        cache, found = tiers.for_turn(
            state, common, self.runner.num_layers, self.runner.keeps_kv, history
        )
        tower = self.runner.images.pending_tokens(images)
        if images.processed is not None:  # pixels mode: the tower runs for every answer
            tower = images.processed.total
        return Turn(
            state=state,
            prompt=prompt,
            params=params,
            branch=not history,
            images=images,
            added_images=added,
            past=list(past),
            cache=cache,
            start_len=common,
            ids=ids,
            fed=ids[:common],
            pending=ids[common:],
            max_new_tokens=0,
            detokenizer=Detokenizer(self.runner.tokenizer),
            generator=make_generator(params, state.replica.device),
            found_in=found,
            prefill_tokens=len(ids) - common,
            cached_tokens=common,
            tower_tokens=tower,
            features=images.features if not tower else None,
        )

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
        if not turn.opening:  # an open adds no exchange
            state.history = [*turn.past, Exchange(turn.prompt, turn.text, turn.added_images)]

    @torch.inference_mode()
    def rollback(self, state: SessionState) -> int:
        """Undo the last question and answer; return the questions left (see tiers.rollback)."""
        return tiers.rollback(state, self.runner.chat)

    @torch.inference_mode()
    def abort_turn(self, turn: Turn) -> None:
        """Drop an unfinished answer and roll the session's cache back to before it."""
        self.runner.decoder.detach(turn)
        if turn.branch or turn.cache is not turn.state.cache:
            return
        crop_to(turn.cache, turn.start_len)
        turn.state.cache_ids = turn.fed[: turn.start_len]

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

    def _refuse_placeholder(self, text: str | None, field: str) -> None:
        token = self.runner.chat.image_token
        if text and token in text:
            raise InvalidRequest(
                f"{field} contains the model's image placeholder {token!r}; "
                "send images in the image field",
                field=field,
            )


__all__ = ["LlavaEngine", "SessionState", "Tier", "Turn"]
