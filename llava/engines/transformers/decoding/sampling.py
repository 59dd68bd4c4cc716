"""Pick the next token: argmax, or seeded temperature and nucleus sampling."""

from __future__ import annotations

import torch

from llava.core.params import GenerationParams


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
