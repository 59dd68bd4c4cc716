"""The GPU suite's setting: real 7B shapes in bf16 on CUDA, or its logic on CPU, or a skip.

- A CUDA device: random-weight checkpoints with the real shapes of llava-1.5-7b and
  llava-v1.6-mistral-7b, built on the GPU in bf16 (no download).
- No CUDA device and `LLAVA_GPU_LOGIC=cpu` (what `make test` sets): the same tests on the CPU,
  with the tiny shapes of the same two families, so CI proves their logic.
- Otherwise every test here skips, saying so in one line.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from gpu_setting import Setting, setting

from llava.tools.tiny import build_checkpoint


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if setting() is not None:
        return
    skip = pytest.mark.skip(
        reason="no CUDA device: the GPU tests skip (LLAVA_GPU_LOGIC=cpu runs "
        "their logic on the CPU with tiny shapes)"
    )
    for item in items:
        if Path(str(item.fspath)).parent == Path(__file__).parent:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def gpu() -> Setting:
    found = setting()
    assert found is not None
    return found


@pytest.fixture(scope="session")
def checkpoints(gpu: Setting, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Build both checkpoints on the device (a 7B one in about a minute, most of it writing)."""
    root = tmp_path_factory.mktemp("gpu-models")
    return {
        profile: build_checkpoint(root / profile, profile, device=gpu.device, dtype=gpu.dtype)
        for profile in gpu.profiles
    }
