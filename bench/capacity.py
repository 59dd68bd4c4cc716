"""Steady-state capacity through TorchServe, against the machine's own bound.

    python bench/capacity.py                       # shapes: session cache and pixel cache
    python bench/capacity.py --model llava15       # LLaVA-1.5's shapes, 576 image tokens
    python bench/capacity.py --fractions 0.5 0.8 --duration-s 60 --strategies session
    python bench/capacity.py --torch-threads 0 2   # the default thread count and 2, side by side
    python bench/capacity.py --rates 1 4 16        # conversations/s (a GPU: not a CPU bound)

A user's traffic: conversations arrive at random (Poisson) for a fixed time per rate; each opens
with a JPEG sent inline (a drawn scene for the trained `shapes`, a 640x400 photo for a
random-weight model), asks 4 questions with 0.3-0.7 s of think time between them
(16-token streamed answers) and closes. Each rate runs `--duration-s` of arrivals (at least
five conversation lifetimes), then drains: every conversation that arrived finishes.

The bound: one conversation's CPU-seconds in the server (TorchServe's frontend, its worker and
the worker's image processes), measured with nothing else running; the machine cannot sustain
more than `cores / cpu_s` conversations per second. Rates are fractions of that bound, and a
strategy's capacity - the highest rate whose p95 follow-up TTFT holds the SLO with no error - is
reported as a fraction of it (held also needs the opens to keep up: their p95 within
`--open-slo-ms`, else their queue grows for as long as the rate lasts). Per rate: p50/p95/p99
follow-up TTFT, errors by code and stage, the server's CPU utilisation over the arrival window
and the opens' share of it (opens that arrived x one open's CPU-seconds alone, over the CPU
used). Results: bench/results/capacity-<model>.json
and the terminal (Markdown).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from drivers import open_body, query_body  # noqa: E402
from load import (  # noqa: E402
    JSON,
    TRAINED,
    Client,
    Workload,
    photo_uri,
    run_meta,
    start,
    workload,
    write_results,
)

from llava.api.headers import SESSION_HEADER  # noqa: E402

TOKENS = 16
THINK_S = (0.3, 0.7)
SIZE = (640, 400)
MIN_ARRIVALS = 8
STRATEGIES = {"session": "kv", "pixels": "pixels"}  # name -> the server's cache_mode


def conversations(model: str) -> Workload:
    """The trained model's scenes and questions; for a random-weight model, 640x400 photos."""
    work = workload(model)
    if model == TRAINED:
        return work
    return Workload(work.prompts, lambda seed: photo_uri(seed, SIZE))


class ServerCPU:
    """CPU-seconds used by a TorchServe: its frontend (Java), its worker and the worker's
    image processes."""

    def __init__(self, ts: Any) -> None:
        self.worker = psutil.Process(int(ts.wait_for_new_worker(-1)["pid"]))
        self.frontend = self.worker.parent()

    def seconds(self) -> dict[str, float]:
        def used(process: psutil.Process) -> float:
            times = process.cpu_times()
            return times.user + times.system

        children = sum(used(c) for c in self.worker.children(recursive=True) if c.is_running())
        worker = used(self.worker) + children
        frontend = used(self.frontend) if self.frontend is not None else 0.0
        return {"worker": worker, "frontend": frontend, "total": worker + frontend}

    def threads(self) -> dict[int, float]:
        """CPU-seconds of each of the worker's threads (the step loop is one of them)."""
        return {t.id: t.user_time + t.system_time for t in self.worker.threads()}


def busiest(before: dict[int, float], after: dict[int, float]) -> float:
    """The CPU-seconds the busiest thread used between two `ServerCPU.threads()` readings."""
    return max((after[t] - before.get(t, 0.0) for t in after), default=0.0)


@dataclass
class Outcome:
    """What one conversation saw."""

    follow_up_ttft_ms: list[float] = field(default_factory=list)
    open_ms: float | None = None
    errors: list[str] = field(default_factory=list)  # "<stage> <status> <code>"


