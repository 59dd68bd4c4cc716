"""`make test`: every stage of the proof, scheduled on the machine's cores, with their times.

A stage is one target of the Makefile (its command lives there) that waits for the stages it
needs (an install, a build). What waits on the network (installs, image builds) starts as soon as
it can; what computes (lint and the suites) takes one of SLOTS places, one per core, in the order
STAGES lists it, so the suites never outnumber the cores (three at once on two cores stretched
every wait a test makes until it timed out). Each stage writes its whole output to
build/test-logs/<stage>.log; the console gets each stage's progress lines, then a table of stage
times and CPU seconds against their budgets (docs/testing.md), the slowest tests of the run, and
the whole log of any stage that failed.

    python3 tests/stages.py [--make make] [--only STAGE ...] [--slots N]

Standard library only: it runs before any environment is installed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
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
    """One target of the Makefile, its budget in seconds, the stages it waits for, the most
    memory it holds (GiB, as the run's table measured it), and whether it computes (takes a
    core) or mostly waits on the network."""

    name: str
    target: str
    budget_s: int
    after: tuple[str, ...] = ()
    memory_gb: float = 1.0
    computes: bool = True


# Every stage; a computing stage takes a free slot in this order (the longest first) once what
# it waits for passed and its memory fits beside the stages running (a stage that does not fit
# lets the next one go first): the vLLM stages hold several engines each, and two of them beside
# each other pushed the machine out of memory (Ray's monitor killed its controller). Budgets and
# memory are docs/testing.md's: cold, on CI's 2 cores and 24 GiB, beside each other.
STAGES: list[Stage] = [
    Stage("install-kit", "venv", 360, computes=False),
    Stage("install-vllm", "venv-vllm", 480, computes=False),
    Stage("images-build", "stage-images-build", 1500, ("install-kit",), 2, computes=False),
    Stage("wheels", "stage-wheels", 300, ("install-kit",), 0.5, computes=False),
    Stage("lint", "lint", 120, ("install-kit",)),
    Stage("main", "stage-main", 1320, ("install-kit",), 6),
    Stage("vllm-engine", "stage-vllm-engine", 900, ("install-vllm",), 7.5),
    Stage("images", "stage-images", 900, ("images-build", "install-vllm"), 9),
    Stage("vllm-integration", "stage-vllm-integration", 600, ("install-vllm",), 10.5),
    Stage("sees", "stage-sees", 900, ("install-kit",), 3),
    Stage("fronts", "stage-fronts", 600, ("install-kit",), 6),
]
assert all(
    set(stage.after) <= {earlier.name for earlier in STAGES[:rank]}
    for rank, stage in enumerate(STAGES)
), "a stage waits only for stages listed before it"
SLOTS = 2  # CI's cores


def machine_memory_gb() -> float:
    """What the stages may hold at once: four fifths of the machine's memory (the rest is the
    page cache the suites read their models and libraries through)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) / 2**20 * 0.8
    return 16.0


# What the console shows of a stage's output: pytest's progress and summary lines.
SHOWN = re.compile(
    r"\[\s*\d+%\]$|^=+ .*(passed|failed|error|skipped).* =+$|^(FAILED|ERROR) |"
    r"^integration tests on the|^prebuilt |^the background build|^building "
)


@dataclass
class Outcome:
    """How a stage went: when what it waited for had passed (ready) and when it began (the
    difference: its wait for a slot or memory), its exit status (None: not run), its seconds,
    the CPU seconds its processes used and the most memory they held (None where no cgroup
    could count them)."""

    stage: Stage
    status: int | None = None
    ready: float | None = None
    began: float = 0.0
    seconds: float = 0.0
    cpu_s: float | None = None
    peak_gb: float | None = None
    why_not_run: str = ""


CGROUPS = Path("/sys/fs/cgroup")


