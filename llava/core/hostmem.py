"""The host memory the kernel reports available, and the share of it sessions may hold."""

from __future__ import annotations

from pathlib import Path


def host_budget(available_bytes: int) -> int:
    """Return the bytes offloaded caches, image features and pictures may hold in host memory."""
    return available_bytes // 2


def available_host_bytes(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """Return the kernel's MemAvailable, or None where it cannot be read."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