class Caller(Client):
    """The session API over one pooled HTTP client, recording errors by status and code."""

    def conversation(self, seed: int, think: bool = True) -> Outcome:
        """Open, ask 4 questions (think time between), close."""
        outcome = Outcome()
        rng = random.Random(seed)
        began = time.perf_counter()
        r = self.http.post(self.url, content=open_body(self.work.picture(seed)), headers=JSON)
        if r.status_code != 200:
            outcome.errors.append(f"open {r.status_code} {_code(r.content)}")
            return outcome
        outcome.open_ms = (time.perf_counter() - began) * 1000
        sid = r.json()["session_id"]
        try:
            for turn, prompt in enumerate(self.work.prompts):
                if turn and think:
                    time.sleep(rng.uniform(*THINK_S))
                ttft, error = self._ask(sid, prompt)
                if error:
                    outcome.errors.append(f"{'follow-up' if turn else 'first'} {error}")
                    break
                if turn:
                    outcome.follow_up_ttft_ms.append(ttft)
        finally:
            self.close(sid)
        return outcome

    def _ask(self, sid: str, prompt: str) -> tuple[float, str | None]:
        """Stream one answer; return its time to first token (ms) or the error."""
        sent = time.perf_counter()
        first = None
        headers = {**JSON, SESSION_HEADER: sid}
        body = query_body(prompt, TOKENS, stream=True)
        with self.http.stream("POST", self.url, content=body, headers=headers) as r:
            if r.status_code != 200:
                return 0.0, f"{r.status_code} {_code(r.read())}"
            for line in r.iter_lines():
                if not line:
                    continue
                first = first or time.perf_counter()
                if "error" in json.loads(line):
                    return 0.0, f"200 {json.loads(line)['error'].get('code')}"
        return ((first or time.perf_counter()) - sent) * 1000, None


def _code(body: bytes) -> str:
    try:
        return str(json.loads(body)["error"]["code"])
    except Exception:
        return "?"


def cost(caller: Caller, cpu: ServerCPU, runs: int) -> dict[str, float]:
    """One conversation's and one open's CPU-seconds, alone (after a warm-up of each)."""
    caller.conversation(10_000, think=False)
    before, threads = cpu.seconds()["total"], cpu.threads()
    lifetimes = []
    for i in range(runs):
        began = time.perf_counter()
        caller.conversation(10_001 + i, think=False)
        lifetimes.append(time.perf_counter() - began + 3 * statistics.mean(THINK_S))
    per_conversation = (cpu.seconds()["total"] - before) / runs
    step_thread = busiest(threads, cpu.threads()) / runs
    before = cpu.seconds()["total"]
    for i in range(runs):
        r = caller.http.post(
            caller.url, content=open_body(photo_uri(20_000 + i, SIZE)), headers=JSON
        )
        caller.close(r.json()["session_id"])
    per_open = (cpu.seconds()["total"] - before) / runs
    return {
        "cpu_s_per_conversation": per_conversation,
        "cpu_s_per_open": per_open,
        "lifetime_s": statistics.median(lifetimes),
        "bound_per_s": (os.cpu_count() or 1) / per_conversation,
        # The step loop runs each step's forwards on one thread (with torch's intra-op threads
        # beside it where torch_threads > 1): its busiest thread's seconds bound the rate too.
        "step_thread_s_per_conversation": step_thread,
        "step_thread_bound_per_s": 1 / max(step_thread, 1e-9),
    }