class Accounting:
    """The cgroups (v1 cpuacct and memory) a stage's processes run in, daemons they start
    included (not Docker's containers, which Docker puts in its own): on a machine shared by
    stages, the CPU a stage costs and the most memory its processes held at once (sampled
    every second), which its wall time no longer tells."""

    def __init__(self, name: str) -> None:
        self.paths: list[Path] = []
        for controller in ("cpuacct", "memory"):
            path = CGROUPS / controller / f"llava-stage-{os.getpid()}-{name}"
            try:
                path.mkdir(exist_ok=True)
            except OSError:  # no cgroup v1 here, or not root: the stage runs uncounted
                continue
            self.paths.append(path)
        self.peak_bytes = 0
        self.done = threading.Event()

    def wrap(self, command: list[str]) -> list[str]:
        """`command`, run from inside the cgroups."""
        if not self.paths:
            return command
        joins = " && ".join(f"echo $$ > {path / 'cgroup.procs'}" for path in self.paths)
        return ["sh", "-c", f'{joins} && exec "$@"', "sh", *command]

    def _read(self, controller: str, field: str) -> int | None:
        for path in self.paths:
            if path.parent.name == controller:
                with contextlib.suppress(OSError, ValueError):
                    if field.endswith(".usage"):
                        return int((path / field).read_text())
                    for line in (path / "memory.stat").read_text().splitlines():
                        key, value = line.split()
                        if key == field:
                            return int(value)
        return None

    def sample_memory(self) -> None:
        """Until the stage ends: keep the most resident memory (not file cache) it held."""
        while not self.done.wait(1.0):
            held = (self._read("memory", "total_rss") or 0) + (
                self._read("memory", "total_shmem") or 0
            )
            self.peak_bytes = max(self.peak_bytes, held)

    def cpu_seconds(self) -> float | None:
        used = self._read("cpuacct", "cpuacct.usage")
        return None if used is None else used / 1e9

    def peak_gb(self) -> float | None:
        return self.peak_bytes / 2**30 if self.peak_bytes else None

    def remove(self) -> None:
        """Remove the cgroups once empty (a daemon left running keeps one: left be)."""
        self.done.set()
        for path in self.paths:
            with contextlib.suppress(OSError):
                path.rmdir()


