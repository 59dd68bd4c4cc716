"""Shared fixtures: the tiny checkpoint and images, built once per test run."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Build the random-weight tiny LLaVA checkpoint offline."""
    from llava.tiny import build_checkpoint

    return build_checkpoint(tmp_path_factory.mktemp("models") / "tiny", profile="tiny")