def run_rate(
    caller: Caller, cpu: ServerCPU, rate: float, duration_s: float, seed: int, open_cpu_s: float
) -> dict[str, Any]:
    """Poisson arrivals at `rate` for `duration_s`, then drain; the rate's figures."""
    rng = random.Random(seed)
    arrivals, at = [], rng.expovariate(rate)
    while at < duration_s:
        arrivals.append(at)
        at += rng.expovariate(rate)
    outcomes: list[Outcome] = []
    lock = threading.Lock()

    def run(i: int) -> None:
        outcome = caller.conversation(seed * 100_000 + i)
        with lock:
            outcomes.append(outcome)

    threads = []
    began = time.perf_counter()
    before = cpu.seconds()
    for i, arrival in enumerate(arrivals):
        delay = began + arrival - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        thread = threading.Thread(target=run, args=(i,), daemon=True)
        thread.start()
        threads.append(thread)
    time.sleep(max(0.0, began + duration_s - time.perf_counter()))
    window = time.perf_counter() - began
    during = cpu.seconds()
    for thread in threads:
        thread.join()
    used = during["total"] - before["total"]
    ttfts = sorted(t for o in outcomes for t in o.follow_up_ttft_ms)
    errors = Counter(e for o in outcomes for e in o.errors)
    opened = sum(1 for o in outcomes if o.open_ms is not None)
    return {
        "rate_per_s": round(rate, 3),
        "conversations": len(arrivals),
        "follow_ups": len(ttfts),
        "p50_ms": _pct(ttfts, 0.50),
        "p95_ms": _pct(ttfts, 0.95),
        "p99_ms": _pct(ttfts, 0.99),
        "errors": dict(errors),
        "cpu_utilisation": round(used / (window * (os.cpu_count() or 1)), 3),
        "worker_cpu_share": round((during["worker"] - before["worker"]) / used, 3) if used else 0,
        "opens_cpu_share": round(opened * open_cpu_s / used, 3) if used else 0,
        "open_p50_ms": _pct(sorted(o.open_ms for o in outcomes if o.open_ms is not None), 0.5),
        "open_p95_ms": _pct(sorted(o.open_ms for o in outcomes if o.open_ms is not None), 0.95),
    }


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return round(values[min(len(values) - 1, int(q * len(values)))], 1)


def sweep(
    caller: Caller,
    cpu: ServerCPU,
    fractions: list[float],
    duration_s: float,
    slo_ms: float,
    open_slo_ms: float,
    rates: list[float] | None = None,
) -> dict[str, Any]:
    """Measure the bound, then each fraction of it (or each of `rates`, conversations per
    second: a GPU's bound is not the CPU's); capacity is the highest rate held."""
    alone = cost(caller, cpu, runs=5)
    duration = max(duration_s, 5 * alone["lifetime_s"])
    print(f"  alone: {alone}; {duration:.0f} s of arrivals per rate", file=sys.stderr)
    if rates:
        fractions = [rate / alone["bound_per_s"] for rate in rates]
    rows, best = [], 0.0
    for i, fraction in enumerate(fractions):
        rate = fraction * alone["bound_per_s"]
        # and at least MIN_ARRIVALS conversations expected, so a slow rate's p95 means something
        lasting = max(duration, MIN_ARRIVALS / rate)
        row = run_rate(caller, cpu, rate, lasting, i + 1, alone["cpu_s_per_open"])
        row["fraction_of_bound"] = round(fraction, 3)
        row["held"] = (
            row["p95_ms"] is not None
            and row["p95_ms"] <= slo_ms
            and not row["errors"]
            and (row["open_p95_ms"] or 0) <= open_slo_ms  # opens keep up: no growing queue
        )
        rows.append(row)
        print(f"  {fraction:.2f} of the bound: {row}", file=sys.stderr)
        if row["held"]:
            best = max(best, rate)
    return {
        "alone": alone,
        "duration_s": duration,
        "capacity_per_s": round(best, 3),
        "capacity_fraction_of_bound": round(best / alone["bound_per_s"], 3),
        "sweep": rows,
    }


