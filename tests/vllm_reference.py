"""vLLM's own offline `generate` on a whole conversation: the `engine: vllm` oracle, with the
interface of helpers.Reference (transformers' pipeline), so one test holds either engine."""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar

from engine_under_test import VLLM_SERVER_ENV
from helpers import TOP_K, Greedy, Reference

# The servers' context and KV space (a quarter GiB: half a million tokens of a tiny profile).
MAX_MODEL_LEN = int(VLLM_SERVER_ENV["LLAVA_MAX_CONTEXT_TOKENS"])
ORACLE_KV = int(float(VLLM_SERVER_ENV["LLAVA_KV_CACHE_GB"]) * 2**30)
KEPT = 2  # offline engines kept started at once


@contextmanager
def spawned_core() -> Iterator[None]:
    """Start vLLM's engine core in a fresh (spawned) process where the test process has
    imported Flask (moto's server, Gradio): the in-process core's start-up scans every loaded
    module's globals with `hasattr`, which Werkzeug's request proxies answer with a
    RuntimeError (vLLM 0.32, `triton_utils.dispatcher._rebind_kernels`), and a forked core
    inherits those modules. Otherwise the core runs in this process and starts in seconds."""
    flask = "flask" in sys.modules or "werkzeug.local" in sys.modules
    settings = {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if flask else "0",
        "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
    }
    previous = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class VllmReference(Reference):
    """Shares nothing with the kit's session: the conversation is rendered with the processor's
    chat template and tokenized whole by the tokenizer, each picture sent under its content id
    (one placeholder each; vLLM expands it), greedy, with no prefix cache."""

    _loaded: ClassVar[dict[tuple[str, str], VllmReference]] = {}

    def __init__(self, checkpoint: Path, dtype: str = "float32", **engine: Any) -> None:
        from vllm import LLM

        from llava.engines.checkpoint import load_processor  # AutoProcessor, less any video part

        self.processor = load_processor(checkpoint)
        with spawned_core():
            self.llm = LLM(
                model=str(checkpoint),
                dtype=dtype,
                enforce_eager=True,
                max_model_len=MAX_MODEL_LEN,
                seed=0,
                enable_prefix_caching=False,
                limit_mm_per_prompt={"image": 8},
                **{"kv_cache_memory_bytes": ORACLE_KV, **engine},  # vLLM's CPU default: 0.9 of RAM
            )
        self.eos = self.processor.tokenizer.eos_token_id

    @classmethod
    def on(cls, checkpoint: Path, dtype: str = "float32") -> VllmReference:
        """The offline engine on a checkpoint, kept for the next test that asks; only the last
        two stay started (each holds its engine's memory), the others are shut down."""
        key = (str(Path(checkpoint).resolve()), dtype)
        if key not in cls._loaded:
            while len(cls._loaded) >= KEPT:
                cls._loaded.pop(next(iter(cls._loaded))).shutdown()
            cls._loaded[key] = cls(Path(checkpoint), dtype)
        cls._loaded[key] = cls._loaded.pop(key)  # the most recently used goes last
        return cls._loaded[key]

    def shutdown(self) -> None:
        """Stop the engine core (and its process) now rather than at exit."""
        self.llm.llm_engine.engine_core.shutdown()

    def request(self, images: list[Any], messages: list[dict[str, Any]]) -> dict[str, Any]:
        """The conversation as vLLM's prompt: its ids and its pictures, named by content."""
        text = self.processor.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        request: dict[str, Any] = {"prompt_token_ids": self.processor.tokenizer(text)["input_ids"]}
        if images:
            rgb = [p.convert("RGB") for p in images]
            request["multi_modal_data"] = {"image": rgb}
            request["multi_modal_uuids"] = {
                "image": ["sha256:" + hashlib.sha256(p.tobytes()).hexdigest() for p in rgb]
            }
        return request

    def sampled(
        self,
        images: list[Any],
        messages: list[dict[str, Any]],
        max_new_tokens: int,
        temperature: float,
        seed: int,
    ) -> list[int]:
        """Sample an answer from scratch with a seed; return its ids (without the end id)."""
        from vllm import SamplingParams

        sampling = SamplingParams(temperature=temperature, seed=seed, max_tokens=max_new_tokens)
        [out] = self.llm.generate([self.request(images, messages)], sampling, use_tqdm=False)
        answer = list(out.outputs[0].token_ids)
        return answer[:-1] if answer and answer[-1] == self.eos else answer

    def greedy(
        self, images: list[Any], messages: list[dict[str, Any]], max_new_tokens: int
    ) -> Greedy:
        """Answer greedily from scratch, keeping each step's most likely tokens."""
        from vllm import SamplingParams

        sampling = SamplingParams(temperature=0, max_tokens=max_new_tokens, logprobs=TOP_K)
        [out] = self.llm.generate([self.request(images, messages)], sampling, use_tqdm=False)
        answer = list(out.outputs[0].token_ids)
        top = [
            sorted(step, key=lambda t: step[t].rank)[:TOP_K]
            for step in out.outputs[0].logprobs or []
        ]
        if answer and answer[-1] == self.eos:
            answer, top = answer[:-1], top[:-1]
        text = str(self.processor.tokenizer.decode(answer, skip_special_tokens=True))
        return Greedy(answer, top, text)
