"""What a turn's prompt costs the kit: rendered and tokenized from the last turn's, or whole.

    python bench/prompts.py                    # every family's template, 100-turn chats
    python bench/prompts.py --models shapes --turns 200

Before a turn's forward the kit renders the conversation with the checkpoint's chat template and
tokenizes it. Whole, that grows with the conversation; from the last turn's prompt
(`llava/engines/conversation/incremental.py`) it should not. Both ways run side by side on the same
chats, every turn (each checked to give the same ids), and the figures are the mean of turns
2-11 and of the last 10, in milliseconds: bench/results/prompts.json and a Markdown table.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from load import run_meta, write_results  # noqa: E402

QUESTIONS = ["What colour is the circle?", "And the other one?", "How many shapes are there?"]
ANSWERS = ["The circle is red.", "The square is blue.", "There are two shapes."]


def one_chat(chat: Any, turns: int, rng: random.Random) -> dict[str, list[float]]:
    """Time both ways on every turn of one chat; return their per-turn milliseconds."""
    from llava.engines.conversation.chat import Exchange

    history: list[Exchange] = []
    held = None
    times: dict[str, list[float]] = {"incremental": [], "whole": []}
    for turn in range(turns):
        messages = chat.messages(None, history, rng.choice(QUESTIONS))
        started = time.perf_counter()
        rendered = chat.prompt(messages, [576], held)
        times["incremental"].append((time.perf_counter() - started) * 1000)
        started = time.perf_counter()
        whole = chat.tokenize(chat.render(messages), [576])
        times["whole"].append((time.perf_counter() - started) * 1000)
        if rendered.ids != whole:
            raise AssertionError(f"turn {turn + 1}: the ids differ from the whole text's")
        held = rendered
        history.append(Exchange(messages[-1]["content"][-1]["text"], rng.choice(ANSWERS)))
    return times


def main(argv: list[str] | None = None) -> None:
    """Run both ways on each model's template and write the figures."""
    from llava.engines.checkpoint import load_processor
    from llava.engines.conversation.chat import ChatFormatter
    from llava.tools.archive import resolve_model

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--models", nargs="+", default=["shapes", "llava15", "next", "interleave", "onevision"]
    )
    parser.add_argument("--turns", type=int, default=100)
    parser.add_argument("--chats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)
    if args.turns < 20:
        parser.error("--turns below 20: turns 2-11 and the last 10 would overlap")
    results: dict[str, Any] = {}
    rows = [
        "| model | incremental: turns 2-11 | last 10 | whole: turns 2-11 | last 10 |",
        "|---|---:|---:|---:|---:|",
    ]
    for model in args.models:
        chat = ChatFormatter(load_processor(resolve_model(model)))
        rng = random.Random(0)
        chats = [one_chat(chat, args.turns, rng) for _ in range(args.chats)]
        figures = {}
        for way in ("incremental", "whole"):
            per_turn = [statistics.median(c[way][t] for c in chats) for t in range(args.turns)]
            figures[way] = {
                "per_turn_ms": per_turn,
                "early_ms": statistics.mean(per_turn[1:11]),
                "late_ms": statistics.mean(per_turn[-10:]),
            }
        results[model] = {"incremental_used": chat.incremental, **figures}
        inc, whole = figures["incremental"], figures["whole"]
        rows.append(
            f"| {model} | {inc['early_ms']:.3f} | {inc['late_ms']:.3f} | "
            f"{whole['early_ms']:.3f} | {whole['late_ms']:.3f} |"
        )
    meta = run_meta(",".join(args.models), turns=args.turns, chats=args.chats)
    write_results(args.out / "prompts.json", {"meta": meta, "results": results}, "\n".join(rows))


if __name__ == "__main__":
    main()
