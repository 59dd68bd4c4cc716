"""The memory tiers a session's state moves down when memory is short (named by metrics too)."""

from __future__ import annotations

from enum import Enum


class Tier(str, Enum):
    """Where a session's state lives; each step down frees memory and costs a little latency."""

    DEVICE = "device"  # KV cache on the replica's device: the next turn prefills only itself
    HOST = "host"  # KV cache in host memory: copied back on the next turn
    FEATURES = "features"  # only the image features: the prefix is recomputed on the next turn
