"""The model engine: LLaVA from transformers, a KV cache per session, step-wise generation.

Opening a session runs the vision tower and prefills the system prompt and image tokens once;
each question then prefills only its own new tokens on top of the session's cache, and every
`step()` advances all answers by one token: answers that are decoding on the same replica share
one batched forward pass. A server can let new requests join between steps.

    engine = LlavaEngine.load("path/to/checkpoint", ServerConfig())
    state = engine.open_session(image, system_prompt=None)
    turn = engine.start_turn(state, "What is in the picture?", GenerationParams())
    while not turn.done:
        engine.step([turn])
    engine.finish_turn(turn)         # commits the answer to the session's history

`cache_mode="pixels"` is the reference design kept for comparison: the session keeps only the
processed image, and every question re-runs the vision tower and prefills the whole conversation.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoProcessor, DynamicCache, LlavaForConditionalGeneration
from transformers.modeling_outputs import BaseModelOutputWithPooling

from llava.config import ServerConfig
from llava.engine.batch import DecodeBatch
from llava.engine.cache import assign, move_cache, new_cache
from llava.engine.chat import ChatFormatter
from llava.engine.sampling import Detokenizer, make_generator, next_token
from llava.engine.state import Replica, SessionState, Tier, Turn
from llava.errors import InvalidRequest
from llava.protocol import GenerationParams

log = logging.getLogger(__name__)

HOST = torch.device("cpu")


def resolve_devices(config: ServerConfig) -> list[torch.device]:
    """List the devices to put a replica on: every visible GPU (capped), else the CPU."""
    if config.device == "cpu" or (config.device == "auto" and not torch.cuda.is_available()):
        return [HOST]
    if not torch.cuda.is_available():
        raise RuntimeError(f"device {config.device!r} asked for but CUDA is not available")
    if config.device.startswith("cuda:"):
        return [torch.device(config.device)]
    count = torch.cuda.device_count()
    if config.max_replicas:
        count = min(count, config.max_replicas)
    return [torch.device("cuda", i) for i in range(count)]


def resolve_dtype(config: ServerConfig, device: torch.device) -> torch.dtype:
    """Pick the weights' dtype: bf16 (or fp16) on GPU, fp32 on CPU, unless configured."""
    if config.dtype != "auto":
        return getattr(torch, config.dtype)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


