"""What the engine keeps per replica, per session and per answer being generated."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any
from weakref import WeakSet

import torch
from transformers import DynamicCache

from llava.core.params import GenerationParams
from llava.core.tiers import Tier
from llava.engines.conversation.chat import Exchange
from llava.engines.conversation.incremental import Rendered
from llava.engines.conversation.text import Detokenizer, answer_usage
from llava.engines.transformers.model.cache import cache_tensors
from llava.engines.transformers.state.imageset import ImageSet


@dataclass(eq=False)
class Replica:
    """One copy of the model on one device; sessions are pinned to a replica."""

    model: Any
    device: torch.device
    states: WeakSet[SessionState] = field(default_factory=WeakSet)  # the sessions pinned here

    @property
    def sessions(self) -> int:
        return len(self.states)

    @property
    def device_bytes(self) -> int:
        """Bytes its sessions hold on its device."""
        return sum(state.device_bytes for state in list(self.states))


def place(replicas: list[Replica]) -> Replica:
    """Choose the replica for a new session: the one whose sessions hold the fewest bytes on
    its device (each card's budget is its own), then the one with the fewest sessions."""
    return min(replicas, key=lambda r: (r.device_bytes, r.sessions))


def tensor_bytes(tensors: Any) -> int:
    """Count the bytes of an iterable of tensors (None entries are skipped)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@dataclass(eq=False)
class SessionState:
    """A session's conversation, plus what is cached of it.

    `cache` holds the keys/values of exactly `cache_ids` (None in the FEATURES tier or in the
    reference `pixels` mode); `images` holds the projected features of the session's images in
    order, in host memory, so the conversation can always be recomputed (or, in `pixels` mode,
    the processed pixels on the device).
    """

    replica: Replica
    system_prompt: str | None
    images: ImageSet
    prefix_ids: list[int]  # the system prompt and the first image: what an open prefills
    cache: DynamicCache | None = None
    cache_ids: list[int] = field(default_factory=list)  # the ids whose keys/values are cached
    tier: Tier = Tier.DEVICE
    history: list[Exchange] = field(default_factory=list)
    prompt_len: int = 0  # ids up to the last committed turn's answer cue: its conversation
    rendered: Rendered | None = None  # that prompt, for the next turn to extend

    @property
    def opening_images(self) -> int:
        """The images the session was opened with (0 for a text-only session)."""
        return len(self.images.tokens) - sum(e.added_images for e in self.history)

    @property
    def prefix_len(self) -> int:
        return len(self.prefix_ids)

    @property
    def cached(self) -> int:
        return self.cache.get_seq_length() if self.cache is not None else 0

    @property
    def cache_bytes(self) -> int:
        return tensor_bytes(cache_tensors(self.cache))

    @property
    def device_bytes(self) -> int:
        """Bytes held on the replica's device (the cache, or the pixels in pixels mode)."""
        cache = self.cache_bytes if self.tier is Tier.DEVICE else 0
        return cache + self.images.device_bytes

    @property
    def host_bytes(self) -> int:
        """Bytes held in host memory (an offloaded cache, the image features)."""
        offloaded = self.cache_bytes if self.tier is Tier.HOST else 0
        return offloaded + self.images.host_bytes

    @property
    def nbytes(self) -> int:
        return self.device_bytes + self.host_bytes


@dataclass(eq=False)
class Turn:
    """One answer being generated; each engine step advances it by a chunk or a token.

    `ids` are the whole conversation's ids up to the assistant's cue, as the model's own
    pipeline tokenizes them; the turn's cache already holds `fed` (a prefix of them, then the
    answer's tokens as they are fed back) and `pending` are the ids still to feed.
    """

    state: SessionState
    prompt: str
    params: GenerationParams
    branch: bool  # history=False: answer from the image alone, leave the main line untouched
    images: ImageSet  # the images of this turn's conversation (the session's, plus an added one)
    added_images: int  # images sent with this question
    past: list[Exchange]  # the earlier turns this answer follows (committed with it)
    cache: DynamicCache
    start_len: int  # cache length before this turn, to roll back on failure
    ids: list[int]
    fed: list[int]  # ids whose keys/values the turn's cache holds
    pending: list[int]  # ids to feed on the next forward
    max_new_tokens: int
    detokenizer: Detokenizer
    generator: torch.Generator | None
    found_in: Tier  # where the session's state was when the question came
    tower_tokens: int = 0  # image tokens the vision tower must produce before the prefill
    features: torch.Tensor | None = None  # the conversation's image features, once encoded
    opening: bool = False  # a new session's prefix: prefilled, nothing generated
    rendered: Rendered | None = None  # the prompt `ids` came from, kept for the next turn
    records_exchange: bool = True  # False for a client's chat: the client keeps the history
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

    @property
    def prefilling(self) -> bool:
        return self.first_token_at is None

    def usage(self) -> dict[str, Any]:
        """Report token counts, timings and the session's memory for this answer."""
        times = (self.started, self.first_token_at, self.finished_at)
        return {
            **answer_usage(self.prefill_tokens, self.cached_tokens, len(self.generated), times),
            "finish_reason": self.finish_reason,
            "session_bytes": self.state.nbytes,
            "session_tier": self.found_in.value,
        }
