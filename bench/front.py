"""What the fronts cost over an engine of a set pace: `python bench/front.py`.

The kit's own handler runs in a real TorchServe, and its replica in a real Ray Serve (one
replica, in a private network namespace), over the paced engine (bench/paced.py: a step
of `--step-ms`, one token per running answer per step), so what is measured is the front: at
each number of streams, every stream asks at once for an answer of `--tokens` tokens, streamed
or whole, and the figures are set against what the engine produced:
- added_first_ms: the first token's arrival less the engine's first step (p50);
- gap_p50 / gap_p99: the time between a stream's chunks, as a ratio to the engine's step;
- relayed: tokens delivered per second against tokens produced per second (streams / step);
- cpu_us_per_token: the front's CPU time (its whole process tree) per token delivered.
Whole answers: the time to the whole answer against tokens x step. The client runs on the
same machine (its threads share the cores): read the figures as ratios side by side.
Writes bench/results/front.json and front.png.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from drivers import scene_uri  # noqa: E402
from run import image_uri  # noqa: E402

from llava.api.headers import SESSION_HEADER  # noqa: E402
from llava.tools.archive import MODEL_CONFIG, build_archive  # noqa: E402

JSON = {"Content-Type": "application/json"}
SHAPES = ROOT / "models" / "shapes"  # only its tokenizer is used: the engine is paced
FRONTS = ("torchserve", "ray")


def paced_store(work: Path, in_flight: int) -> Path:
    """The kit's archive of `shapes`, its handler swapped for bench/paced_handler.py, taking
    `in_flight` requests at once (TorchServe's batchSize)."""
    store, config = work / "store", work / "model-config.yaml"
    work.mkdir(parents=True, exist_ok=True)
    text = re.sub(r"(?m)^batchSize: *\d+", f"batchSize: {in_flight}", MODEL_CONFIG.read_text())
    config.write_text(text)
    archive = build_archive(SHAPES, store, name="llava", config_file=config)
    shutil.copy(ROOT / "bench" / "paced_handler.py", archive / "llava_handler.py")
    shutil.copy(ROOT / "bench" / "paced.py", archive / "paced.py")
    return store


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def ask(
    http: httpx.Client, url: str, sid: str, tokens: int, stream: bool, image: str | None = None
) -> list[float]:
    """One answer (adding `image` when given, as a chat carrying a picture sends one); return
    its chunks' arrival times (one time for a whole answer)."""
    body = {"type": "query", "prompt": "Describe it.", "max_new_tokens": tokens, "stream": stream}
    if image:
        body["image"] = image
    times = [time.perf_counter()]
    with http.stream("POST", url, json=body, headers={**JSON, SESSION_HEADER: sid}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if line:
                times.append(time.perf_counter())
    return times


def noise_uri(kb: int) -> str:
    """A PNG data URI of random pixels, about `kb` KB on the wire (noise does not compress:
    3 bytes a pixel, 4/3 of that in base64)."""
    return image_uri(kb, max(8, int((kb * 1024 * 3 / 4 / 3) ** 0.5)))


def cpu_seconds(processes: list[psutil.Process]) -> float:
    total = 0.0
    for process in processes:
        try:
            t = process.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def measure(
    url: str, pid: int, streams: int, tokens: int, stream: bool, step_s: float, body_kb: int = 0
) -> dict:
    """`streams` sessions ask at once; return the figures against the engine's pace."""
    http = httpx.Client(timeout=600, limits=httpx.Limits(max_connections=streams + 4))
    picture = scene_uri(1)
    sids = []
    for _ in range(streams):
        r = http.post(url, json={"type": "open_session", "image": picture}, headers=JSON)
        r.raise_for_status()
        sids.append(r.json()["session_id"])
    served = psutil.Process(pid)
    tree = [served, *served.children(recursive=True)]
    results: list[list[float]] = [[] for _ in sids]
    added = noise_uri(body_kb) if body_kb else None  # made before the clock starts
    start = threading.Barrier(streams + 1)

    def run(i: int) -> None:
        start.wait()
        results[i] = ask(http, url, sids[i], tokens, stream, added)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(streams)]
    for thread in threads:
        thread.start()
    cpu_before = cpu_seconds(tree)
    start.wait()
    began = time.perf_counter()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - began
    cpu = cpu_seconds(tree) - cpu_before
    for sid in sids:
        http.post(url, json={"type": "close_session"}, headers={**JSON, SESSION_HEADER: sid})
    http.close()
    delivered = streams * tokens
    out: dict[str, Any] = {
        "streams": streams,
        "tokens": tokens,
        "stream": stream,
        "body_kb": body_kb,
        "relayed": round((delivered / wall) / (streams / step_s), 3) if step_s else None,
        "cpu_us_per_token": round(cpu / delivered * 1e6, 1),
        "wall_s": round(wall, 3),
    }
    if stream:
        firsts = [(t[1] - t[0]) * 1000 - step_s * 1000 for t in results]
        gaps = [b - a for t in results for a, b in zip(t[1:], t[2:], strict=False)]
        out["added_first_ms_p50"] = round(statistics.median(firsts), 2)
        if step_s:
            out["gap_p50"] = round(percentile(gaps, 0.5) / step_s, 3)
            out["gap_p99"] = round(percentile(gaps, 0.99) / step_s, 3)
    else:
        wholes = [t[-1] - t[0] for t in results]
        out["whole_vs_engine_p50"] = (
            round(statistics.median(wholes) / (tokens * step_s), 3) if step_s else None
        )
    return out


def served(front: str, tmp: Path, step_ms: float, in_flight: int, tokens: int) -> Any:
    """A started front over the paced engine: TorchServe's or Ray Serve's (one replica)."""
    from llava.fronts.ray.launcher import RayServe
    from llava.fronts.torchserve.launcher import TorchServe

    env = {
        "LLAVA_PACED_STEP_MS": str(step_ms),
        "LLAVA_MAX_SESSIONS": str(in_flight),
        "LLAVA_MAX_NEW_TOKENS": str(max(1024, tokens)),
        "LLAVA_IMAGE_PROCESSES": "0",
    }
    work = tmp / f"{front}-{step_ms}"
    if front == "torchserve":
        return TorchServe(paced_store(work, in_flight), "llava", workdir=work, env=env)
    path = [str(ROOT / "bench" / "paced_ray"), str(ROOT)]
    env["PYTHONPATH"] = os.pathsep.join([*path, os.environ.get("PYTHONPATH", "")])
    return RayServe(SHAPES, workdir=work, env=env)


def front_url(front: str, server: Any) -> tuple[str, int]:
    """Where the front takes the kit's requests, and the pid whose process tree serves them."""
    if front == "torchserve":
        pid = server.frontend_pid()
        assert pid is not None, "TorchServe started with no pid file"
        return server.url("/predictions/llava"), pid
    return server.url("/invocations"), server.proc.pid


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fronts", nargs="+", choices=FRONTS, default=list(FRONTS))
    parser.add_argument("--step-ms", type=float, nargs="+", default=[7.0])
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--tokens", type=int, nargs="+", default=[32])
    parser.add_argument(
        "--body-kb",
        type=int,
        nargs="+",
        default=[0],
        help="each question adds a picture of about this many KB (a body TorchServe may re-send)",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "front.json")
    args = parser.parse_args(argv)
    if "ray" in args.fronts and os.environ.get("LLAVA_NETNS") != "1":
        # Ray binds the machine's address: run in a private network namespace (needs root).
        inner = f"ip link set lo up && LLAVA_NETNS=1 {sys.executable} {' '.join(sys.argv)}"
        raise SystemExit(subprocess.call(["unshare", "-n", "sh", "-c", inner]))
    rows = []
    in_flight = max(args.streams) + 8
    with tempfile.TemporaryDirectory(prefix="llava-front-") as tmp:
        for front in args.fronts:
            for step_ms in args.step_ms:
                step_s = step_ms / 1000
                with served(front, Path(tmp), step_ms, in_flight, max(args.tokens)) as server:
                    url, pid = front_url(front, server)
                    for tokens in args.tokens:
                        for streams, kb in itertools.product(args.streams, args.body_kb):
                            for stream in (True, False):
                                figures = measure(url, pid, streams, tokens, stream, step_s, kb)
                                row = {"front": front, "step_ms": step_ms, **figures}
                                print(json.dumps(row), flush=True)
                                rows.append(row)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"cpus": psutil.cpu_count(), "argv": sys.argv[1:], "when": time.strftime("%F %T")}
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    plot(rows, args.out.with_suffix(".png"))
    print(f"wrote {args.out}")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for key in sorted({(r["front"], r["step_ms"], r["tokens"]) for r in rows if r["stream"]}):
        points = [r for r in rows if r["stream"] and (r["front"], r["step_ms"], r["tokens"]) == key]
        name = f"{key[0]}, {key[1]} ms step, {key[2]} tokens"
        ax.plot([r["streams"] for r in points], [r.get("gap_p50") for r in points], "o-",
                label=f"{name}: gap p50")  # fmt: skip
        ax.plot([r["streams"] for r in points], [r["relayed"] for r in points], "s--",
                label=f"{name}: relayed")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_xlabel("streams")
    ax.set_ylabel("ratio to the engine (1 = keeps pace)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
