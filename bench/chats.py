"""Chat clients' follow-ups: header-less reuse against the session header and one-shot serving.

    python bench/chats.py                     # llava15 through TorchServe, then the 100-turn curve
    python bench/chats.py --turns 6 --long-turns 0    # the side-by-side table only

A chat client re-sends the whole conversation every turn, its image as base64 each time. One
server, one run, three ways side by side for every turn: **header-less** (what Open WebUI,
LibreChat, LangChain and Gradio send: no session header; the kit finds what it holds of the
chat), **session header** (`X-Amzn-SageMaker-Session-Id`, the kit's stateful path) and
**one-shot** (the same chat with a system prompt no other request shares, so nothing held
matches: everything is recomputed, as a server without reuse would). Time to first token is the
client's: the first streamed chunk that carries a token. Then `--long-chats` chats of
`--long-turns` turns, header-less and with the header, for the curve of follow-up TTFT against
the turn, and beside it the model's own forward over each turn's new tokens at that context
(transformers alone, the server stopped): on a CPU attention over a long cache is a real part
of a forward, which no server removes. Figures go to bench/results/chats.json and the
terminal (Markdown tables).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from load import photo_uri, run_meta, start, write_results  # noqa: E402

from llava.api.headers import NEW_SESSION, NEW_SESSION_HEADER, SESSION_HEADER  # noqa: E402

QUESTIONS = [
    "What is shown in this picture?",
    "Which colors stand out?",
    "Is there anything unusual?",
    "Describe the left part.",
    "What happened just before?",
    "Summarize in one sentence.",
]


class Chat:
    """One chat as a chat client holds it: the messages, re-sent whole every turn."""

    def __init__(self, url: str, image: str, system: str, tokens: int, header: str | None) -> None:
        self.url, self.tokens, self.header = url, tokens, header
        self.messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
        self.image = image
        self.http = httpx.Client(timeout=600)

    def ask(self, question: str) -> dict[str, Any]:
        """Send the chat with one more question, streamed; return TTFT and usage."""
        first = len(self.messages) == 1
        content: Any = question
        if first:
            content = [
                {"type": "image_url", "image_url": {"url": self.image}},
                {"type": "text", "text": question},
            ]
        self.messages.append({"role": "user", "content": content})
        body = {
            "model": "llava",
            "messages": self.messages,
            "max_tokens": self.tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        headers = {"Content-Type": "application/json"}
        if self.header is not None:
            headers[SESSION_HEADER] = self.header
        sent = time.perf_counter()
        ttft, text, usage = None, [], {}
        with self.http.stream("POST", self.url, json=body, headers=headers) as r:
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:300]!r}")
            if self.header == NEW_SESSION:
                self.header = r.headers[NEW_SESSION_HEADER].split(";")[0]
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if event.get("usage"):
                    usage = event["usage"]
                for choice in event.get("choices", []):
                    if "content" in choice.get("delta", {}):
                        ttft = ttft or time.perf_counter()
                        text.append(choice["delta"]["content"])
        self.messages.append({"role": "assistant", "content": "".join(text)})
        return {
            "ttft_ms": round(1000 * ((ttft or time.perf_counter()) - sent), 1),
            "prompt_tokens": usage.get("prompt_tokens"),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
        }


def side_by_side(url: str, image: str, turns: int, tokens: int, repeats: int) -> dict[str, Any]:
    """Per turn, the three ways interleaved (one turn of each in turn), medians of repeats."""
    runs: dict[str, list[list[dict[str, Any]]]] = {"header-less": [], "session": [], "one-shot": []}
    for repeat in range(repeats):
        chats = {
            "header-less": Chat(url, image, f"Answer briefly. ({repeat})", tokens, None),
            "session": Chat(url, image, f"Answer briefly. ({repeat})", tokens, NEW_SESSION),
        }
        one_shot = Chat(url, image, "", tokens, None)
        rows: dict[str, list[dict[str, Any]]] = {name: [] for name in runs}
        for turn in range(turns):
            question = QUESTIONS[turn % len(QUESTIONS)]
            for name, chat in chats.items():
                rows[name].append(chat.ask(question))
            # a system prompt of its own every turn: nothing held matches
            one_shot.messages[0]["content"] = f"Answer briefly. ({repeat}.{turn}.{time.time()})"
            rows["one-shot"].append(one_shot.ask(question))
            print(f"repeat {repeat + 1}, turn {turn + 1}: " + ", ".join(
                f"{n} {rows[n][-1]['ttft_ms']} ms" for n in rows), file=sys.stderr)  # fmt: skip
        for name in runs:
            runs[name].append(rows[name])
    out: dict[str, Any] = {}
    for name, conversations in runs.items():
        out[name] = [
            {
                "turn": turn + 1,
                "ttft_ms": statistics.median(c[turn]["ttft_ms"] for c in conversations),
                "cached_tokens": conversations[0][turn]["cached_tokens"],
                "prompt_tokens": conversations[0][turn]["prompt_tokens"],
            }
            for turn in range(turns)
        ]
    return out


EARLY, LATE = slice(1, 11), slice(-10, None)  # turns 2-11, and the last 10


def early_late(values: list[float]) -> tuple[float, float]:
    """The mean of a long chat's figures over turns 2-11, and over its last 10 turns."""
    return statistics.mean(values[EARLY]), statistics.mean(values[LATE])


