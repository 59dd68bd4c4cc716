"""The kit's settings for vLLM that need no vLLM to check (llava/engines/vllm/starting.py)."""

from __future__ import annotations

import os

import pytest

from llava.engines.vllm.starting import SEEDS_PLUGIN, keep_plugin, step_tokens


def test_a_cpu_steps_64_tokens_by_default_and_a_gpu_keeps_vllms() -> None:
    assert step_tokens(0, on_cpu=True) == 64
    assert step_tokens(0, on_cpu=False) is None
    assert step_tokens(512, on_cpu=True) == 512


@pytest.mark.parametrize(
    ("before", "after"),
    [
        (None, None),  # unset: vLLM loads every plugin, the kit's among them
        ("", SEEDS_PLUGIN),
        ("lora_filesystem_resolver", f"lora_filesystem_resolver,{SEEDS_PLUGIN}"),
        (f"{SEEDS_PLUGIN},x", f"{SEEDS_PLUGIN},x"),
    ],
)
def test_a_plugin_list_keeps_the_kits_seed_plugin(
    monkeypatch: pytest.MonkeyPatch, before: str | None, after: str | None
) -> None:
    if before is None:
        monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    else:
        monkeypatch.setenv("VLLM_PLUGINS", before)
    keep_plugin(SEEDS_PLUGIN)
    assert os.environ.get("VLLM_PLUGINS") == after


def test_the_plugin_name_is_the_one_pyproject_registers() -> None:
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib")  # Python 3.11 on
    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    plugins = pyproject["project"]["entry-points"]["vllm.general_plugins"]
    assert plugins[SEEDS_PLUGIN] == "llava.engines.vllm.cpu_seeds:register"
