"""Shared fixtures: the tiny checkpoint and images, built once per test run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from engine_under_test import profile


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Build the random-weight tiny LLaVA checkpoint offline."""
    from llava.tools.tiny import build_checkpoint

    return build_checkpoint(tmp_path_factory.mktemp("models") / "tiny", profile=profile("tiny"))


@pytest.fixture(scope="session")
def byte_level_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny's shapes with a byte-level BPE tokenizer (Qwen2, ChatML): the other tokenizer kind."""
    from llava.tools.tiny import build_checkpoint

    return build_checkpoint(
        tmp_path_factory.mktemp("models") / "interleave", profile=profile("interleave")
    )


@pytest.fixture(scope="module", params=["sentencepiece", "byte_level"])
def either_checkpoint(request: pytest.FixtureRequest) -> Path:
    """Each tokenizer kind in turn: SentencePiece (llava-1.5, NeXT) and byte-level BPE (Qwen2)."""
    name = "tiny_checkpoint" if request.param == "sentencepiece" else "byte_level_checkpoint"
    return Path(request.getfixturevalue(name))


@pytest.hookimpl(tryfirst=True, hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: Any) -> Any:
    """Keep each phase's report on the test item (`item.rep_call`): fixtures that save
    evidence of a failure (the browser test's screenshot) read it."""
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"rep_{report.when}", report)
