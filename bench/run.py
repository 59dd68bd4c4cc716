"""Benchmark the kit's session cache against the reference design and stateless serving.

    python bench/run.py                      # both models, in-process and through TorchServe
    python bench/run.py --models shapes --envs inprocess --repeats 1   # a quick look

For turns 1..6 of one conversation it measures the time to first token and the total latency of
three strategies (stateless, pixels = the reference design, session = this kit) plus the bytes
sent per turn; then aggregate tokens/s and p50/p95 latency for 1, 4 and 8 concurrent sessions
against one-at-a-time processing. Every figure is a median over `--repeats` runs, and every
comparison is a ratio of figures measured in the same run: these machines are noisy. Results go
to bench/results/bench.json, bench/results/bench.png and the terminal (a Markdown table).
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from drivers import (  # noqa: E402
    SCENE_PROMPTS,
    STRATEGIES,
    TRAINED,
    InProcess,
    OverHttp,
    scene_uri,
)

PROMPTS = [
    "What is shown in this picture?",
    "Which colors stand out the most?",
    "Is there anything unusual in the scene?",
    "Describe the left part of the image in more detail.",
    "What might have happened just before this was taken?",
    "Summarize everything we discussed in one sentence.",
]
CONCURRENCY = (1, 4, 8)
IMAGE_SIZE = {"tiny": 64}  # the image side in pixels the benchmark sends (others: 336)


def workload(model: str) -> tuple[list[str], Any]:
    """Return the conversation's prompts and the picture for a seed: scenes for the trained
    model (true answers, so follow-ups reuse the cache as a real model's do), noise otherwise."""
    if model == TRAINED:
        return SCENE_PROMPTS, scene_uri
    size = IMAGE_SIZE.get(model, 336)
    return PROMPTS, lambda seed: image_uri(seed, size)


def image_uri(seed: int, size: int) -> str:
    """Return a deterministic noisy PNG as a data: URI (what a client would send)."""
    from PIL import Image

    rng = random.Random(seed)
    img = Image.frombytes("RGB", (size, size), rng.randbytes(size * size * 3))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def median_turns(runs: list[list[Any]]) -> list[dict[str, Any]]:
    """Combine repeated conversations into per-turn medians."""
    turns = []
    for rows in zip(*runs, strict=True):
        merged = {}
        for key, value in rows[0].row().items():
            values = [getattr(r, key) for r in rows if getattr(r, key) is not None]
            merged[key] = statistics.median(values) if values and key != "turn" else value
        turns.append(merged)
    return turns


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run_env(
    driver: Any,
    model: str,
    repeats: int,
    max_new_tokens: int,
    concurrency: tuple[int, ...] = CONCURRENCY,
) -> dict[str, Any]:
    """Measure conversations and concurrency with one driver; return the figures."""
    prompts, picture = workload(model)
    out: dict[str, Any] = {"turns": {}, "load": []}
    driver.conversation("session", picture(99), prompts[:2], max_new_tokens)  # warm up
    for strategy in STRATEGIES:
        runs = [
            driver.conversation(strategy, picture(rep), prompts, max_new_tokens)
            for rep in range(repeats)
        ]
        out["turns"][strategy] = median_turns(runs)
        print(f"  {strategy:9s} done", file=sys.stderr)
    for n in concurrency:
        for concurrent in (False, True):
            walls, tokens, lat = [], [], []
            for rep in range(repeats):
                uris = [picture(1000 + 10 * rep + i) for i in range(n)]
                result = driver.load(uris, prompts[0], 32, concurrent)
                walls.append(result.wall_s)
                tokens.append(result.tokens)
                lat.extend(result.latencies_ms)
            wall = statistics.median(walls)
            out["load"].append(
                {
                    "sessions": n,
                    "mode": "concurrent" if concurrent else "sequential",
                    "tokens_per_s": statistics.median(
                        t / w for t, w in zip(tokens, walls, strict=True)
                    ),
                    "p50_ms": percentile(lat, 0.5),
                    "p95_ms": percentile(lat, 0.95),
                    "wall_s": wall,
                    "tokens": statistics.median(tokens),
                }
            )
        print(f"  load x{n} done", file=sys.stderr)
    return out


def ratios(figures: dict[str, Any]) -> dict[str, Any]:
    """The comparisons the kit is judged by, all from one run."""
    turns = figures["turns"]
    out: dict[str, Any] = {}
    for t in (2, 6):
        pix, ses = turns["pixels"][t - 1], turns["session"][t - 1]
        out[f"ttft_pixels_over_session_turn{t}"] = pix["ttft_ms"] / ses["ttft_ms"]
        if ses.get("floor_ms"):
            out[f"ttft_session_over_floor_turn{t}"] = ses["ttft_ms"] / ses["floor_ms"]
            if ses.get("server_ttft_ms"):
                out[f"server_ttft_session_over_floor_turn{t}"] = (
                    ses["server_ttft_ms"] / ses["floor_ms"]
                )
    load = {(row["sessions"], row["mode"]): row for row in figures["load"]}
    for n in sorted({row["sessions"] for row in figures["load"]}):
        out[f"tokens_per_s_concurrent_over_sequential_x{n}"] = (
            load[(n, "concurrent")]["tokens_per_s"] / load[(n, "sequential")]["tokens_per_s"]
        )
    return out


def table(name: str, figures: dict[str, Any]) -> str:
    """Render one environment's figures as Markdown."""
    turns = figures["turns"]
    lines = [
        f"### {name}",
        "",
        "| turn | stateless TTFT / total ms | pixels TTFT / total ms | session TTFT / total "
        "ms | floor ms | bytes sent (stateless / pixels / session) |",
        "|---:|---:|---:|---:|---:|---|",
    ]
    for i in range(len(turns["session"])):
        st, px, se = (turns[s][i] for s in STRATEGIES)
        floor = f"{se['floor_ms']:.1f}" if se.get("floor_ms") else "-"
        lines.append(
            f"| {i + 1} | {st['ttft_ms']:.1f} / {st['total_ms']:.1f} | {px['ttft_ms']:.1f} / "
            f"{px['total_ms']:.1f} | {se['ttft_ms']:.1f} / {se['total_ms']:.1f} | {floor} | "
            f"{st['bytes_sent']:,} / {px['bytes_sent']:,} / {se['bytes_sent']:,} |"
        )
    lines += [
        "",
        "| sessions | one at a time tok/s (p50 / p95 ms) | concurrent tok/s "
        "(p50 / p95 ms) | speed-up |",
        "|---:|---:|---:|---:|",
    ]
    load = {(row["sessions"], row["mode"]): row for row in figures["load"]}
    for n in sorted({row["sessions"] for row in figures["load"]}):
        seq, con = load[(n, "sequential")], load[(n, "concurrent")]
        lines.append(
            f"| {n} | {seq['tokens_per_s']:.0f} ({seq['p50_ms']:.0f} / {seq['p95_ms']:.0f}) | "
            f"{con['tokens_per_s']:.0f} ({con['p50_ms']:.0f} / {con['p95_ms']:.0f}) | "
            f"{con['tokens_per_s'] / seq['tokens_per_s']:.2f}x |"
        )
    lines += [
        "",
        "Ratios: " + ", ".join(f"{k} = {v:.2f}" for k, v in figures["ratios"].items()),
        "",
    ]
    return "\n".join(lines)


def chart(results: dict[str, Any], path: Path) -> None:
    """Plot TTFT per turn for each strategy, one panel per model and environment."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 4), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        for strategy in STRATEGIES:
            rows = results[name]["turns"][strategy]
            ax.plot(
                [r["turn"] for r in rows], [r["ttft_ms"] for r in rows], marker="o", label=strategy
            )
        floor = [r.get("floor_ms") for r in results[name]["turns"]["session"]]
        if any(floor):
            ax.plot(
                [i + 1 for i, f in enumerate(floor) if f],
                [f for f in floor if f],
                linestyle=":",
                color="gray",
                label="floor (bare forward)",
            )
        ax.set_yscale("log")
        ax.set_title(name)
        ax.set_xlabel("turn")
        ax.set_ylabel("time to first token (ms, log)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def start_servers(model_dir: Path, workdir: Path) -> tuple[dict[str, str], list[Any]]:
    """Archive the checkpoint and start one TorchServe per cache mode."""
    from llava.fronts.torchserve.launcher import TorchServe
    from llava.tools.archive import build_archive

    store = workdir / "store"
    build_archive(model_dir, store, name="llava")
    servers, urls = [], {}
    for mode in ("kv", "pixels"):
        ts = TorchServe(
            store,
            "llava",
            workdir=workdir / mode,
            env={"LLAVA_CACHE_MODE": mode, "LLAVA_MAX_NEW_TOKENS": "1024"},
        )
        servers.append(ts.start())
        urls[mode] = ts.url("/predictions/llava")
    return urls, servers


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark and write its results."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", default=[TRAINED, "llava15"])
    parser.add_argument("--concurrency", type=int, nargs="+", default=list(CONCURRENCY))
    parser.add_argument(
        "--envs",
        nargs="+",
        default=["inprocess", "torchserve"],
        choices=["inprocess", "torchserve"],
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)

    from llava.core.config import ServerConfig
    from llava.engines.transformers import LlavaEngine
    from llava.images import ImageLoader
    from llava.tools.archive import resolve_model

    results: dict[str, Any] = {}
    for model in args.models:
        model_dir = resolve_model(model)
        for env in args.envs:
            name = f"{model} / {env}"
            print(f"{name}:", file=sys.stderr)
            servers: list[Any] = []
            try:
                if env == "inprocess":
                    engines = {
                        mode: LlavaEngine.load(model_dir, ServerConfig(cache_mode=mode))
                        for mode in ("kv", "pixels")
                    }
                    driver: Any = InProcess(engines, ImageLoader())
                else:
                    urls, servers = start_servers(model_dir, Path(tempfile.mkdtemp()))
                    driver = OverHttp(urls)
                figures = run_env(
                    driver, model, args.repeats, args.max_new_tokens, tuple(args.concurrency)
                )
            finally:
                for ts in servers:
                    ts.stop()
            if env == "torchserve" and f"{model} / inprocess" in results:
                # The floor is the model's own cost: borrow it from the in-process run.
                floors = results[f"{model} / inprocess"]["turns"]["session"]
                for row, ref in zip(figures["turns"]["session"], floors, strict=True):
                    row["floor_ms"] = ref.get("floor_ms")
            figures["ratios"] = ratios(figures)
            results[name] = figures
            print(table(name, figures))
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": platform.platform(),
        "python": platform.python_version(),
        "repeats": args.repeats,
        "max_new_tokens": args.max_new_tokens,
        "prompts": {model: workload(model)[0] for model in args.models},
    }
    (args.out / "bench.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    chart(results, args.out / "bench.png")
    print(f"wrote {args.out / 'bench.json'} and {args.out / 'bench.png'}", file=sys.stderr)


if __name__ == "__main__":
    main()
