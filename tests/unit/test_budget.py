"""Budgets derived at start: nothing a default config allows can fill the card."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llava.engines.transformers.model import budget
from llava.engines.transformers.model.budget import (
    GIB,
    available_host_bytes,
    derive_budgets,
    device_budget,
    workspace_budget,
)


def test_the_device_budget_keeps_an_activation_reserve_and_room_for_the_decode_batch() -> None:
    # 8 GiB free (a 7B model on a 24 GB A10G): 1 GiB kept, the rest shared with the batch.
    assert device_budget(8 * GIB) == int(3.5 * GIB)
    # On a large card the reserve is a share of what is free.
    assert device_budget(60 * GIB) == int((60 - 6) / 2 * GIB)
    assert device_budget(GIB // 2) == 0  # nothing left: every idle session goes to host memory


def test_available_host_memory_is_read_from_meminfo(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:  32000000 kB\nMemAvailable:   2048 kB\n")
    assert available_host_bytes(meminfo) == 2048 * 1024
    meminfo.write_text("garbage")
    assert available_host_bytes(meminfo) is None
    assert available_host_bytes(tmp_path / "missing") is None


def test_on_cpu_only_the_host_budget_is_derived(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(budget, "available_host_bytes", lambda: 10 * GIB)
    derived = derive_budgets([torch.device("cpu")], None, None)
    assert derived.device is None and derived.host == 5 * GIB


def test_on_gpus_the_budget_holds_per_card_from_the_fullest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Not pooled: a session's cache lives on one card, so two cards' free memory together
    is no room on either."""
    free = {0: 8 * GIB, 1: 20 * GIB}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (free[d.index], 24 * GIB))
    monkeypatch.setattr(budget, "available_host_bytes", lambda: None)
    gpus = [torch.device("cuda", 0), torch.device("cuda", 1)]
    derived = derive_budgets(gpus, None, None)
    # 8 GiB free on the fuller card: 1 GiB kept for activations, half the rest for sessions
    assert derived.device == int(3.5 * GIB) and derived.host is None


def test_configured_budgets_are_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (8 * GIB, 24 * GIB))
    derived = derive_budgets([torch.device("cuda", 0)], 123, 456)
    assert (derived.device, derived.host) == (123, 456)
    assert derived.workspace == GIB // 2  # the card's activation reserve is still kept


def test_a_step_may_allocate_half_the_reserve_of_the_fullest_card(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each forward runs on one card: the one with the least free memory bounds them all."""
    free = {0: 40 * GIB, 1: 8 * GIB}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (free[d.index], 80 * GIB))
    monkeypatch.setattr(budget, "available_host_bytes", lambda: None)
    derived = derive_budgets([torch.device("cuda", 0), torch.device("cuda", 1)], None, None)
    assert derived.workspace == GIB // 2  # 8 GiB free: 1 GiB reserved, half for the forward
    assert workspace_budget(60 * GIB) == 3 * GIB  # a large card: 10% reserved
    assert derive_budgets([torch.device("cpu")], None, None).workspace is None


def test_vllms_sessions_get_a_host_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """Their pictures live on the host: without a budget a few large uploads could fill it."""
    from llava.core import hostmem as memory
    from llava.core.config import ServerConfig
    from llava.fronts.assembly import vllm_host_budget

    monkeypatch.setattr(memory, "available_host_bytes", lambda: 10 * GIB)
    assert vllm_host_budget(ServerConfig(engine="vllm")) == 5 * GIB
    assert vllm_host_budget(ServerConfig(engine="vllm", host_budget_mb=64)) == 64 * 2**20
    monkeypatch.setattr(memory, "available_host_bytes", lambda: None)
    assert vllm_host_budget(ServerConfig(engine="vllm")) is None
