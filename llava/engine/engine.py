"""The model engine: LLaVA from transformers, a KV cache per session, step-wise generation.

Opening a session runs the vision tower and prefills the system prompt and image tokens once;
each question then prefills only its own new tokens on top of the session's cache and decodes
one token per `step()` call, so a server can advance many answers together and let new requests
join between steps.

    engine = LlavaEngine.load("path/to/checkpoint", ServerConfig())
    state = engine.open_session(image, system_prompt=None)
    turn = engine.start_turn(state, "What is in the picture?", GenerationParams())
    while not turn.done:
        engine.step([turn])
    engine.finish_turn(turn)         # commits the answer to the session's history
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoProcessor, DynamicCache, LlavaForConditionalGeneration

from llava.config import ServerConfig
from llava.engine.chat import ChatFormatter
from llava.engine.sampling import Detokenizer, make_generator, next_token
from llava.errors import InvalidRequest
from llava.protocol import GenerationParams

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Replica:
    """One copy of the model on one device; sessions are pinned to a replica."""

    model: Any
    device: torch.device
    sessions: int = 0


@dataclass(eq=False)
class SessionState:
    """A session's conversation as token ids and the KV cache of the ids already computed."""

    replica: Replica
    system_prompt: str | None
    token_ids: list[int]  # the main line of the conversation, image tokens expanded
    cache: DynamicCache  # keys/values of token_ids[:cached]
    prefix_len: int  # system prompt + image: where a history-free branch starts
    history: list[tuple[str, str]] = field(default_factory=list)

    @property
    def cached(self) -> int:
        return self.cache.get_seq_length()

    @property
    def nbytes(self) -> int:
        return cache_bytes(self.cache)


@dataclass(eq=False)
class Turn:
    """One answer being generated; `step()` advances it by one token."""

    state: SessionState
    prompt: str
    params: GenerationParams
    branch: bool  # history=False: answer from the image alone, leave the main line untouched
    cache: DynamicCache
    start_len: int  # cache length before this turn, to roll back on failure
    pending: list[int]  # ids to feed on the next forward
    new_ids: list[int]  # ids this turn adds to the conversation before the answer
    max_new_tokens: int
    detokenizer: Detokenizer
    generator: torch.Generator | None
    generated: list[int] = field(default_factory=list)
    text: str = ""
    delta: str = ""  # text produced by the last step
    done: bool = False
    finish_reason: str | None = None
    prefill_tokens: int = 0
    cached_tokens: int = 0
    started: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    finished_at: float | None = None

    def usage(self) -> dict[str, Any]:
        """Report token counts and timings of this answer."""
        end = self.finished_at or time.perf_counter()
        first = self.first_token_at or end
        return {
            "prefill_tokens": self.prefill_tokens,
            "cached_tokens": self.cached_tokens,
            "generated_tokens": len(self.generated),
            "ttft_ms": round((first - self.started) * 1000, 3),
            "total_ms": round((end - self.started) * 1000, 3),
            "finish_reason": self.finish_reason,
            "session_bytes": self.state.nbytes,
        }


def cache_bytes(cache: DynamicCache) -> int:
    """Count the bytes held by a cache's keys and values."""
    total = 0
    for layer in cache.layers:
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if tensor is not None:
                total += tensor.numel() * tensor.element_size()
    return total


