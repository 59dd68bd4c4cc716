"""How far the shared store falls behind when many sessions answer at once.

    python bench/store_lag.py                          # shapes, 64 sessions
    python bench/store_lag.py --model llava15 --sessions 64

One instance assembled as a worker builds one, its store on moto's S3 server on loopback (the
same process, the same 2 cores). `--sessions` sessions are opened, then every one of them is
asked a question in the same batch, `--rounds` times. While the answers run, the store's queue is
sampled every step and then every 5 ms until it is empty: the most writes pending and the
oldest pending write's age (the lag: how long a lost host would lose a finished turn for);
after each round's last answer, how long the store takes to hold every session's latest turn.
Prints a Markdown table and writes bench/results/store-lag-<model>.json.
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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from load import run_meta, workload, write_results  # noqa: E402
from resume import BUCKET, TOKENS, call, s3_api_server  # noqa: E402

from llava.api.headers import SESSION_HEADER  # noqa: E402
from llava.core.config import ServerConfig  # noqa: E402
from llava.core.ids import new_session_id  # noqa: E402
from llava.server.service import Incoming  # noqa: E402


def round_of_answers(inst: Any, sids: list[str], prompt: str) -> dict[str, float]:
    """Ask every session at once; sample the store's queue each step until all are answered."""
    body = json.dumps({"type": "query", "prompt": prompt, "max_new_tokens": TOKENS}).encode()
    rids = {new_session_id(): sid for sid in sids}
    batch = [Incoming(rid, body, {SESSION_HEADER: sid}) for rid, sid in rids.items()]
    pending, lag, left = 0.0, 0.0, set(rids)
    while left:
        replies = inst.service.step(batch)
        for item, reply in zip(batch, replies, strict=True):
            if reply is not None:
                assert reply.status == 200, reply.body
                left.discard(item.request_id)
        stats = inst.shared.stats()
        pending, lag = max(pending, stats["pending"]), max(lag, stats["lag_s"])
        batch = [Incoming(rid, None, {SESSION_HEADER: rids[rid]}) for rid in left]
    answered = time.perf_counter()
    while inst.shared.stats()["pending"]:  # the writes land after the answers: keep sampling
        lag = max(lag, inst.shared.stats()["lag_s"])
        time.sleep(0.005)
    drained = time.perf_counter() - answered
    assert inst.shared.flush(120)
    return {"pending": pending, "lag_s": lag, "drain_s": drained}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="shapes")
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)

    from llava.fronts.assembly import assemble
    from llava.tools.archive import resolve_model

    server, url = s3_api_server()
    work = Path(tempfile.mkdtemp())
    config = ServerConfig(
        device="cpu",
        image_processes=0,
        max_sessions=max(args.sessions, 64),
        snapshot_dir=str(work / "snaps"),
        session_store=f"s3://{BUCKET}/endpoint",
        session_store_endpoint=url,
        session_store_secret="a benchmark's store secret",
    )
    inst = assemble(resolve_model(args.model), config, model_name="llava", registry_dir=str(work))
    load = workload(args.model)
    rounds = []
    try:
        sids = []
        for n in range(args.sessions):
            print(f"opening session {n + 1} of {args.sessions}", file=sys.stderr)
            sids.append(call(inst, {"type": "open_session", "image": load.picture(700 + n)})[1])
        sids = [s["session_id"] for s in sids]
        assert inst.shared.flush(120)
        for n in range(args.rounds):
            print(f"round {n + 1} of {args.rounds}", file=sys.stderr)
            rounds.append(round_of_answers(inst, sids, load.prompts[n % len(load.prompts)]))
        written = inst.shared.stats()["bytes_written"]
    finally:
        inst.service.close()
        inst.shared.close()
        server.stop()

    def worst(key: str) -> float:
        return round(max(r[key] for r in rounds), 3)

    results = {
        **run_meta(args.model, sessions=args.sessions, rounds=args.rounds, tokens=TOKENS),
        "most_writes_pending": int(worst("pending")),
        "longest_lag_s": worst("lag_s"),
        "drain_after_last_answer_s": {
            "median": round(statistics.median(r["drain_s"] for r in rounds), 3),
            "worst": worst("drain_s"),
        },
        "bytes_written": written,
    }
    table = "\n".join(
        [
            f"| {args.model}, {args.sessions} sessions answering at once | worst of "
            f"{args.rounds} rounds |",
            "|---|---:|",
            f"| writes pending at most | {results['most_writes_pending']} |",
            f"| oldest pending write's age (lag) | {results['longest_lag_s']} s |",
            f"| store holds every latest turn, after the last answer | "
            f"{results['drain_after_last_answer_s']['worst']} s |",
        ]
    )
    write_results(args.out / f"store-lag-{args.model}.json", results, table)


if __name__ == "__main__":
    main()
