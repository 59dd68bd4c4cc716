"""What bounds a request and how an answer is sampled: shared by the wire format and the engine."""

from __future__ import annotations

from dataclasses import dataclass

# SageMaker caps request and response bodies at 6 MiB.
MAX_BODY_BYTES = 6 * 1024 * 1024


@dataclass(frozen=True)
class Limits:
    """Bounds a request must stay within; the engine adds the token limit of prompts."""

    max_body_bytes: int = MAX_BODY_BYTES
    max_prompt_chars: int = 16_000
    max_system_prompt_chars: int = 8_000
    max_new_tokens: int = 1024
    default_max_new_tokens: int = 256


@dataclass(frozen=True)
class GenerationParams:
    """Sampling settings of one answer; temperature 0 means greedy decoding."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()  # the answer ends before the first of these strings

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
