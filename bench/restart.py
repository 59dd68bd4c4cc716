"""What a worker restart costs a conversation: snapshot bytes, and the first turn after it.

    python bench/restart.py                    # llava15, 4 sessions
    python bench/restart.py --model tiny

Through TorchServe: open sessions (1024x768 images), ask two questions each, then time a normal
follow-up question; `kill -9` the worker, wait for TorchServe's new one, and time each session's
first question after the restart (its prefix is recomputed from the snapshot's image features)
and the one after that. Prints a Markdown table and writes bench/results/restart.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from drivers import query_body  # noqa: E402
from load import JSON, Client, photo_uri, start  # noqa: E402

from llava.api.headers import SESSION_HEADER  # noqa: E402

PROMPTS = ["What is shown in this picture?", "Which colors stand out?", "Anything unusual?"]


def ask(client: Client, sid: str, prompt: str) -> tuple[float, dict[str, Any]]:
    """Ask one 16-token question; return the worker's time to first token (ms) and usage."""
    r = client.http.post(
        client.url,
        content=query_body(prompt, 16, stream=False),
        headers={**JSON, SESSION_HEADER: sid},
    )
    r.raise_for_status()
    usage = r.json()["usage"]
    return usage["ttft_ms"], usage


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="llava15")
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)

    from llava.tools.archive import build_archive, resolve_model

    work = Path(tempfile.mkdtemp())
    build_archive(resolve_model(args.model), work / "store", name="llava")
    ts = start(work / "store", work / "ts")
    try:
        client = Client(ts.url("/predictions/llava"))
        sids = [client.open(photo_uri(500 + i)) for i in range(args.sessions)]
        for sid in sids:
            for prompt in PROMPTS[:2]:
                ask(client, sid, prompt)
        normal = [ask(client, sid, PROMPTS[2]) for sid in sids]
        snapshot_bytes = [usage["snapshot_bytes"] for _, usage in normal]
        pid = ts.worker()["pid"]
        print(f"killing worker {pid}", file=sys.stderr)
        os.kill(pid, signal.SIGKILL)
        began = time.monotonic()
        ts.wait_for_new_worker(pid, timeout_s=900)
        restart_s = time.monotonic() - began
        after = [ask(client, sid, PROMPTS[0]) for sid in sids]
        settled = [ask(client, sid, PROMPTS[1]) for sid in sids]
        for sid in sids:
            client.close(sid)
    finally:
        ts.stop()
    results = {
        "meta": {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "model": args.model},
        "snapshot_bytes_per_session": int(statistics.median(snapshot_bytes)),
        "worker_restart_s": round(restart_s, 1),
        "follow_up_ttft_ms": round(statistics.median(t for t, _ in normal), 1),
        "first_turn_after_restart_ttft_ms": round(statistics.median(t for t, _ in after), 1),
        "next_turn_after_restart_ttft_ms": round(statistics.median(t for t, _ in settled), 1),
        "tier_after_restart": sorted({usage["session_tier"] for _, usage in after}),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"restart-{args.model}.json"
    path.write_text(json.dumps(results, indent=2))
    r = results
    print(
        "| model | snapshot per session | worker back after | follow-up TTFT "
        "| first turn after restart | the turn after |\n|---|---|---|---|---|---|\n"
        f"| {args.model} | {r['snapshot_bytes_per_session'] / 1024:.1f} KiB | "
        f"{r['worker_restart_s']} s | {r['follow_up_ttft_ms']} ms | "
        f"{r['first_turn_after_restart_ttft_ms']} ms | {r['next_turn_after_restart_ttft_ms']} ms |"
    )
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