class Run:
    """Start each stage once what it waits for has passed, a computing one only into a free
    slot, the first in STAGES' order first; keep each stage's outcome."""

    def __init__(self, make: str, only: set[str] | None, slots: int, memory_gb: float) -> None:
        self.make = make
        self.only = only
        self.slots = slots
        self.memory_gb = memory_gb
        self.started = time.monotonic()
        self.outcomes = {stage.name: Outcome(stage) for stage in STAGES}
        self.events: list[tuple[str, str]] = []  # ready, start, end: as the loop saw them
        self.print_lock = threading.Lock()

    def say(self, stage: str, line: str) -> None:
        stamp = time.strftime("%H:%M:%S")
        with self.print_lock:
            print(f"{stamp} {stage:>16} | {line}", flush=True)

    def passed(self, name: str) -> bool:
        """Whether what waits for this stage may run: it passed, or was left out on purpose."""
        outcome = self.outcomes[name]
        return outcome.status == 0 or outcome.why_not_run.startswith("left out")

    def go(self) -> int:
        LOGS.mkdir(parents=True, exist_ok=True)
        pending, ended = list(STAGES), set[str]()
        running: dict[str, Stage] = {}
        finished: queue.Queue[str] = queue.Queue()
        while pending or running:
            free = self.slots - sum(stage.computes for stage in running.values())
            for stage in [s for s in pending if set(s.after) <= ended]:
                outcome = self.outcomes[stage.name]
                if outcome.ready is None:
                    outcome.ready = time.monotonic() - self.started
                    self.events.append(("ready", stage.name))
                blocked = next((n for n in stage.after if not self.passed(n)), None)
                if blocked is not None:
                    outcome.why_not_run = f"not run: {blocked} did not pass"
                elif self.only is not None and stage.name not in self.only:
                    outcome.why_not_run = "left out (--only)"
                elif stage.computes and (free < 1 or not self.fits(stage, running)):
                    continue  # it waits for a slot, or for memory
                else:
                    free -= stage.computes
                    running[stage.name] = stage
                    self.events.append(("start", stage.name))
                    threading.Thread(
                        target=self.run_then_tell, args=(outcome, finished), name=stage.name
                    ).start()
                pending.remove(stage)
                if outcome.why_not_run:
                    ended.add(stage.name)
                    break  # what waits for it is looked at again, in order
            else:
                name = finished.get()
                del running[name]
                ended.add(name)
                self.events.append(("end", name))
        return self.report()

    def fits(self, stage: Stage, running: dict[str, Stage]) -> bool:
        """Whether the stage's memory fits beside the running ones' (alone, it always does)."""
        if not any(s.computes for s in running.values()):
            return True
        held = sum(s.memory_gb for s in running.values())
        return held + stage.memory_gb <= self.memory_gb

    def run_then_tell(self, outcome: Outcome, finished: queue.Queue[str]) -> None:
        """Run the stage; a stage that could not even be run (no process started: out of
        memory, out of files) fails the run with its reason, rather than passing unseen."""
        try:
            self.run(outcome)
        except Exception as error:  # noqa: BLE001 (reported as the stage's failure)
            outcome.status = outcome.status or 1
            self.say(outcome.stage.name, f"FAILED: could not run it: {error!r}")
            log_path = LOGS / f"{outcome.stage.name}.log"
            with contextlib.suppress(OSError), open(log_path, "a", encoding="utf-8") as log:
                log.write(f"\ntests/stages.py could not run this stage: {error!r}\n")
        finally:
            finished.put(outcome.stage.name)

    def run(self, outcome: Outcome) -> None:
        stage = outcome.stage
        log_path, junit = LOGS / f"{stage.name}.log", LOGS / f"{stage.name}.xml"
        junit.unlink(missing_ok=True)
        env = dict(os.environ, LLAVA_STAGES_PID=str(os.getpid()))
        env["PYTEST_ADDOPTS"] = f"{env.get('PYTEST_ADDOPTS', '')} --junitxml={junit}".strip()
        self.say(stage.name, f"make {stage.target} (log: {os.path.relpath(log_path, REPO)})")
        began = time.monotonic()
        outcome.began = began - self.started
        count = Accounting(stage.name)
        threading.Thread(target=count.sample_memory, daemon=True).start()
        with open(log_path, "w", encoding="utf-8", errors="replace") as log:
            process = subprocess.Popen(
                count.wrap([self.make, "--no-print-directory", stage.target]),
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
        outcome.cpu_s = count.cpu_seconds()
        outcome.peak_gb = count.peak_gb()
        count.remove()
        verdict = "passed" if outcome.status == 0 else f"FAILED (exit {outcome.status})"
        cpu = "" if outcome.cpu_s is None else f", {outcome.cpu_s:.0f} CPU-s"
        if outcome.peak_gb is not None:
            cpu += f", at most {outcome.peak_gb:.1f} GiB"
        self.say(stage.name, f"{verdict} in {minutes(outcome.seconds)}{cpu}")

    def report(self) -> int:
        """Print the stage table, the slowest tests and the logs of failed stages; save it."""
        wall = time.monotonic() - self.started
        rows = []
        print(
            f"\n{'stage':<18}{'began':>8}{'waited':>8}{'time':>8}{'budget':>8}{'CPU-s':>8}"
            f"{'GiB':>6}  result"
        )
        for outcome in self.outcomes.values():
            stage = outcome.stage
            if outcome.status is None:
                result = outcome.why_not_run or "not run"
            elif outcome.status:
                result = f"FAILED (exit {outcome.status})"
            else:
                result = "passed" + ("  (over budget)" if outcome.seconds > stage.budget_s else "")
            cpu = "" if outcome.cpu_s is None else f"{outcome.cpu_s:.0f}"
            peak = "" if outcome.peak_gb is None else f"{outcome.peak_gb:.1f}"
            waited = outcome.began - (outcome.ready or 0.0) if outcome.status is not None else 0.0
            print(
                f"{stage.name:<18}{minutes(outcome.began):>8}{minutes(waited):>8}"
                f"{minutes(outcome.seconds):>8}"
                f"{minutes(stage.budget_s):>8}{cpu:>8}{peak:>6}  {result}"
            )
            rows.append(
                {
                    "stage": stage.name,
                    "began_s": round(outcome.began, 1),
                    "waited_s": round(waited, 1),
                    "seconds": round(outcome.seconds, 1),
                    "cpu_s": None if outcome.cpu_s is None else round(outcome.cpu_s),
                    "peak_gb": None if outcome.peak_gb is None else round(outcome.peak_gb, 2),
                    "budget_s": stage.budget_s,
                    "status": outcome.status,
                }
            )
        print(f"{'all stages':<18}{'':>16}{minutes(wall):>8}")
        slowest = slowest_tests(
            [o.stage.name for o in self.outcomes.values() if o.status is not None], 15
        )
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


def slowest_tests(stages: list[str], count: int) -> list[tuple[float, str, str]]:
    """The slowest tests in these stages' JUnit reports: (seconds, stage, test)."""
    found = []
    for report in (LOGS / f"{name}.xml" for name in stages):
        try:
            root = ElementTree.parse(report).getroot()
        except (OSError, ElementTree.ParseError):  # a stage that ran no pytest
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
    parser.add_argument("--slots", type=int, default=SLOTS, help="computing stages at once")
    parser.add_argument(
        "--memory-gb", type=float, default=machine_memory_gb(), help="what stages may hold"
    )
    args = parser.parse_args()
    if args.slots < 1:
        parser.error("--slots: at least 1")
    known = {s.name for s in STAGES}
    unknown = set(args.only or ()) - known
    if unknown:
        parser.error(f"no stage named {', '.join(sorted(unknown))}; stages: {sorted(known)}")
    only = set(args.only) if args.only else None
    return Run(args.make, only, args.slots, args.memory_gb).go()


if __name__ == "__main__":
    sys.exit(main())
