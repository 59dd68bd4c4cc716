"""Prefix-aware routing as SageMaker's API reference describes PREFIX_AWARE: requests that share
a prefix (of at most `prefix_length` bytes of body; on the OpenAI path, characters of the
messages' text) and their `X-Amzn-SageMaker-Prefix-Aware-Id` go to the same instance, unless that
instance has `concurrency_threshold` requests in flight, when the request goes to another.

AWS does not publish its router. This one keeps where each recent prefix went, in 16-byte blocks
(hashed as a chain, as prefix caches key their blocks), and sends a request where its longest
known prefix went; one with none, or whose instance is at the threshold, to the least busy.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from llava.fronts.local_runtime.errors import Refusal

PREFIX_AWARE_ID_HEADER = "X-Amzn-SageMaker-Prefix-Aware-Id"
BLOCK = 16
_AWARE_ID = re.compile(r"\S[ -~\u00a0-\U0010ffff]{0,63}")  # 1-64 printable, not starting blank


@dataclass(frozen=True)
class PrefixAware:
    """PrefixAwareRoutingConfig: its two numbers, with SageMaker's bounds."""

    prefix_length: int = 4096
    concurrency_threshold: int = 16

    def __post_init__(self) -> None:
        if not 1024 <= self.prefix_length <= 65536:
            raise ValueError(f"prefix_length must be 1024-65536, got {self.prefix_length}")
        if not 1 <= self.concurrency_threshold <= 1024:
            raise ValueError(
                f"concurrency_threshold must be 1-1024, got {self.concurrency_threshold}"
            )

    def chain(self, body: bytes, aware_id: str | None, *, chat: bool) -> list[bytes]:
        """The request's prefix as a chain of block hashes under its prefix-aware id: an
        InvokeEndpoint body's first `prefix_length` bytes, or (`chat`, the OpenAI path) the first
        `prefix_length` characters of its messages' text in order (pictures are not text)."""
        if aware_id is not None and not _AWARE_ID.fullmatch(aware_id):
            raise Refusal(
                400,
                "ValidationError",
                "1 validation error detected: Value at 'prefixAwareId' failed to satisfy "
                "constraint: Member must have length between 1 and 64 and match pattern "
                r"\A\S[\p{Print}]*\z",
            )
        if chat:
            prefix = "".join(_message_texts(body))[: self.prefix_length].encode("utf-8")
        else:
            prefix = body[: self.prefix_length]
        chain, h = [], hashlib.blake2b((aware_id or "").encode("utf-8"), digest_size=16)
        for start in range(0, len(prefix) - BLOCK + 1, BLOCK):
            h = hashlib.blake2b(h.digest() + prefix[start : start + BLOCK], digest_size=16)
            chain.append(h.digest())
        return chain


class PrefixIndex:
    """Which instance each recently routed prefix block went to (least recently used forgotten)."""

    def __init__(self, capacity: int = 200_000) -> None:
        self.capacity = capacity
        self._where: OrderedDict[bytes, int] = OrderedDict()

    def longest(self, chain: Sequence[bytes], usable: Sequence[int]) -> int | None:
        """The instance the longest known prefix of `chain` went to, if it is `usable`."""
        for block in reversed(chain):
            index = self._where.get(block)
            if index is not None:
                return index if index in usable else None
        return None

    def record(self, chain: Sequence[bytes], index: int) -> None:
        for block in chain:
            self._where[block] = index
            self._where.move_to_end(block)
        while len(self._where) > self.capacity:
            self._where.popitem(last=False)


def _message_texts(body: bytes) -> list[str]:
    """The text of each message's content (a string, or its text parts); a body that is not a
    chat has none (the container answers it with its own 4xx)."""
    try:
        messages = json.loads(body).get("messages")
    except (ValueError, AttributeError, RecursionError):
        return []
    texts: list[str] = []
    for message in messages if isinstance(messages, list) else []:
        content: Any = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            texts.extend(
                part["text"]
                for part in content
                if isinstance(part, dict) and isinstance(part.get("text"), str)
            )
    return texts
