"""What the shared session store costs and buys: resuming a conversation on another instance.

    python bench/resume.py                    # the trained default model (shapes)
    python bench/resume.py --model llava15    # LLaVA-1.5's shapes (576 image tokens)

Three instances assembled in this process exactly as a worker builds one (`assemble`), sharing a
real S3 API server on loopback (moto's): `a` and `b` with the store on, `c` with it off. Each
conversation is opened on `a` and asked two questions. Then, interleaved, repeated:
- follow-up time to first token with the store on (`a`) against off (`c`, the same conversation
  held there): the store's writes run on their own thread and must not show;
- the next question asked of `b`, which never held the conversation and resumes it from the
  store, against what a client without a store must do: open the same conversation afresh on
  `c` (image and history sent again) and ask;
and the bytes each session keeps in the store, the store writes per turn, and a 7B snapshot's
size computed from LLaVA-1.5-7B's shapes. Prints a Markdown table and writes
bench/results/resume-<model>.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from load import run_meta, workload, write_results  # noqa: E402

from llava.api.headers import SESSION_HEADER  # noqa: E402
from llava.core.config import ServerConfig  # noqa: E402
from llava.core.ids import new_session_id  # noqa: E402
from llava.server.service import Incoming  # noqa: E402

BUCKET = "bench-sessions"
TOKENS = 8
# LLaVA-1.5-7B: 576 image tokens of 4096 features in bf16, plus ids and text (a few KB).
SEVEN_B_FEATURES = 576 * 4096 * 2


def call(inst: Any, body: dict[str, Any], sid: str | None = None) -> tuple[float, dict[str, Any]]:
    """Step an instance's service until the request is answered; (seconds, JSON body)."""
    rid = new_session_id()
    headers = {SESSION_HEADER: sid} if sid else {}
    started = time.perf_counter()
    batch = [Incoming(rid, json.dumps(body).encode(), headers)]
    while True:
        [reply] = inst.service.step(batch)
        if reply is not None:
            out = json.loads(reply.body)
            if reply.status != 200:
                raise RuntimeError(f"{body.get('type')}: {reply.status} {out}")
            return time.perf_counter() - started, out
        batch = [Incoming(rid, None, headers)]


def ask(inst: Any, sid: str, prompt: str) -> tuple[float, dict[str, Any]]:
    return call(inst, {"type": "query", "prompt": prompt, "max_new_tokens": TOKENS}, sid)


