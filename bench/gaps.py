"""Stream gaps while pictures open, on vLLM's engine: the kit against bare `vllm serve`, same
release, checkpoint, settings and machine, in one run (servers from bench/peer.py).

One chat answer streams (/v1/chat/completions, a token per event); after it has streamed
quietly for a while, 4 new pictures (1024x768 photos) arrive at once from another process:
- `chat opens`: each in a chat request asking for one token (what any OpenAI client sends; the
  same requests to both servers);
- `session opens` (the kit only): each as a session opened through the session API.
The figure is the stream's longest gap between two events while they open, against its quiet
median gap (bench/load.py's measure, which gives the reference's figure through TorchServe).
Each is measured `--runs` times after a warm-up run; the worst run is the figure. The first row
is vLLM's engine alone, stepped in a loop with no server, given the same requests with their
pictures already processed (bench/engine_gaps.py): what the engine's own steps make of the opens.

    unshare -n sh -c 'ip link set lo up && .venv-vllm/bin/python bench/gaps.py'
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from engine_gaps import engine_gaps  # noqa: E402
from load import _gaps, run_meta, write_results  # noqa: E402
from peer import (  # noqa: E402
    MODEL_NAME,
    Server,
    checkpoint_of,
    on_gpu,
    photo_uri,
    settle,
    start_kit_torchserve,
    start_vllm,
)

JSON = {"Content-Type": "application/json"}


def chat_body(image: str, question: str, tokens: int, stream: bool) -> bytes:
    content = [
        {"type": "image_url", "image_url": {"url": image}},
        {"type": "text", "text": question},
    ]
    return json.dumps(
        {
            "model": MODEL_NAME,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": tokens,
            "temperature": 0,
            "stream": stream,
        }
    ).encode()


def open_by_chat(url: str, image: str) -> None:
    reply = httpx.post(url, content=chat_body(image, "What is this?", 1, False), headers=JSON)
    reply.raise_for_status()


def open_by_session(url: str, image: str) -> None:
    body = json.dumps({"type": "open_session", "image": image}).encode()
    reply = httpx.post(url, content=body, headers=JSON, timeout=600)
    reply.raise_for_status()


def open_all(how: str, url: str, images: list[str]) -> tuple[float, float]:
    """Open every picture at once (in the opener process); return when it started and when the
    last was answered (perf_counter: the system's monotonic clock, as in the stream's process)."""
    opener = open_by_chat if how == "chat" else open_by_session
    with ThreadPoolExecutor(len(images)) as pool:
        started = time.perf_counter()
        list(pool.map(lambda image: opener(url, image), images))
        return started, time.perf_counter()


def stream_gaps(
    server: Server, how: str, opener: ProcessPoolExecutor, seed: int, args: Any
) -> dict[str, Any]:
    """Stream one answer; open `args.opens` new pictures at once after some quiet events."""
    body = chat_body(photo_uri(seed, 0), "Tell me a long story.", args.tokens, True)
    images = [photo_uri(seed + 1 + i, args.photo_px) for i in range(args.opens)]
    url = server.session_url if how == "session" else server.chat_url
    assert url is not None
    events: list[float] = []

    def watch() -> None:
        with httpx.stream("POST", server.chat_url, content=body, headers=JSON, timeout=600) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    events.append(time.perf_counter())

    streamer = threading.Thread(target=watch)
    streamer.start()
    while len(events) < args.quiet and streamer.is_alive():
        time.sleep(0.005)
    started, ended = opener.submit(open_all, how, url, images).result()
    streamer.join()
    if not events or events[-1] < ended:
        raise RuntimeError("the stream ended before the opens finished: ask for more --tokens")
    return {
        **_gaps(events, {"start": started, "end": ended}),
        "opens_wall_ms": round((ended - started) * 1000, 1),
        "events": len(events),
    }


def measure(server: Server, how: str, args: Any, seed: int) -> dict[str, Any]:
    """A warm-up run, then `args.runs`; the worst run is the figure."""
    spawn = multiprocessing.get_context("spawn")
    # the opener: another process at the lowest priority, as a remote client takes no CPU
    with ProcessPoolExecutor(1, mp_context=spawn, initializer=os.nice, initargs=(19,)) as opener:
        stream_gaps(server, how, opener, seed, args)
        runs = [
            stream_gaps(server, how, opener, seed + 100 * (i + 1), args) for i in range(args.runs)
        ]
    for run in runs:
        print(f"{server.name}, {how} opens: {run}", file=sys.stderr, flush=True)
    return summary(runs)


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The worst run's figures, the median run's ratio, and every run."""
    worst = max(runs, key=lambda r: r["gap_ratio"])
    ratios = sorted(r["gap_ratio"] for r in runs)
    return {**worst, "median_gap_ratio": ratios[len(ratios) // 2], "runs": runs}


def table(gaps: dict[str, Any]) -> str:
    lines = [
        "| server | opens | quiet median gap | longest gap while 4 open | ratio (worst run / "
        "median run) | opens took |",
        "|---|---|---|---|---|---|",
    ]
    for label, g in gaps.items():
        server, how = label.split(" / ")
        lines.append(
            f"| {server} | {how} | {g['quiet_median_ms']} ms | {g['longest_gap_ms']} ms "
            f"| {g['gap_ratio']}x / {g['median_gap_ratio']}x | {g['opens_wall_ms']} ms |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="llava15")
    parser.add_argument("--dtype", default="auto", help="auto: bfloat16 on a GPU, else float32")
    parser.add_argument("--opens", type=int, default=4)
    parser.add_argument("--photo-px", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=400, help="the streamed answer's length")
    parser.add_argument("--quiet", type=int, default=40, help="events streamed before the opens")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--kv-gb", type=float, default=1.0, help="each vLLM's KV cache")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument(
        "--step-tokens",
        type=int,
        default=0,
        help="both servers' tokens per step (vLLM's max_num_batched_tokens); 0: each one's own",
    )
    parser.add_argument(
        "--only",
        choices=["engine", "vllm", "kit"],
        help="measure one server, or the engine alone (a run to set beside another)",
    )
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)
    args.ray = False
    gpu = on_gpu()
    settle(args, gpu)
    work = Path(tempfile.mkdtemp(prefix="bench-gaps-"))
    checkpoint = checkpoint_of(args.model, work, gpu)
    meta = run_meta(args.model, photo_px=args.photo_px, step_tokens=args.step_tokens)
    results: dict[str, Any] = {"meta": meta, "gaps": {}}
    plan = [(start_vllm, ["chat"]), (start_kit_torchserve, ["chat", "session"])]
    if args.only:
        plan = [step for step in plan if args.only in step[0].__name__]
    name = f"gaps-vllm-{args.step_tokens}" if args.step_tokens else "gaps-vllm"
    if args.only:  # a part of a run: never in place of a whole run's file
        name += f"-{args.only}"
    if args.only in (None, "engine"):
        print("stepping vLLM's engine alone ...", file=sys.stderr)
        results["gaps"]["engine alone / processed opens"] = summary(
            engine_gaps(checkpoint, args, seed=10_000)
        )
        write_results(args.out / f"{name}.json", results, table(results["gaps"]))
    for start, ways in plan:
        print(f"starting {start.__name__.removeprefix('start_')} ...", file=sys.stderr)
        server = start(checkpoint, args, work)
        try:
            for how in ways:
                # the same pictures on each server, none any server has seen before
                seed = 10_000 * (1 + ways.index(how))
                label = f"{server.name} / {how} opens"
                results["gaps"][label] = measure(server, how, args, seed)
                write_results(args.out / f"{name}.json", results, table(results["gaps"]))
        finally:
            server.stop()


if __name__ == "__main__":
    main()
