"""The session store (no torch): ids, TTL and caps, memory policy, registry and snapshots."""