def s3_api_server() -> tuple[Any, str]:
    """Start moto's S3 server on loopback with the benchmark's bucket; (server, its URL)."""
    import boto3
    from moto.server import ThreadedMotoServer

    os.environ.update(
        AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1"
    )
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto's request log
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    boto3.client("s3", endpoint_url=url).create_bucket(Bucket=BUCKET)
    return server, url


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="shapes")
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)

    from llava.fronts.assembly import assemble
    from llava.tools.archive import resolve_model

    server, url = s3_api_server()
    work = Path(tempfile.mkdtemp())
    checkpoint = resolve_model(args.model)

    def instance(name: str, store: bool) -> Any:
        config = ServerConfig(
            device="cpu",
            image_processes=0,
            snapshot_dir=str(work / f"snaps-{name}"),
            session_store=f"s3://{BUCKET}/endpoint" if store else "",
            session_store_endpoint=url if store else "",
            session_store_secret="a benchmark's store secret" if store else "",
        )
        print(f"loading instance {name}", file=sys.stderr)
        return assemble(checkpoint, config, model_name="llava", registry_dir=str(work / name))

    a, b, c = instance("a", True), instance("b", True), instance("c", False)
    load = workload(args.model)
    prompts = load.prompts
    on, off, resumed, reopened, sizes, per_turn = [], [], [], [], [], []
    try:
        for n in range(args.conversations):
            picture = load.picture(900 + n)
            print(f"conversation {n + 1} of {args.conversations}", file=sys.stderr)
            sid_a = call(a, {"type": "open_session", "image": picture})[1]["session_id"]
            sid_c = call(c, {"type": "open_session", "image": picture})[1]["session_id"]
            history = []
            for prompt in prompts[:2]:
                answer = ask(a, sid_a, prompt)[1]["text"]
                ask(c, sid_c, prompt)
                history.append([prompt, answer])
            a.shared.flush(30)
            written = a.shared.stats()["bytes_written"]
            for k, prompt in enumerate(prompts[2:]):  # store on and off, each first in turn
                if (n + k) % 2:
                    off.append(ask(c, sid_c, prompt)[1]["usage"]["ttft_ms"])
                reply = ask(a, sid_a, prompt)[1]
                on.append(reply["usage"]["ttft_ms"])
                if not (n + k) % 2:
                    off.append(ask(c, sid_c, prompt)[1]["usage"]["ttft_ms"])
                history.append([prompt, reply["text"]])
            a.shared.flush(30)
            sizes.append(a.shared.size_of(sid_a))
            per_turn.append((a.shared.stats()["bytes_written"] - written) / len(prompts[2:]))
            # the next question on an instance that never held it: resumed from the store ...
            seconds, reply = ask(b, sid_a, prompts[2])
            assert reply["usage"]["session_tier"] == "store", reply["usage"]
            resumed.append(seconds * 1000)
            # ... or, with no store, the conversation opened again from scratch and asked
            body = {"type": "open_session", "image": picture, "history": history}
            opened_s, fresh = call(c, body)
            asked_s, _ = ask(c, fresh["session_id"], prompts[2])
            reopened.append((opened_s + asked_s) * 1000)
        writes = a.shared.stats()["writes"]
        turns = args.conversations * (1 + len(prompts))  # the open and each answer
    finally:
        for inst in (a, b, c):
            inst.service.close()
            if inst.shared is not None:
                inst.shared.close()
        server.stop()

    def med(xs: list[float]) -> float:
        return round(statistics.median(xs), 1)

    results = {
        **run_meta(args.model, conversations=args.conversations, tokens=TOKENS),
        "follow_up_ttft_ms": {"store_on": med(on), "store_off": med(off)},
        "store_on_over_off": round(statistics.median(on) / statistics.median(off), 2),
        "next_answer_ms": {"resumed_from_store": med(resumed), "opened_again": med(reopened)},
        "resume_over_reopen": round(statistics.median(resumed) / statistics.median(reopened), 2),
        "store_bytes_per_session": int(statistics.median(sizes)),
        "store_writes_per_turn": round(writes / turns, 2),
        # each follow-up writes the snapshot's skeleton; pictures (parts) were written once
        "store_bytes_written_per_follow_up": int(statistics.median(per_turn)),
        "seven_b_snapshot_bytes": SEVEN_B_FEATURES,
    }
    table = "\n".join(
        [
            f"| {args.model} | median |",
            "|---|---:|",
            f"| follow-up TTFT, store on / off | {med(on)} / {med(off)} ms "
            f"({results['store_on_over_off']}x) |",
            f"| next answer on another instance: resumed / opened again | {med(resumed)} / "
            f"{med(reopened)} ms ({results['resume_over_reopen']}x) |",
            f"| bytes per session in the store | {results['store_bytes_per_session']:,} |",
            f"| store writes per turn | {results['store_writes_per_turn']} |",
            "| bytes written per follow-up: now (pictures once) / the whole snapshot (before) | "
            f"{results['store_bytes_written_per_follow_up']:,} / "
            f"{results['store_bytes_per_session']:,} |",
            f"| LLaVA-1.5-7B snapshot (computed) | {SEVEN_B_FEATURES / 1e6:.1f} MB + ids |",
        ]
    )
    write_results(args.out / f"resume-{args.model}.json", results, table)


if __name__ == "__main__":
    main()
