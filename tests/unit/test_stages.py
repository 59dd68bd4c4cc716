"""`make test`'s scheduler (tests/stages.py): stages wait for what they need, computing stages
never outnumber the slots, and docs/testing.md's budget table is the one the run checks."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def stages() -> ModuleType:
    spec = importlib.util.spec_from_file_location("stages", REPO / "tests" / "stages.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["stages"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def fake_make(tmp_path: Path, failing: str = "") -> Path:
    """A `make` that records when each target begins and ends, failing `failing`."""
    record = tmp_path / "record"
    script = tmp_path / "make"
    script.write_text(
        "#!/bin/sh\n"
        'target="$2"\n'
        f'echo "begin $target" >> {record}\n'
        'python3 -c "import time; time.sleep(0.2)"  # the stage\'s work\n'
        f'echo "end $target" >> {record}\n'
        f'[ "$target" != "{failing}" ]\n'
    )
    script.chmod(0o755)
    return script


def events(tmp_path: Path) -> list[tuple[str, str]]:
    lines = (tmp_path / "record").read_text().splitlines()
    return [(kind, target) for kind, target in (line.split() for line in lines)]


def run(stages: ModuleType, tmp_path: Path, slots: int, failing: str = "") -> int:
    stages.LOGS = tmp_path / "logs"
    outcome: int = stages.Run(str(fake_make(tmp_path, failing)), None, slots).go()
    return outcome


def test_computing_stages_never_outnumber_the_slots_and_wait_for_what_they_need(
    stages: ModuleType, tmp_path: Path
) -> None:
    assert run(stages, tmp_path, slots=1) == 0
    targets = {s.target: s for s in stages.STAGES}
    running: set[str] = set()
    ended: set[str] = set()
    most = 0
    for kind, target in events(tmp_path):
        stage = targets[target]
        if kind == "begin":
            assert {targets[t].name for t in ended} >= {*stage.after}, (target, ended)
            if stage.computes:
                running.add(target)
                most = max(most, len(running))
        else:
            running.discard(target)
            ended.add(target)
    assert most == 1
    assert ended == set(targets)
    # each took a free slot in STAGES' order, not in the order what it waited for ended
    computing = [t for kind, t in events(tmp_path) if kind == "begin" and targets[t].computes]
    assert computing == [s.target for s in stages.STAGES if s.computes]


def test_two_slots_let_two_suites_run_at_once(stages: ModuleType, tmp_path: Path) -> None:
    assert run(stages, tmp_path, slots=2) == 0
    running, most = 0, 0
    computing = {s.target for s in stages.STAGES if s.computes}
    for kind, target in events(tmp_path):
        if target in computing:
            running += 1 if kind == "begin" else -1
            most = max(most, running)
    assert most == 2


def test_a_failed_stage_stops_what_waits_for_it_only(stages: ModuleType, tmp_path: Path) -> None:
    assert run(stages, tmp_path, slots=2, failing="venv-vllm") == 1
    begun = {target for kind, target in events(tmp_path) if kind == "begin"}
    needs_vllm = {s.target for s in stages.STAGES if "install-vllm" in s.after}
    assert needs_vllm and not begun & needs_vllm
    assert {"stage-main", "lint", "stage-images-build"} <= begun
    summary = (tmp_path / "logs" / "summary.json").read_text()
    assert '"status": 1' in summary


def test_the_budgets_in_docs_testing_md_are_the_ones_the_run_checks(stages: ModuleType) -> None:
    table = (REPO / "docs" / "testing.md").read_text()
    row = r"^\| `([a-z-]+)` \|\s*([a-z-, ]*?)\s*\| (yes|no) \| (\d+):(\d\d) \|"
    rows = re.findall(row, table, re.M)
    documented = {
        name: (tuple(a.strip() for a in after.split(",") if a.strip()), computes == "yes",
               int(m) * 60 + int(s))
        for name, after, computes, m, s in rows
    }  # fmt: skip
    declared = {s.name: (s.after, s.computes, s.budget_s) for s in stages.STAGES}
    assert documented == declared
