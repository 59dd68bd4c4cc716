"""Load figures through TorchServe: stream gaps while sessions open.

    python bench/load.py                       # a few minutes

(Capacity at steady state, against the machine's bound: bench/capacity.py.)

Stream gaps: one answer streams; after it has streamed quietly for a while, 4 sessions open
with 1024x768 images at once (576 image tokens each on LLaVA-1.5). The figure is the stream's
longest gap between two lines (the stream sends one per token) while they open, against its
quiet median gap; the gaps between lines that carry text are reported beside it. Each server is
measured `--gap-runs` times after a warm-up run, and the worst run is the figure. It is measured
side by side on two servers: the default step token budget (chunked prefill) and an unbounded
one (each open computed whole inside one step, as before chunking). The default budget is
measured (engine/calibrate.py at start, engine/pacing.py on every step): a step's prefill work
costs about 1.5 quiet steps, its chunks packed into the stream's decode forward.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import multiprocessing
import os
import platform
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from drivers import (  # noqa: E402
    SCENE_PROMPTS,
    TRAINED,
    open_body,
    query_body,
    scene_uri,
)

from llava.api.headers import SESSION_HEADER  # noqa: E402

JSON = {"Content-Type": "application/json"}
PROMPTS = [
    "What is shown in this picture?",
    "Which colors stand out the most?",
    "Is there anything unusual in the scene?",
    "Summarize the picture in one sentence.",
]


def photo_uri(seed: int, size: tuple[int, int] = (1024, 768)) -> str:
    """A deterministic noisy JPEG as a data: URI (what a client would send)."""
    from PIL import Image

    rng = random.Random(seed)
    img = Image.frombytes("RGB", size, rng.randbytes(size[0] * size[1] * 3))
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=85)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()


@dataclass(frozen=True)
class Workload:
    """What a conversation sends: its questions, and its picture for a seed."""

    prompts: list[str]
    picture: Callable[[int], str]


def workload(model: str) -> Workload:
    """Scenes and scene questions for the trained model (true answers, so follow-ups reuse the
    cache as a real model's do); noisy photos otherwise."""
    if model == TRAINED:
        return Workload(SCENE_PROMPTS[:4], lambda seed: scene_uri(seed, "JPEG"))
    return PHOTOS


PHOTOS = Workload(PROMPTS, photo_uri)


def start(store: Path, workdir: Path, **env: str) -> Any:
    from llava.fronts.torchserve.launcher import TorchServe

    settings = {"LLAVA_MAX_NEW_TOKENS": "1024", "LLAVA_MAX_SESSIONS": "256", **env}
    return TorchServe(store, "llava", workdir=workdir, env=settings).start()


class Client:
    """Streamed session-API calls over one pooled HTTP client."""

    def __init__(self, url: str, work: Workload = PHOTOS) -> None:
        self.url = url
        self.work = work
        self.http = httpx.Client(timeout=600, limits=httpx.Limits(max_connections=256))

    def open(self, image: str) -> str:
        r = self.http.post(self.url, content=open_body(image), headers=JSON)
        r.raise_for_status()
        return r.json()["session_id"]

    def close(self, sid: str) -> None:
        self.http.post(
            self.url, content=b'{"type": "close_session"}', headers={**JSON, SESSION_HEADER: sid}
        )

    def stream(self, body: bytes, sid: str | None) -> tuple[list[float], str]:
        """Send a streamed request; return the arrival time of each chunk and the text."""
        headers = {**JSON, SESSION_HEADER: sid} if sid else JSON
        times, text = [], []
        with self.http.stream("POST", self.url, content=body, headers=headers) as r:
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:300]!r}")
            for line in r.iter_lines():
                if line:
                    times.append(time.perf_counter())
                    event = json.loads(line)
                    if "error" in event:
                        raise RuntimeError(str(event["error"]))
                    text.append(event.get("text", ""))
        return times, "".join(text)


# -- stream gaps -------------------------------------------------------------------------------


def stream_gaps(
    client: Client, opener: ProcessPoolExecutor, opens: int, quiet_chunks: int
) -> dict[str, Any]:
    """Stream one answer; open `opens` sessions at once after `quiet_chunks` lines.

    The stream sends a line per token; `text_*` figures count only lines with text, what a
    reader sees (a random model's tokens often complete no character: those gaps span several
    steps even when nothing else runs). The opens come from `opener`, another process: threads
    of this one would hold its interpreter lock while they send the images, and delay the
    stream's lines here, not on the server.
    """
    sid = client.open(photo_uri(0))
    body = query_body("Tell me a long story about this picture.", 1000, stream=True)
    lines: list[tuple[float, bool]] = []  # (arrival, carries text)
    images = [photo_uri(100 + i) for i in range(opens)]  # encoded before the clock starts

    def watch() -> None:
        headers = {**JSON, SESSION_HEADER: sid}
        with client.http.stream("POST", client.url, content=body, headers=headers) as r:
            for line in r.iter_lines():
                if line:
                    lines.append((time.perf_counter(), bool(json.loads(line).get("text"))))

    streamer = threading.Thread(target=watch)
    streamer.start()
    while len(lines) < quiet_chunks and streamer.is_alive():
        time.sleep(0.005)
    # perf_counter is the system's monotonic clock: the opener's readings compare with ours.
    started, ended, opened = opener.submit(open_all, client.url, images).result()
    window = {"start": started, "end": ended}
    streamer.join()
    for other in [sid, *opened]:
        client.close(other)
    if not lines or lines[-1][0] < window["end"]:
        raise RuntimeError("the stream ended before the opens finished: ask for a longer answer")
    tokens = _gaps([at for at, _ in lines], window)
    text = _gaps([at for at, has_text in lines if has_text], window)
    return {
        **tokens,
        "text_quiet_median_ms": text["quiet_median_ms"],
        "text_quiet_longest_ms": text["quiet_longest_ms"],
        "text_longest_gap_ms": text["longest_gap_ms"],
        "text_gap_ratio": text["gap_ratio"],
        "opens_wall_ms": round((window["end"] - window["start"]) * 1000, 1),
        "lines": len(lines),
    }