class LlavaEngine:
    """Run LLaVA sessions: open, answer step by step, move state between memory tiers."""

    def __init__(self, processor: Any, replicas: list[Replica], config: ServerConfig) -> None:
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.replicas = replicas
        self.config = config
        self.chat = ChatFormatter(processor)
        text_config = replicas[0].model.config.get_text_config()
        self.max_context = config.max_context_tokens or text_config.max_position_embeddings
        self.num_layers = text_config.num_hidden_layers
        eos = replicas[0].model.generation_config.eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos])
        self._batches: dict[int, DecodeBatch] = {}  # replica index -> stacked decode batch

    @classmethod
    def load(cls, model_dir: str | Path, config: ServerConfig) -> LlavaEngine:
        """Load the processor and one model replica per device from a checkpoint directory."""
        model_dir = Path(model_dir)
        if not (model_dir / "config.json").is_file():
            raise FileNotFoundError(
                f"{model_dir} has no config.json: point the archive at a LLaVA checkpoint "
                "directory (see README, 'Serving real weights')"
            )
        processor = AutoProcessor.from_pretrained(model_dir)
        replicas = []
        for device in resolve_devices(config):
            started = time.perf_counter()
            model = LlavaForConditionalGeneration.from_pretrained(
                model_dir,
                dtype=resolve_dtype(config, device),
                attn_implementation=config.attn_implementation,
            )
            model.to(device).eval()
            replicas.append(Replica(model, device))
            log.info(
                "loaded %s on %s in %.1f s", model_dir.name, device, time.perf_counter() - started
            )
        return cls(processor, replicas, config)

    @property
    def keeps_kv(self) -> bool:
        return self.config.cache_mode == "kv"

    # -- sessions --------------------------------------------------------------------------
    @torch.inference_mode()
    def open_session(
        self, image: Any, system_prompt: str | None = None, *, prefill: bool = True
    ) -> SessionState:
        """Process the image once; in kv mode also prefill the system prompt and image tokens.

        `prefill=False` keeps only the image features (a one-shot answer computes everything
        in its own first step).
        """
        replica = min(self.replicas, key=lambda r: r.sessions)
        inputs = self.processor(
            images=image, text=self.chat.open_text(system_prompt), return_tensors="pt"
        )
        ids = inputs["input_ids"][0].tolist()
        pixel_values = inputs["pixel_values"].to(replica.device, replica.model.dtype)
        if not self.keeps_kv:  # the reference design: keep the processed image on the device
            replica.sessions += 1
            return SessionState(
                replica, system_prompt, ids, len(ids), None, pixel_values=pixel_values
            )
        model = replica.model
        features = torch.cat(model.get_image_features(pixel_values=pixel_values).pooler_output)
        replica.sessions += 1
        if not prefill:
            return SessionState(
                replica, system_prompt, ids, len(ids), features.to(HOST), tier=Tier.FEATURES
            )
        cache = new_cache(self.num_layers)
        model(
            input_ids=inputs["input_ids"].to(replica.device),
            mm_encoder_outputs=_image_input(features),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return SessionState(replica, system_prompt, ids, len(ids), features.to(HOST), cache)

    def replay(self, state: SessionState, history: list[tuple[str, str]]) -> None:
        """Append past questions and answers to a state opened with `prefill=False`."""
        if state.cache is not None:
            raise ValueError("replay needs a state without a cache (open with prefill=False)")
        for question, answer in history:
            text = self.chat.turn_text(state.system_prompt, state.history, question)
            state.token_ids = state.token_ids + self._tokenize(text) + self._tokenize(answer)
            state.history.append((question, answer))

    def release(self, state: SessionState) -> None:
        """Free a session's state."""
        state.replica.sessions -= 1
        state.cache = state.pixel_values = None

    @torch.inference_mode()  # the caches are inference tensors: edit them in this mode
    def offload(self, state: SessionState) -> int:
        """Move a session's cache to host memory; return the device bytes freed."""
        if state.tier is not Tier.DEVICE or state.cache is None:
            return 0
        freed = state.device_bytes
        pin = state.replica.device.type == "cuda"
        move_cache(state.cache, HOST, pin=pin)
        state.tier = Tier.HOST
        return freed

    def drop_cache(self, state: SessionState) -> int:
        """Keep only the image features of a session; return the bytes freed."""
        freed = state.cache_bytes
        state.cache, state.tier = None, Tier.FEATURES
        return freed

    def _restore(self, state: SessionState) -> Tier:
        """Bring a session's cache back to its device (or empty, to be recomputed)."""
        found = state.tier
        if state.tier is Tier.HOST and state.cache is not None:
            move_cache(state.cache, state.replica.device)
        elif state.cache is None and self.keeps_kv:
            state.cache = new_cache(self.num_layers)
        state.tier = Tier.DEVICE
        return found

    # -- turns -----------------------------------------------------------------------------
    @torch.inference_mode()
    def start_turn(
        self, state: SessionState, prompt: str, params: GenerationParams, *, history: bool = True
    ) -> Turn:
        """Tokenize a question's new text and prepare its answer; no model work yet."""
        past = state.history if history else []
        new_ids = self._tokenize(self.chat.turn_text(state.system_prompt, past, prompt))
        if len(new_ids) > self.config.max_prompt_tokens:
            raise InvalidRequest(
                f"prompt is {len(new_ids)} tokens, the limit is {self.config.max_prompt_tokens}",
                field="prompt",
            )
        base = state.token_ids if history else state.token_ids[: state.prefix_len]
        room = self.max_context - len(base) - len(new_ids)
        if room < 1:
            raise InvalidRequest(
                f"the conversation has reached the model's {self.max_context}-token context; "
                'open a new session or ask with "history": false',
                field="prompt",
            )
        found = self._restore(state)
        if not self.keeps_kv:
            cache = new_cache(self.num_layers)
        elif history:
            cache = state.cache
        else:
            cache = self._prefix_copy(state.cache, state.prefix_len)
        start_len = cache.get_seq_length()
        pending = base[start_len:] + new_ids
        return Turn(
            state=state,
            prompt=prompt,
            params=params,
            branch=not history,
            cache=cache,
            start_len=start_len,
            pending=pending,
            new_ids=new_ids,
            max_new_tokens=min(params.max_new_tokens, room),
            detokenizer=Detokenizer(self.tokenizer),
            generator=make_generator(params, state.replica.device),
            found_in=found,
            prefill_tokens=len(pending),
            cached_tokens=start_len,
        )

    @torch.inference_mode()
    def step(self, turns: list[Turn]) -> dict[int, BaseException]:
        """Advance every unfinished turn by one token; return errors by position.

        Turns that start this step prefill alone (their lengths differ too much to batch
        well); turns already decoding share one forward per replica.
        """
        errors: dict[int, BaseException] = {}
        decoding: dict[int, list[tuple[int, Turn]]] = {}
        for i, turn in enumerate(turns):
            if turn.done:
                continue
            if turn.prefilling:
                try:
                    self._prefill(turn)
                except Exception as exc:  # one failing answer must not fail the others
                    errors[i] = exc
            else:
                decoding.setdefault(self.replicas.index(turn.state.replica), []).append((i, turn))
        for replica_idx, group in decoding.items():
            errors.update(self._decode(replica_idx, group))
        return errors

    def _prefill(self, turn: Turn) -> None:
        state, replica = turn.state, turn.state.replica
        kwargs: dict[str, Any] = {}
        if turn.start_len < state.prefix_len:  # the image tokens are not cached: supply them
            if state.pixel_values is not None:
                kwargs["pixel_values"] = state.pixel_values
            else:
                features = state.features.to(replica.device, replica.model.dtype)
                kwargs["mm_encoder_outputs"] = _image_input(features)
        out = replica.model(
            input_ids=torch.tensor([turn.pending], device=replica.device),
            past_key_values=turn.cache,
            use_cache=True,
            logits_to_keep=1,
            **kwargs,
        )
        turn.first_token_at = time.perf_counter()
        self._accept(turn, next_token(out.logits[0, -1], turn.params, turn.generator))

    def _decode(self, replica_idx: int, group: list[tuple[int, Turn]]) -> dict[int, Exception]:
        turns = [t for _, t in group]
        model = self.replicas[replica_idx].model
        batch = self._batches.get(replica_idx)
        if batch is not None and not batch.same_members(turns):
            self._split(replica_idx)
            batch = None
        try:
            if len(turns) == 1:
                logits = self._forward_one(model, turns[0])[None]
            else:
                if batch is None:
                    batch = self._batches[replica_idx] = DecodeBatch(turns)
                logits = batch.forward(model)
        except Exception:  # the shared forward failed: retry alone, so only the culprit fails
            self._split(replica_idx)
            return self._decode_alone(model, group)
        for row, turn in enumerate(turns):
            self._accept(turn, next_token(logits[row], turn.params, turn.generator))
        return {}

    def _decode_alone(self, model: Any, group: list[tuple[int, Turn]]) -> dict[int, Exception]:
        errors: dict[int, Exception] = {}
        for i, turn in group:
            try:
                logits = self._forward_one(model, turn)
                self._accept(turn, next_token(logits, turn.params, turn.generator))
            except Exception as exc:
                errors[i] = exc
        return errors

    def _forward_one(self, model: Any, turn: Turn) -> torch.Tensor:
        ids = torch.tensor([turn.pending], device=turn.state.replica.device)
        out = model(input_ids=ids, past_key_values=turn.cache, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1]

    def _accept(self, turn: Turn, token: int) -> None:
        """Record one sampled token: end the answer, or emit its text and feed it next."""
        if token in self.eos_ids:
            turn.delta = ""
            self._finish(turn, "stop")
            return
        turn.generated.append(token)
        turn.delta = turn.detokenizer.add(token)
        turn.pending = [token]
        turn.text += turn.delta
        if len(turn.generated) >= turn.max_new_tokens:
            self._finish(turn, "length")

    def _finish(self, turn: Turn, reason: str) -> None:
        turn.delta += turn.detokenizer.flush()
        turn.text = turn.detokenizer.text  # the one-shot decode of the whole answer
        turn.done, turn.finish_reason = True, reason
        turn.finished_at = time.perf_counter()

    def _split(self, replica_idx: int) -> None:
        batch = self._batches.pop(replica_idx, None)
        if batch is not None:
            batch.unstack()

    def _detach(self, turn: Turn) -> None:
        """Make sure a turn's own cache is current (it may live in a stacked batch)."""
        for replica_idx, batch in list(self._batches.items()):
            if any(t is turn for t in batch.turns):
                self._split(replica_idx)

    @torch.inference_mode()
    def finish_turn(self, turn: Turn) -> None:
        """Commit a finished answer to the session's main line (branches leave no trace)."""
        self._detach(turn)
        if turn.branch:
            return
        state = turn.state
        state.token_ids = state.token_ids + turn.new_ids + turn.generated
        state.history.append((turn.prompt, turn.text))

    @torch.inference_mode()
    def abort_turn(self, turn: Turn) -> None:
        """Drop an unfinished answer and roll the session's cache back to before it."""
        self._detach(turn)
        if turn.branch or turn.cache is not turn.state.cache:
            return
        extra = turn.cache.get_seq_length() - turn.start_len
        if extra > 0:
            turn.cache.crop(-extra)

    def _prefix_copy(self, cache: DynamicCache, length: int) -> DynamicCache:
        """Return a new cache holding the first `length` positions of `cache` (shares nothing)."""
        branch = new_cache(self.num_layers)
        if cache.get_seq_length() >= length:
            for own, layer in zip(branch.layers, cache.layers, strict=True):
                assign(own, layer.keys[..., :length, :], layer.values[..., :length, :])
        return branch

    def _tokenize(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]


def _image_input(features: torch.Tensor) -> dict[str, BaseModelOutputWithPooling]:
    """Wrap precomputed image features the way LLaVA's forward accepts them."""
    return {"image": BaseModelOutputWithPooling(pooler_output=[features])}


__all__ = ["LlavaEngine", "SessionState", "Tier", "Turn"]