def long_chat(url: str, images: list[str], turns: int, tokens: int) -> dict[str, Any]:
    """Chats of many turns, header-less and with the session header turn by turn, one per
    image: follow-up TTFT against the turn, the median over the chats at each turn."""
    runs: dict[str, list[list[dict[str, Any]]]] = {"header-less": [], "session": []}
    for n, image in enumerate(images):
        chats = {
            "header-less": Chat(url, image, f"Answer briefly. ({n})", tokens, None),
            "session": Chat(url, image, f"Answer briefly (session {n}).", tokens, NEW_SESSION),
        }
        rows: dict[str, list[dict[str, Any]]] = {name: [] for name in chats}
        for turn in range(turns):
            for name, chat in chats.items():
                rows[name].append({"turn": turn + 1, **chat.ask(QUESTIONS[turn % len(QUESTIONS)])})
            if (turn + 1) % 10 == 0:
                last = {name: r[-1]["ttft_ms"] for name, r in rows.items()}
                print(f"long chat {n + 1}/{len(images)}: turn {turn + 1}, {last}", file=sys.stderr)
        for name in runs:
            runs[name].append(rows[name])
    medians = {
        name: [
            {**chats[0][turn], "ttft_ms": statistics.median(c[turn]["ttft_ms"] for c in chats)}
            for turn in range(turns)
        ]
        for name, chats in runs.items()
    }
    out: dict[str, Any] = {"chats": len(images), "rows": medians}
    for name, chat_rows in medians.items():
        early, late = early_late([r["ttft_ms"] for r in chat_rows])
        each = [b / a for a, b in (early_late([r["ttft_ms"] for r in c]) for c in runs[name])]
        out[name] = {
            "mean_turns_2_11_ms": round(early, 1),
            f"mean_turns_{turns - 9}_{turns}_ms": round(late, 1),
            "late_over_early": round(late / early, 3),
            "late_over_early_each_chat": [round(r, 3) for r in each],
        }
    return out


def floors(model: Any, rows: list[dict[str, Any]], repeats: int = 5) -> list[float]:
    """The model's own cost of each turn: one bare forward (transformers, no kit) over the
    turn's new tokens on a cache as long as what the turn reused, timed with the server
    stopped, where the server ran it (the GPU; on a CPU, as many threads as the server's
    torch: all CPUs). The ids are random: a forward's time depends on the lengths only."""
    import torch

    device = model.device

    def ids(count: int) -> Any:
        return torch.randint(3, 300, (1, count), device=device)

    def done() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    longest = max(r["cached_tokens"] for r in rows)
    out: dict[int, float] = {}
    with torch.inference_mode():
        cache = model(input_ids=ids(longest), use_cache=True).past_key_values
        length = longest
        for i in sorted(range(len(rows)), key=lambda i: -rows[i]["cached_tokens"]):
            context, new = (
                rows[i]["cached_tokens"],
                rows[i]["prompt_tokens"] - rows[i]["cached_tokens"],
            )
            if length > context:
                cache.crop(context - length)
                length = context
            times = []
            for _ in range(repeats):
                fed = ids(max(new, 1))
                started = done()
                model(input_ids=fed, past_key_values=cache, logits_to_keep=1)
                times.append((done() - started) * 1000)
                cache.crop(-max(new, 1))
            out[i] = statistics.median(times)
    return [round(out[i], 1) for i in range(len(rows))]


