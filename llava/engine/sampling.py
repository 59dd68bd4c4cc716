"""Pick the next token and turn token ids into text deltas as they are generated."""

from __future__ import annotations

from typing import Any

import torch

from llava.protocol import GenerationParams


def make_generator(params: GenerationParams, device: torch.device) -> torch.Generator | None:
    """Return a seeded generator for sampled answers (None for greedy or unseeded)."""
    if params.greedy or params.seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(params.seed)
    return generator


def next_token(
    logits: torch.Tensor, params: GenerationParams, generator: torch.Generator | None
) -> int:
    """Choose the next token from one row of logits: argmax, or temperature + nucleus sampling."""
    if params.greedy:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest set whose mass reaches top_p (always at least the top token).
        outside = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= params.top_p
        sorted_probs[outside] = 0.0
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))


class Detokenizer:
    """Decode generated ids incrementally, never emitting half a multi-byte character."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # start of the window re-decoded for context
        self._read = 0  # ids already turned into text

    def add(self, token_id: int) -> str:
        """Append one id; return the text it completes (possibly empty)."""
        self._ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """Return whatever text is still held back at the end of the answer."""
        return self._advance(final=True)

    def _advance(self, *, final: bool) -> str:
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before) :]

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)
