"""`make test`: every stage of the proof, in lanes that run side by side, with their times.

A lane is a chain of stages that need each other (an install, then the suites it serves); lanes
run at once, so what waits on the network (installs, image builds) or on a server starting
overlaps with what computes. Each stage is one target of the Makefile (its command lives there)
and writes its whole output to build/test-logs/<stage>.log; the console gets each stage's
progress lines, then a table of stage times against their budgets (docs/testing.md), the
slowest tests of the run, and the whole log of any stage that failed.

    python3 tests/stages.py [--make make] [--only STAGE ...]

Standard library only: it runs before any environment is installed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOGS = REPO / "build" / "test-logs"


@dataclass(frozen=True)
class Stage:
    """One target of the Makefile, its budget in seconds, and the stages it waits for."""

    name: str
    target: str
    budget_s: int
    after: tuple[str, ...] = ()


# The lanes, each run in order; a stage also waits for the stages named in `after`. Budgets are
# docs/testing.md's (cold, on CI's 2 cores, with the lanes beside each other).
LANES: dict[str, list[Stage]] = {
    "kit": [
        Stage("install-kit", "venv", 360),
        Stage("lint", "lint", 120),
        Stage("main", "stage-main", 1500),
    ],
    "vllm": [
        Stage("install-vllm", "venv-vllm", 480),
        Stage("vllm-engine", "stage-vllm-engine", 720),
        Stage("vllm-integration", "stage-vllm-integration", 600),
    ],
    "images": [
        Stage("images-build", "stage-images-build", 1200, after=("install-kit",)),
        Stage("images", "stage-images", 720, after=("install-vllm",)),
    ],
}
# What the console shows of a stage's output: pytest's progress and summary lines.
SHOWN = re.compile(
    r"\[\s*\d+%\]$|^=+ .*(passed|failed|error|skipped).* =+$|^(FAILED|ERROR) |"
    r"^integration tests on the|^prebuilt |^the background build|^building "
)


@dataclass
class Outcome:
    """How a stage ended: its exit status (None: not run) and its seconds."""

    stage: Stage
    lane: str
    status: int | None = None
    seconds: float = 0.0
    why_not_run: str = ""


class Run:
    """Run the lanes side by side and keep each stage's outcome."""

    def __init__(self, make: str, only: set[str] | None) -> None:
        self.make = make
        self.only = only
        self.started = time.monotonic()
        self.outcomes: dict[str, Outcome] = {}
        self.finished: dict[str, threading.Event] = {}
        self.print_lock = threading.Lock()
        for lane, stages in LANES.items():
            for stage in stages:
                self.outcomes[stage.name] = Outcome(stage, lane)
                self.finished[stage.name] = threading.Event()

    def say(self, stage: str, line: str) -> None:
        stamp = time.strftime("%H:%M:%S")
        with self.print_lock:
            print(f"{stamp} {stage:>16} | {line}", flush=True)

    def lane(self, stages: list[Stage]) -> None:
        """Run a lane's stages in order; a stage whose prerequisite failed is not run."""
        before: tuple[str, ...] = ()
        for stage in stages:
            outcome = self.outcomes[stage.name]
            try:
                blocked = next((n for n in (*before, *stage.after) if not self.usable(n)), None)
                if blocked is not None:
                    outcome.why_not_run = f"not run: {blocked} did not pass"
                elif self.only is None or stage.name in self.only:
                    self.run(outcome)
                else:
                    outcome.why_not_run = "left out (--only)"
            finally:
                self.finished[stage.name].set()
            before = (stage.name,)

    def usable(self, name: str) -> bool:
        """Wait for a stage; tell whether what follows it may run (it passed, or was left out
        on purpose)."""
        self.finished[name].wait()
        outcome = self.outcomes[name]
        return outcome.status == 0 or outcome.why_not_run.startswith("left out")

    def run(self, outcome: Outcome) -> None:
        stage = outcome.stage
        log_path, junit = LOGS / f"{stage.name}.log", LOGS / f"{stage.name}.xml"
        junit.unlink(missing_ok=True)
        env = dict(os.environ, LLAVA_STAGES_PID=str(os.getpid()))
        env["PYTEST_ADDOPTS"] = f"{env.get('PYTEST_ADDOPTS', '')} --junitxml={junit}".strip()
        self.say(stage.name, f"make {stage.target} (log: {log_path.relative_to(REPO)})")
        began = time.monotonic()
        with open(log_path, "w", encoding="utf-8", errors="replace") as log:
            process = subprocess.Popen(
                [self.make, "--no-print-directory", stage.target],
                cwd=REPO,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                errors="replace",
            )
            assert process.stdout is not None
            for line in process.stdout:
                log.write(line)
                log.flush()
                if SHOWN.search(line.rstrip()):
                    self.say(stage.name, line.rstrip())
            outcome.status = process.wait()
        outcome.seconds = time.monotonic() - began
        verdict = "passed" if outcome.status == 0 else f"FAILED (exit {outcome.status})"
        self.say(stage.name, f"{verdict} in {minutes(outcome.seconds)}")

    def go(self) -> int:
        LOGS.mkdir(parents=True, exist_ok=True)
        threads = [
            threading.Thread(target=self.lane, args=(stages,), name=lane)
            for lane, stages in LANES.items()
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return self.report()

    def report(self) -> int:
        """Print the stage table, the slowest tests and the logs of failed stages; save it."""
        wall = time.monotonic() - self.started
        rows = []
        print(f"\n{'stage':<18}{'lane':<8}{'time':>8}{'budget':>8}  result")
        for outcome in self.outcomes.values():
            stage = outcome.stage
            if outcome.status is None:
                result = outcome.why_not_run or "not run"
            elif outcome.status:
                result = f"FAILED (exit {outcome.status})"
            else:
                result = "passed" + ("  (over budget)" if outcome.seconds > stage.budget_s else "")
            print(
                f"{stage.name:<18}{outcome.lane:<8}{minutes(outcome.seconds):>8}"
                f"{minutes(stage.budget_s):>8}  {result}"
            )
            rows.append(
                {
                    "stage": stage.name,
                    "lane": outcome.lane,
                    "seconds": round(outcome.seconds, 1),
                    "budget_s": stage.budget_s,
                    "status": outcome.status,
                }
            )
        print(f"{'all lanes':<18}{'':<8}{minutes(wall):>8}")
        slowest = slowest_tests(15)
        if slowest:
            print("\nslowest tests (setup, call and teardown):")
            for seconds, stage_name, test in slowest:
                print(f"{seconds:8.1f} s  {stage_name:<18}{test}")
        failed = [o for o in self.outcomes.values() if o.status not in (0, None)]
        for outcome in failed:
            name = outcome.stage.name
            print(f"\n{'=' * 30} {name} failed: its whole log {'=' * 30}")
            print((LOGS / f"{name}.log").read_text(errors="replace"))
        (LOGS / "summary.json").write_text(
            json.dumps({"wall_s": round(wall, 1), "stages": rows}, indent=1)
        )
        not_run = [o for o in self.outcomes.values() if o.why_not_run.startswith("not run")]
        return 1 if failed or not_run else 0


def slowest_tests(count: int) -> list[tuple[float, str, str]]:
    """The slowest tests over every stage's JUnit report: (seconds, stage, test)."""
    found = []
    for report in LOGS.glob("*.xml"):
        try:
            root = ElementTree.parse(report).getroot()
        except ElementTree.ParseError:
            continue
        for case in root.iter("testcase"):
            test = f"{case.get('classname', '')}::{case.get('name', '')}"
            found.append((float(case.get("time") or 0), report.stem, test))
    return sorted(found, reverse=True)[:count]


def minutes(seconds: float) -> str:
    return f"{int(seconds // 60)}:{int(seconds % 60):02d}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--make", default="make", help="the make to run each stage with")
    parser.add_argument("--only", nargs="*", help="run these stages (and skip the rest)")
    args = parser.parse_args()
    known = {s.name for stages in LANES.values() for s in stages}
    unknown = set(args.only or ()) - known
    if unknown:
        parser.error(f"no stage named {', '.join(sorted(unknown))}; stages: {sorted(known)}")
    return Run(args.make, set(args.only) if args.only else None).go()


if __name__ == "__main__":
    sys.exit(main())