def add_floors(model_dir: Path, long: dict[str, Any]) -> None:
    """Beside each long chat's early and late TTFT, the model's own forward at those turns:
    what grows with the context on this machine whatever serves it."""
    from llava.core.config import ServerConfig
    from llava.engines.transformers.model.loading import load_model, resolve_devices

    config = ServerConfig()  # the server's defaults: its device and dtype
    model = load_model(model_dir, resolve_devices(config)[0], config)
    for name in ("header-less", "session"):
        rows = long["rows"][name]
        turns = [*rows[EARLY], *rows[LATE]]  # 10 turns each, timed on one cache
        floor = floors(model, turns)
        early, late = statistics.mean(floor[:10]), statistics.mean(floor[10:])
        long[name]["floor_early_ms"], long[name]["floor_late_ms"] = round(early, 1), round(late, 1)
        long[name]["floor_late_over_early"] = round(late / early, 3)
        over = [r["ttft_ms"] - f for r, f in zip(turns, floor, strict=True)]
        long[name]["above_floor_early_ms"] = round(statistics.mean(over[:10]), 1)
        long[name]["above_floor_late_ms"] = round(statistics.mean(over[10:]), 1)


def tables(results: dict[str, Any]) -> str:
    side = results["side_by_side"]
    lines = [
        "| turn | header-less TTFT ms (cached / prompt tokens) | session header TTFT ms "
        "| one-shot TTFT ms | header-less / session |",
        "|---:|---:|---:|---:|---:|",
    ]
    for h, s, o in zip(side["header-less"], side["session"], side["one-shot"], strict=True):
        lines.append(
            f"| {h['turn']} | {h['ttft_ms']} ({h['cached_tokens']} / {h['prompt_tokens']}) "
            f"| {s['ttft_ms']} | {o['ttft_ms']} | {h['ttft_ms'] / s['ttft_ms']:.2f}x |"
        )
    long = results.get("long_chat")
    if long:
        lines += [
            "",
            "| long chat (median of chats per turn) | mean TTFT, turns 2-11 "
            "| mean TTFT, last 10 turns | late / early (each chat) "
            "| model's own forward, early -> late | TTFT above it, early -> late |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for name in ("header-less", "session"):
            figures, turns = long[name], len(long["rows"][name])
            early, late = (
                figures["mean_turns_2_11_ms"],
                figures[f"mean_turns_{turns - 9}_{turns}_ms"],
            )
            each = ", ".join(f"{r}x" for r in figures["late_over_early_each_chat"])
            lines.append(
                f"| {name} | {early} ms | {late} ms | {figures['late_over_early']}x ({each}) "
                f"| {figures['floor_early_ms']} -> {figures['floor_late_ms']} ms "
                f"({figures['floor_late_over_early']}x) "
                f"| {figures['above_floor_early_ms']} -> {figures['above_floor_late_ms']} ms |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="llava15")
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--long-turns", type=int, default=100)
    parser.add_argument("--long-chats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)
    if 0 < args.long_turns < 20:  # turns 2-11 against the last 10: two windows apart
        parser.error("--long-turns must be 0 (none) or at least 20")

    from llava.tools.archive import build_archive, resolve_model

    work = Path(tempfile.mkdtemp())
    build_archive(resolve_model(args.model), work / "store", name="llava")
    image = photo_uri(7, (640, 400))
    ts = start(work / "store", work / "chats")
    try:
        url = ts.url("/predictions/llava/1.0/v1/chat/completions")
        results: dict[str, Any] = {
            "meta": run_meta(args.model, answer_tokens=args.tokens, repeats=args.repeats),
            "side_by_side": side_by_side(url, image, args.turns, args.tokens, args.repeats),
        }
        if args.long_turns:
            images = [photo_uri(8 + n, (640, 400)) for n in range(args.long_chats)]
            results["long_chat"] = long_chat(url, images, args.long_turns, 8)
    finally:
        ts.stop()
    if args.long_turns:
        add_floors(resolve_model(args.model), results["long_chat"])
    write_results(args.out / "chats.json", results, tables(results))


if __name__ == "__main__":
    main()
