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
    """A `make` that does each stage's work in a moment and fails `failing`."""
    script = tmp_path / "make"
    script.write_text(
        "#!/bin/sh\n"
        'python3 -c "import time; time.sleep(0.1)"  # the stage\'s work\n'
        f'[ "$2" != "{failing}" ]\n'
    )
    script.chmod(0o755)
    return script


def run(stages: ModuleType, tmp_path: Path, slots: int, failing: str = "", memory_gb: float = 64):
    """Run every stage with the fake make; return the run (its outcomes and events)."""
    stages.LOGS = tmp_path / "logs"
    run = stages.Run(str(fake_make(tmp_path, failing)), None, slots, memory_gb)
    run.status = run.go()
    return run


def test_computing_stages_take_free_slots_first_in_order_once_what_they_wait_for_passed(
    stages: ModuleType, tmp_path: Path
) -> None:
    done = run(stages, tmp_path, slots=1)
    assert done.status == 0
    by_name = {s.name: s for s in stages.STAGES}
    rank = {s.name: i for i, s in enumerate(stages.STAGES)}
    ready, running, ended, most = [], set(), set(), 0
    for kind, name in done.events:
        stage = by_name[name]
        if kind == "ready":
            assert set(stage.after) <= ended
            ready.append(name)
        elif kind == "start":
            assert name in ready
            if stage.computes:
                running.add(name)
                most = max(most, len(running))
                waiting = [n for n in ready if by_name[n].computes and n not in running | ended]
                assert all(rank[n] > rank[name] for n in waiting), (name, waiting)
        else:
            running.discard(name)
            ended.add(name)
    assert most == 1
    assert ended == set(by_name)


def test_two_slots_let_two_suites_run_at_once(stages: ModuleType, tmp_path: Path) -> None:
    done = run(stages, tmp_path, slots=2)
    assert done.status == 0
    computing = {s.name for s in stages.STAGES if s.computes}
    running, most = 0, 0
    for kind, name in done.events:
        if name in computing and kind != "ready":
            running += 1 if kind == "start" else -1
            most = max(most, running)
    assert most == 2


@pytest.mark.parametrize("memory_gb", [1.5, 13])
def test_a_stage_starts_beside_others_only_where_its_memory_fits(
    stages: ModuleType, tmp_path: Path, memory_gb: float
) -> None:
    done = run(stages, tmp_path, slots=2, memory_gb=memory_gb)
    assert done.status == 0
    by_name = {s.name: s for s in stages.STAGES}
    running: set[str] = set()
    beside = 0
    for kind, name in done.events:
        stage = by_name[name]
        if kind == "end":
            running.discard(name)
        elif kind == "start":
            if stage.computes and any(by_name[n].computes for n in running):
                held = sum(by_name[n].memory_gb for n in running) + stage.memory_gb
                assert held <= memory_gb, (name, running)
                beside += 1
            running.add(name)
    assert (beside > 0) == (memory_gb > 2)  # two suites side by side only where they fit


def test_a_failed_stage_stops_what_waits_for_it_only(stages: ModuleType, tmp_path: Path) -> None:
    done = run(stages, tmp_path, slots=2, failing="venv-vllm")
    assert done.status == 1
    begun = {name for kind, name in done.events if kind == "start"}
    needs_vllm = {s.name for s in stages.STAGES if "install-vllm" in s.after}
    assert needs_vllm and not begun & needs_vllm
    assert {"main", "lint", "images-build"} <= begun
    assert all(
        done.outcomes[n].why_not_run == "not run: install-vllm did not pass" for n in needs_vllm
    )
    summary = (tmp_path / "logs" / "summary.json").read_text()
    assert '"status": 1' in summary


def test_the_budgets_in_docs_testing_md_are_the_ones_the_run_checks(stages: ModuleType) -> None:
    table = (REPO / "docs" / "testing.md").read_text()
    row = r"^\| `([a-z-]+)` \|\s*([a-z-, ]*?)\s*\| (yes|no) \| (\d+):(\d\d) \| ([\d.]+) \|"
    rows = re.findall(row, table, re.M)
    documented = {
        name: (tuple(a.strip() for a in after.split(",") if a.strip()), computes == "yes",
               int(m) * 60 + int(s), float(gb))
        for name, after, computes, m, s, gb in rows
    }  # fmt: skip
    declared = {s.name: (s.after, s.computes, s.budget_s, s.memory_gb) for s in stages.STAGES}
    assert documented == declared


def test_a_stage_that_cannot_be_run_fails_the_run(
    stages: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No process could be started (out of memory, out of files): the stage fails, and what
    waits for it is not run, rather than the run passing with the stage unseen."""
    stages.LOGS = tmp_path / "logs"
    done = stages.Run(str(fake_make(tmp_path)), None, 2, 64)

    def cannot(outcome: object) -> None:
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(done, "run", cannot)
    assert done.go() == 1
    first = [o for o in done.outcomes.values() if not o.stage.after]
    assert first and all(o.status == 1 for o in first)
    assert all(o.why_not_run.startswith("not run") for o in done.outcomes.values() if o.stage.after)
    log = (tmp_path / "logs" / "install-kit.log").read_text()
    assert "could not run this stage: OSError(12, 'Cannot allocate memory')" in log
