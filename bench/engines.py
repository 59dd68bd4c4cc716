"""The same chats on `engine: vllm` and `engine: transformers`, side by side in one run.

Two TorchServes from one environment (the vLLM one: `make venv-vllm`), one per engine, serving
the same checkpoint in float32; driven one at a time, interleaved, each figure the median of
`--repeats` runs. Each chat opens a session with a drawn picture and asks `--turns` questions
through the session API, streamed, greedy, `--tokens` tokens at most.

Figures per engine: first-turn TTFT (the open plus the first question's first token), follow-up
TTFT, decode tokens/s after the first token, and aggregate output tokens/s with 1, 4, 8 and 16
chats at once; then the vLLM / transformers ratios. Prints a table and writes
bench/results/engines-<model>.json.

    .venv-vllm/bin/python bench/engines.py --model llava15

On a GPU (`make bench-gpu`): `--model llava15-7b`, in bf16, built on the card; the vLLM engine
starts first and takes half the card's memory, the transformers engine what is left.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.drivers import SCENE_PROMPTS, scene_uri  # noqa: E402
from bench.peer import checkpoint_of, on_gpu  # noqa: E402
from llava.api.headers import SESSION_HEADER  # noqa: E402
from llava.fronts.torchserve.launcher import TorchServe  # noqa: E402
from llava.tools.archive import build_archive  # noqa: E402

ENGINES = ("vllm", "transformers")
CONCURRENCY = (1, 4, 8, 16)


def engine_env(engine: str, gpu: bool) -> dict[str, str]:
    """Each engine's server settings: the same dtype; on a GPU vLLM takes half the card."""
    env = {
        **{k: v for k, v in os.environ.items() if k.startswith("LLAVA_") and engine == "vllm"},
        "LLAVA_ENGINE": engine,
        "LLAVA_DTYPE": "bfloat16" if gpu else "float32",
        "LLAVA_MAX_SESSIONS": "64",
        "VLLM_CPU_KVCACHE_SPACE": "2",
    }
    if gpu and engine == "vllm":
        env["LLAVA_GPU_MEMORY_UTILIZATION"] = "0.45"
    return env


def serve(engine: str, store: Path, workdir: Path, gpu: bool) -> TorchServe:
    env = engine_env(engine, gpu)
    return TorchServe(store, "llava", workdir=workdir / engine, env=env).start(timeout_s=600)


def chat(url: str, seed: int, turns: int, tokens: int) -> dict[str, Any]:
    """One conversation: open, then `turns` streamed questions; timings per turn."""
    out: dict[str, Any] = {"ttft": [], "decode": [], "tokens": 0}
    with httpx.Client(timeout=600) as client:
        started = time.perf_counter()
        r = client.post(url, json={"type": "open_session", "image": scene_uri(seed)})
        r.raise_for_status()
        sid = r.json()["session_id"]
        for turn in range(turns):
            body = {"type": "query", "prompt": SCENE_PROMPTS[turn % len(SCENE_PROMPTS)]}
            body |= {"max_new_tokens": tokens, "stream": True}
            sent = started if turn == 0 else time.perf_counter()
            first = end = None
            usage: dict[str, Any] = {}
            with client.stream("POST", url, json=body, headers={SESSION_HEADER: sid}) as r:
                for line in r.iter_lines():
                    if not line:
                        continue
                    part = json.loads(line)
                    if "error" in part:
                        raise RuntimeError(part["error"])
                    if part.get("text") and first is None:
                        first = time.perf_counter()
                    usage = part.get("usage") or usage
            end = time.perf_counter()
            generated = int(usage.get("generated_tokens", 0))
            out["tokens"] += generated
            first = first or end
            out["ttft"].append((first - sent) * 1000)
            if generated > 1 and end > first:
                out["decode"].append((generated - 1) / (end - first))
        client.post(url, json={"type": "close_session"}, headers={SESSION_HEADER: sid})
    return out


def warm_up(url: str, tokens: int) -> None:
    """Run chats the figures do not count: an engine's first requests compile and allocate."""
    for chats in (1, 4):
        run(url, chats, 2, tokens, 90_000)


def run(url: str, chats: int, turns: int, tokens: int, seed: int) -> dict[str, Any]:
    """`chats` conversations at once; per-turn figures and the aggregate rate."""
    started = time.perf_counter()
    with ThreadPoolExecutor(chats) as pool:
        results = list(pool.map(lambda i: chat(url, seed + i, turns, tokens), range(chats)))
    wall = time.perf_counter() - started
    return {
        "first_ttft_ms": statistics.median(r["ttft"][0] for r in results),
        "follow_ttft_ms": statistics.median(t for r in results for t in r["ttft"][1:]),
        "decode_tps": statistics.median(d for r in results for d in r["decode"] or [0.0]),
        "aggregate_tps": sum(r["tokens"] for r in results) / wall,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llava15", help="shapes, llava15, tiny-vllm, ...")
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--concurrency", default=",".join(map(str, CONCURRENCY)))
    args = parser.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    work = Path(tempfile.mkdtemp(prefix="bench-engines-"))
    store = work / "store"
    gpu = on_gpu()
    build_archive(checkpoint_of(args.model, work, gpu), store, name="llava")
    servers = {}
    try:
        for engine in ENGINES:
            print(f"starting TorchServe with engine: {engine} ...", flush=True)
            servers[engine] = serve(engine, store, work, gpu)
            warm_up(servers[engine].url("/predictions/llava"), args.tokens)
        runs: dict[str, dict[int, list[dict[str, Any]]]] = {
            e: {c: [] for c in levels} for e in ENGINES
        }
        for repeat in range(args.repeats):
            for chats in levels:
                for engine in ENGINES if repeat % 2 == 0 else ENGINES[::-1]:  # interleaved
                    url = servers[engine].url("/predictions/llava")
                    figures = run(url, chats, args.turns, args.tokens, 1000 * repeat)
                    runs[engine][chats].append(figures)
                    print(
                        f"repeat {repeat + 1}/{args.repeats}, {chats} chats, {engine}: {figures}",
                        flush=True,
                    )
    finally:
        for ts in servers.values():
            ts.stop()
    medians = {
        engine: {
            str(c): {
                k: statistics.median(r[k] for r in runs[engine][c]) for k in runs[engine][c][0]
            }
            for c in levels
        }
        for engine in ENGINES
    }
    ratios = {
        str(c): {
            k: round(medians["vllm"][str(c)][k] / max(medians["transformers"][str(c)][k], 1e-9), 2)
            for k in medians["vllm"][str(c)]
        }
        for c in levels
    }
    print(f"\n{args.model}: medians of {args.repeats} (vllm / transformers; TTFT: lower is better)")
    print(f"{'chats':>5} {'figure':<15} {'vllm':>10} {'transformers':>13} {'ratio':>7}")
    for c in levels:
        for k in medians["vllm"][str(c)]:
            v, t = medians["vllm"][str(c)][k], medians["transformers"][str(c)][k]
            print(f"{c:>5} {k:<15} {v:>10.1f} {t:>13.1f} {ratios[str(c)][k]:>7.2f}")
    out = ROOT / "bench" / "results" / f"engines-{args.model}.json"
    out.write_text(
        json.dumps(
            {"args": vars(args), "medians": medians, "ratios": ratios, "runs": runs}, indent=1
        )
    )
    print(f"saved {out}")


if __name__ == "__main__":
    main()