def open_all(url: str, images: list[str]) -> tuple[float, float, list[str]]:
    """Open a session per image at once (in the opener process); return when it started, when
    the last open was answered, and the session ids."""
    client = Client(url)
    with ThreadPoolExecutor(len(images)) as pool:
        started = time.perf_counter()
        opened = list(pool.map(client.open, images))
        return started, time.perf_counter(), opened


def _gaps(times: list[float], window: dict[str, float]) -> dict[str, float]:
    """Gaps between arrivals before the opens (after warm-up) and while they run."""
    gaps = [(b - a, b) for a, b in zip(times, times[1:], strict=False)]
    quiet = [g for g, at in gaps if at < window["start"]][5:]  # skip the first lines' warm-up
    during = [g for g, at in gaps if window["start"] <= at <= window["end"] + 0.5]
    if not quiet or not during:
        raise RuntimeError("too few stream lines to measure: ask for a longer answer")
    median = statistics.median(quiet)
    return {
        "quiet_median_ms": round(median * 1000, 1),
        "quiet_longest_ms": round(max(quiet) * 1000, 1),
        "longest_gap_ms": round(max(during) * 1000, 1),
        "gap_ratio": round(max(during) / median, 2),
    }


def gap_runs(client: Client, opens: int, runs: int) -> dict[str, Any]:
    """Measure `runs` times on one server (after a warm-up run); keep every run and the worst."""
    # The opener: another process at the lowest CPU priority, as a remote client takes no CPU
    # from the server (here client, frontend and worker share the cores).
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=spawn, initializer=os.nice, initargs=(19,)) as opener:
        stream_gaps(client, opener, opens, quiet_chunks=15)  # warm-up run, not kept
        each = [stream_gaps(client, opener, opens, quiet_chunks=30) for _ in range(runs)]
    worst = max(each, key=lambda r: r["gap_ratio"])
    ratios = sorted(r["gap_ratio"] for r in each)
    return {**worst, "median_gap_ratio": ratios[len(ratios) // 2], "runs": each}


def table(results: dict[str, Any]) -> str:
    lines = []
    if "gaps" in results:
        lines += [
            "| step token budget | quiet median gap | longest gap while 4 open | ratio (worst "
            "run / median run) | lines with text: quiet median, quiet longest, longest while "
            "open |",
            "|---|---|---|---|---|",
        ]
        for name, g in results["gaps"].items():
            lines.append(
                f"| {name} | {g['quiet_median_ms']} ms | {g['longest_gap_ms']} ms "
                f"| {g['gap_ratio']}x / {g['median_gap_ratio']}x | {g['text_quiet_median_ms']}, "
                f"{g['text_quiet_longest_ms']}, {g['text_longest_gap_ms']} ms |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=TRAINED)
    parser.add_argument("--opens", type=int, default=4)
    parser.add_argument("--gap-runs", type=int, default=3, help="gap runs per server (worst kept)")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)

    from llava.tools.archive import build_archive, resolve_model

    model_dir = resolve_model(args.model)
    work = Path(tempfile.mkdtemp())
    build_archive(model_dir, work / "store", name="llava")
    results: dict[str, Any] = {"meta": run_meta(args.model)}
    results["gaps"] = {}
    for name, budget in (("calibrated (default)", "0"), ("unbounded", "1000000")):
        ts = start(work / "store", work / f"gaps-{budget}", LLAVA_STEP_TOKEN_BUDGET=budget)
        try:
            client = Client(ts.url("/predictions/llava"), workload(args.model))
            results["gaps"][name] = gap_runs(client, args.opens, args.gap_runs)
            for run in results["gaps"][name]["runs"]:
                print(f"gaps, budget {name}: {run}", file=sys.stderr)
        finally:
            ts.stop()
    write_results(args.out / "load.json", results, table(results))


def run_meta(model: str, **extra: Any) -> dict[str, Any]:
    """What every bench result records about its run: when, where, which model."""
    return {
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "model": model,
        **extra,
    }


def write_results(path: Path, results: dict[str, Any], table_text: str) -> None:
    """Save a run's figures as JSON and print its table (Markdown) and where they went."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2))
    print(table_text)
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