def resolve_devices(config: ServerConfig) -> list[torch.device]:
    """List the devices to put a replica on: every visible GPU (capped), else the CPU."""
    if config.device == "cpu" or (config.device == "auto" and not torch.cuda.is_available()):
        return [torch.device("cpu")]
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
    """Run LLaVA sessions: open (vision + prefix prefill), turns (prefill + decode), release."""

    def __init__(self, processor: Any, replicas: list[Replica], config: ServerConfig) -> None:
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.replicas = replicas
        self.config = config
        self.chat = ChatFormatter(processor)
        model_config = replicas[0].model.config
        text_config = model_config.get_text_config()
        self.max_context = config.max_context_tokens or text_config.max_position_embeddings
        eos = replicas[0].model.generation_config.eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos])

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

    # -- sessions --------------------------------------------------------------------------
    @torch.inference_mode()
    def open_session(self, image: Any, system_prompt: str | None = None) -> SessionState:
        """Run the vision tower and prefill the system prompt and image into a new cache."""
        replica = min(self.replicas, key=lambda r: r.sessions)
        text = self.chat.open_text(system_prompt)
        inputs = self.processor(images=image, text=text, return_tensors="pt")
        input_ids = inputs["input_ids"].to(replica.device)
        pixel_values = inputs["pixel_values"].to(replica.device, replica.model.dtype)
        cache = DynamicCache()
        replica.model(
            input_ids=input_ids,
            pixel_values=pixel_values,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        replica.sessions += 1
        ids = input_ids[0].tolist()
        return SessionState(replica, system_prompt, ids, cache, prefix_len=len(ids))

    def release(self, state: SessionState) -> None:
        """Free a session's cache."""
        state.replica.sessions -= 1
        state.cache = DynamicCache()

    # -- turns -----------------------------------------------------------------------------
    def start_turn(
        self, state: SessionState, prompt: str, params: GenerationParams, *, history: bool = True
    ) -> Turn:
        """Tokenize a question's new text and prepare its answer; no model work yet."""
        past = state.history if history else []
        text = self.chat.turn_text(state.system_prompt, past, prompt)
        new_ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(new_ids) > self.config.max_prompt_tokens:
            raise InvalidRequest(
                f"prompt is {len(new_ids)} tokens, the limit is {self.config.max_prompt_tokens}",
                field="prompt",
            )
        if history:
            cache, base = state.cache, state.token_ids
        else:
            cache, base = (
                _prefix_copy(state.cache, state.prefix_len),
                state.token_ids[: state.prefix_len],
            )
        start_len = cache.get_seq_length()
        pending = base[start_len:] + new_ids
        room = self.max_context - len(base) - len(new_ids)
        if room < 1:
            raise InvalidRequest(
                f"the conversation has reached the model's {self.max_context}-token context; "
                'open a new session or ask with "history": false',
                field="prompt",
            )
        replica = state.replica
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
            generator=make_generator(params, replica.device),
            prefill_tokens=len(pending),
            cached_tokens=start_len,
        )

    @torch.inference_mode()
    def step(self, turns: list[Turn]) -> dict[int, BaseException]:
        """Advance every unfinished turn by one token; return errors by position."""
        errors: dict[int, BaseException] = {}
        for i, turn in enumerate(turns):
            if turn.done:
                continue
            try:
                self._advance(turn)
            except Exception as exc:  # one failing answer must not fail the others
                errors[i] = exc
        return errors

    def _advance(self, turn: Turn) -> None:
        replica = turn.state.replica
        ids = torch.tensor([turn.pending], device=replica.device)
        out = replica.model(
            input_ids=ids, past_key_values=turn.cache, use_cache=True, logits_to_keep=1
        )
        token = next_token(out.logits[0, -1], turn.params, turn.generator)
        if turn.first_token_at is None:
            turn.first_token_at = time.perf_counter()
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

    def finish_turn(self, turn: Turn) -> None:
        """Commit a finished answer to the session's main line (branches leave no trace)."""
        if turn.branch:
            return
        state = turn.state
        state.token_ids = state.token_ids + turn.new_ids + turn.generated
        state.history.append((turn.prompt, turn.text))

    def abort_turn(self, turn: Turn) -> None:
        """Drop an unfinished answer and roll the session's cache back to before it."""
        if turn.branch:
            return
        extra = turn.cache.get_seq_length() - turn.start_len
        if extra > 0:
            turn.cache.crop(-extra)


def _prefix_copy(cache: DynamicCache, length: int) -> DynamicCache:
    """Return a new cache holding the first `length` positions of `cache` (shares nothing)."""
    return DynamicCache(
        ddp_cache_data=[
            (layer.keys[..., :length, :], layer.values[..., :length, :]) for layer in cache.layers
        ]
    )
