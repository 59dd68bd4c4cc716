"""Memory budgets derived at start from what the machine has left once the weights are loaded.

`device_budget_mb: 0` and `host_budget_mb: 0` (the defaults) mean "derive": on a GPU the device
budget (per card: a session's cache lives on one) is what `torch.cuda.mem_get_info` reports free
after loading on the card with the least, less a reserve for
activations (a prefill chunk, the vision tower, the allocator's slack), halved because a
decoding session's cache is copied into the stacked decode batch while it decodes (the batch's
buffers are the other half). The host budget is half the memory the kernel reports available.
Past the device budget idle sessions move to host memory, past the host budget they keep only
their image features (see `sessions/memory.py`), so no default lets sessions fill the card.
Half the activation reserve of the card with the least free memory bounds what one step's
forward may allocate (`workspace.py` cuts prefill chunks to fit); the other half is the vision
tower's run and the allocator's slack.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from llava.core.hostmem import available_host_bytes, host_budget

log = logging.getLogger(__name__)

GIB = 1024**3
ACTIVATION_FLOOR = GIB  # kept free for activations, whatever the card
ACTIVATION_SHARE = 0.10  # or this share of the free memory, if larger


@dataclass(frozen=True)
class Budgets:
    """Byte budgets for the memory tiers (None: unbounded)."""

    device: int | None
    host: int | None
    workspace: int | None = None  # bytes a step's forward may allocate (None: unbounded)


def activation_reserve(free_bytes: int) -> int:
    """Return the bytes kept free for activations on a device with `free_bytes` free."""
    return max(ACTIVATION_FLOOR, int(free_bytes * ACTIVATION_SHARE))


def device_budget(free_bytes: int) -> int:
    """Return the bytes session caches may hold on a device with `free_bytes` free."""
    return max(0, (free_bytes - activation_reserve(free_bytes)) // 2)


def workspace_budget(free_bytes: int) -> int:
    """Return the bytes one step's forward may allocate on a device with `free_bytes` free."""
    return activation_reserve(free_bytes) // 2


def derive_budgets(
    devices: list[torch.device], device_bytes: int | None, host_bytes: int | None
) -> Budgets:
    """Fill in the budgets left at 0 in the config from this machine's free memory.

    On CPU the device is host memory: only the host budget is derived there.
    """
    gpus = [d for d in devices if d.type == "cuda"]
    workspace = None
    if gpus:  # every budget holds per card; the card with the least free memory sets them
        least = min(torch.cuda.mem_get_info(d)[0] for d in gpus)
        workspace = workspace_budget(least)
        log.info(
            "step workspace: %.2f GiB per forward (half the activation reserve of the card with "
            "the least free memory); prefill chunks are cut to fit",
            workspace / GIB,
        )
        if device_bytes is None:
            device_bytes = device_budget(least)
            log.info(
                "device budget derived: %.1f GiB free after loading the weights on the fullest of "
                "%d GPU(s) -> %.1f GiB for session caches on each (set device_budget_mb to "
                "override)",
                least / GIB,
                len(gpus),
                device_bytes / GIB,
            )
    if host_bytes is None:
        available = available_host_bytes()
        if available is not None:
            host_bytes = host_budget(available)
            log.info(
                "host budget derived: %.1f GiB available -> %.1f GiB for offloaded sessions "
                "(set host_budget_mb to override)",
                available / GIB,
                host_bytes / GIB,
            )
    return Budgets(device_bytes, host_bytes, workspace)
