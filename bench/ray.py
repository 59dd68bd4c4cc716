"""The Ray Serve front against itself and against TorchServe, side by side in one run.

    python bench/ray.py                  # re-runs itself in a private network namespace (Ray binds
                                         # the machine's address): needs root

The model is the random-weight llava15 (its answers run to the token limit, so decode is
measured; the trained `shapes` stops after a few words).

Figures (bench/results/ray.json and the terminal):
- decode tokens/s of 8 concurrent streamed answers with 1 and with 2 replicas on this machine;
- the router's added latency: a request the replica answers at once (an unknown session), through
  ingress, router and replica, against `/ping`, which the ingress answers alone;
- follow-up time to first token through Ray (1 replica) and through TorchServe, same model.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from drivers import SCENE_PROMPTS, query_body, scene_uri  # noqa: E402
from load import Client, run_meta, start, write_results  # noqa: E402

SESSIONS = 8
TOKENS = 32


def decode_rate(url: str, sessions: int = SESSIONS) -> dict[str, float]:
    """Open `sessions` sessions, then stream one answer in each at once; tokens/s over the wall."""
    client = Client(url)
    sids = [client.open(scene_uri(400 + i)) for i in range(sessions)]
    body = query_body(SCENE_PROMPTS[0], TOKENS, stream=True)

    def one(sid: str) -> int:
        times, _ = client.stream(body, sid)
        return len(times)

    began = time.perf_counter()
    with ThreadPoolExecutor(sessions) as pool:
        chunks = list(pool.map(one, sids))
    wall = time.perf_counter() - began
    for sid in sids:
        client.close(sid)
    return {"tokens": sum(chunks), "wall_s": round(wall, 3), "tokens_per_s": sum(chunks) / wall}


def hop_latency(url: str, base: str, rounds: int = 50) -> dict[str, float]:
    """p50 of `/ping` (the ingress alone) and of an unknown session's query (the whole hop)."""
    unknown = {"Content-Type": "application/json", "X-Amzn-SageMaker-Session-Id": "r0-" + "0" * 40}
    body = query_body("hi", 1)
    pings, hops = [], []
    with httpx.Client(timeout=60) as http:
        for _ in range(rounds):
            began = time.perf_counter()
            http.get(base + "/ping")
            pings.append((time.perf_counter() - began) * 1000)
            began = time.perf_counter()
            http.post(url, content=body, headers=unknown)
            hops.append((time.perf_counter() - began) * 1000)
    ping, hop = statistics.median(pings), statistics.median(hops)
    return {"ping_p50_ms": ping, "hop_p50_ms": hop, "added_ms": hop - ping}


def follow_up_ttft(url: str, conversations: int = 4) -> float:
    """Median TTFT of follow-up questions (turns 2-6) of a few conversations."""
    client = Client(url)
    ttfts = []
    for seed in range(conversations):
        sid = client.open(scene_uri(500 + seed))
        for turn, prompt in enumerate(SCENE_PROMPTS):
            sent = time.perf_counter()
            times, _ = client.stream(query_body(prompt, 16, stream=True), sid)
            if turn and times:
                ttfts.append((times[0] - sent) * 1000)
        client.close(sid)
    return statistics.median(ttfts)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="llava15")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)
    if os.environ.get("LLAVA_NETNS") != "1":
        inner = f"ip link set lo up && LLAVA_NETNS=1 {sys.executable} {' '.join(sys.argv)}"
        raise SystemExit(subprocess.call(["unshare", "-n", "sh", "-c", inner]))

    from llava.fronts.ray.launcher import RayServe
    from llava.tools.archive import build_archive, resolve_model

    model_dir = resolve_model(args.model)
    work = Path(tempfile.mkdtemp())
    results: dict[str, Any] = {
        "meta": run_meta(args.model),
        "decode": {},
    }
    for replicas in (1, 2):
        with RayServe(model_dir, replicas=replicas, workdir=work / f"ray-{replicas}") as front:
            url = front.url("/invocations")
            decode_rate(url, 2)  # warm-up
            results["decode"][f"{replicas} replica(s)"] = decode_rate(url)
            print(f"{replicas} replica(s): {results['decode']}", file=sys.stderr)
            if replicas == 1:
                results["router"] = hop_latency(url, front.url())
                results["follow_up_ttft_ms"] = {"ray": follow_up_ttft(url)}
    build_archive(model_dir, work / "store", name="llava")
    ts = start(work / "store", work / "ts")
    try:
        results["follow_up_ttft_ms"]["torchserve"] = follow_up_ttft(ts.url("/predictions/llava"))
    finally:
        ts.stop()
    decode = results["decode"]
    results["ratios"] = {
        "tokens_per_s_2_over_1_replica": decode["2 replica(s)"]["tokens_per_s"]
        / decode["1 replica(s)"]["tokens_per_s"],
        "follow_up_ttft_ray_over_torchserve": results["follow_up_ttft_ms"]["ray"]
        / results["follow_up_ttft_ms"]["torchserve"],
    }
    shutil.rmtree(work, ignore_errors=True)
    write_results(args.out / "ray.json", results, table(results))


def table(results: dict[str, Any]) -> str:
    """The figures as Markdown."""
    decode, router = results["decode"], results["router"]
    ttft = results["follow_up_ttft_ms"]
    lines = [
        f"### Ray Serve front ({results['meta']['model']}, {results['meta']['cpus']} CPUs)",
        "",
        f"| replicas | {SESSIONS} streams: tokens/s | wall s |",
        "|---:|---:|---:|",
    ]
    for name, row in decode.items():
        lines.append(f"| {name} | {row['tokens_per_s']:.1f} | {row['wall_s']} |")
    lines += [
        "",
        f"Router hop: `/ping` p50 {router['ping_p50_ms']:.1f} ms, unknown-session query p50 "
        f"{router['hop_p50_ms']:.1f} ms: **{router['added_ms']:.1f} ms added** per request.",
        f"Follow-up TTFT p50: Ray {ttft['ray']:.1f} ms, TorchServe {ttft['torchserve']:.1f} ms.",
        "Ratios: " + ", ".join(f"{k} = {v:.2f}" for k, v in results["ratios"].items()),
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
