"""A session on vLLM's engine, and one answer being generated for it.

The session is the conversation only: its images (with their content ids), its questions and
answers, and the ids of its last prompt and answer. vLLM holds the keys and values of what it
has seen in its own prefix cache (shared by every session, evicted by vLLM as it needs room), so
nothing here lives on the device, and committing or undoing a turn is list work.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from llava.core.params import GenerationParams
from llava.core.tiers import Tier
from llava.engines.conversation.chat import Exchange
from llava.engines.conversation.incremental import Rendered
from llava.engines.conversation.text import Detokenizer, answer_usage
from llava.engines.vllm.images import VllmImage


@dataclass(eq=False)
class VllmSession:
    """A conversation as this engine keeps it: everything needed to ask vLLM its next turn."""

    system_prompt: str | None
    images: tuple[VllmImage, ...]
    prefix_ids: list[int]  # the system prompt and the opening images: what an open prefills
    history: list[Exchange] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)  # the last prompt's ids and its answer's
    prompt_len: int = 0  # ids up to the last committed turn's answer cue
    rendered: Rendered | None = None  # that prompt, for the next turn to extend
    tier: Tier = Tier.FEATURES  # vLLM's prefix cache holds what it holds; the session, the rest
    # vLLM's `cache_salt`: the session's own namespace in the prefix cache vLLM shares between
    # requests, so no other session's request can hit (and time, or count) its blocks
    salt: str = field(default_factory=lambda: secrets.token_hex(16))

    @property
    def opening_images(self) -> int:
        """The images the session was opened with (0 for a text-only session)."""
        return len(self.images) - sum(e.added_images for e in self.history)

    @property
    def host_bytes(self) -> int:
        """The pixels this worker keeps to send vLLM again (vLLM may have evicted them)."""
        return sum(image.nbytes for image in self.images) + 8 * len(self.ids)

    @property
    def device_bytes(self) -> int:
        return 0  # the device holds only vLLM's shared cache, sized by vLLM

    @property
    def nbytes(self) -> int:
        return self.host_bytes


@dataclass(eq=False)
class VllmTurn:
    """One answer (or a new session's prefill) as one vLLM request."""

    state: VllmSession
    request_id: str
    prompt: str
    params: GenerationParams
    ids: list[int]  # the prompt's ids, one image placeholder per picture (vLLM expands them)
    images: tuple[VllmImage, ...]  # the pictures the prompt holds, in order
    past: list[Exchange]  # the earlier turns this answer follows (committed with it)
    detokenizer: Detokenizer
    found_in: Tier
    added_images: int = 0
    branch: bool = False  # history=False: answered from the image alone, the session untouched
    opening: bool = False  # a new session's prefill: nothing is generated
    records_exchange: bool = True  # False for a client's chat: the client keeps the history
    rendered: Rendered | None = None
    max_new_tokens: int = 0
    generated: list[int] = field(default_factory=list)
    text: str = ""
    delta: str = ""
    done: bool = False
    finish_reason: str | None = None
    error: BaseException | None = None  # why the request failed (the engine died under it)
    prompt_tokens: int = 0  # the prompt's length with its images expanded, as vLLM counts it
    cached_tokens: int = 0  # of which vLLM's prefix cache held
    started: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    finished_at: float | None = None

    def usage(self) -> dict[str, Any]:
        """Report token counts, timings and the session's memory for this answer."""
        prefill = max(self.prompt_tokens - self.cached_tokens, 0)
        times = (self.started, self.first_token_at, self.finished_at)
        return {
            **answer_usage(prefill, self.cached_tokens, len(self.generated), times),
            "finish_reason": self.finish_reason,
            "session_bytes": self.state.nbytes,
            "session_tier": self.tier().value,
        }

    def tier(self) -> Tier:
        """Where this answer found its session: on the device if vLLM's prefix cache held any
        of it (salted per session, so a hit is this session's own), else rebuilt from it."""
        return Tier.DEVICE if self.cached_tokens else self.found_in