def table(results: dict[str, Any]) -> str:
    """The figures as Markdown."""
    slo = results["meta"]["slo_ms"]
    lines = [
        f"| strategy | CPU-s per conversation (alone) | bound /s | step thread s (its bound /s) "
        f"| capacity /s (p95 <= {slo:.0f} ms, no error) | fraction of bound |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, s in results["strategies"].items():
        a = s["alone"]
        lines.append(
            f"| {name} | {a['cpu_s_per_conversation']:.3f} | {a['bound_per_s']:.2f} "
            f"| {a['step_thread_s_per_conversation']:.3f} ({a['step_thread_bound_per_s']:.2f}) "
            f"| {s['capacity_per_s']} | {s['capacity_fraction_of_bound']} |"
        )
    lines += [
        "",
        "| strategy | rate /s (of bound) | p50 / p95 / p99 ms | errors | CPU used | opens' share |",
        "|---|---|---|---|---:|---:|",
    ]
    for name, s in results["strategies"].items():
        for r in s["sweep"]:
            errors = ", ".join(f"{k}: {v}" for k, v in r["errors"].items()) or "none"
            lines.append(
                f"| {name} | {r['rate_per_s']} ({r['fraction_of_bound']}) | {r['p50_ms']} / "
                f"{r['p95_ms']} / {r['p99_ms']} | {errors} | {r['cpu_utilisation']:.0%} "
                f"| {r['opens_cpu_share']:.0%} |"
            )
    session, pixels = results["strategies"].get("session"), results["strategies"].get("pixels")
    if session and pixels and pixels["capacity_per_s"]:
        ratio = session["capacity_per_s"] / pixels["capacity_per_s"]
        lines += ["", f"Session cache over pixel cache: **{ratio:.1f}x** the capacity."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=TRAINED)
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES)
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.6, 0.8, 0.9, 1.0, 1.2])
    parser.add_argument("--pixel-fractions", type=float, nargs="+", default=[0.1, 0.15, 0.2])
    parser.add_argument(
        "--rates",
        type=float,
        nargs="+",
        default=None,
        help="conversations per second to run instead of fractions of the CPU bound (a GPU)",
    )
    parser.add_argument("--duration-s", type=float, default=60.0)
    parser.add_argument("--slo-ms", type=float, default=1000.0)
    parser.add_argument(
        "--open-slo-ms", type=float, default=5000.0, help="p95 of opens: past it they queue"
    )
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument(
        "--torch-threads",
        type=int,
        nargs="+",
        default=[0],
        help="torch_threads settings to run each strategy with, side by side (0: the default)",
    )
    parser.add_argument("--env", nargs="*", default=[], help="server env KEY=VALUE (experiments)")
    args = parser.parse_args(argv)
    extra = dict(pair.split("=", 1) for pair in args.env)

    from llava.tools.archive import build_archive, resolve_model

    work = Path(tempfile.mkdtemp())
    build_archive(resolve_model(args.model), work / "store", name="llava")
    results: dict[str, Any] = {
        "meta": run_meta(
            args.model,
            slo_ms=args.slo_ms,
            open_slo_ms=args.open_slo_ms,
            image="a drawn scene, JPEG inline"
            if args.model == TRAINED
            else f"{SIZE[0]}x{SIZE[1]} JPEG inline",
            think_s=list(THINK_S),
            tokens=TOKENS,
        ),
        "strategies": {},
    }
    for threads in args.torch_threads:
        for strategy in args.strategies:
            name = strategy if not threads else f"{strategy}, torch_threads {threads}"
            env = {"LLAVA_CACHE_MODE": STRATEGIES[strategy], **extra}
            if threads:
                env["LLAVA_TORCH_THREADS"] = str(threads)
            ts = start(work / "store", work / f"{strategy}-{threads}", **env)
            try:
                caller = Caller(ts.url("/predictions/llava"), conversations(args.model))
                fractions = args.fractions if strategy == "session" else args.pixel_fractions
                print(f"{name}:", file=sys.stderr)
                results["strategies"][name] = sweep(
                    caller,
                    ServerCPU(ts),
                    fractions,
                    args.duration_s,
                    args.slo_ms,
                    args.open_slo_ms,
                    args.rates,
                )
            finally:
                ts.stop()
    write_results(args.out / f"capacity-{args.model}.json", results, table(results))


if __name__ == "__main__":
    main()
