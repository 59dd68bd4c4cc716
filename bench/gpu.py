"""`make bench-gpu`: the llava-1.5-7b shape in bf16 on a GPU, through TorchServe.

    python bench/gpu.py                 # on a CUDA machine (about 10 minutes on an H100)
    python bench/gpu.py --logic         # no GPU: the same steps on the CPU with the tiny shape

Builds a random-weight checkpoint with llava-1.5-7b's real shapes directly on the GPU in bf16
(no download), then measures, through TorchServe:
- follow-up time to first token per turn: the session cache against the pixel cache (the
  reference design) and stateless serving (bench/run.py);
- decode tokens/s at 1, 8 and 32 concurrent sessions against one at a time (bench/run.py);
- the longest stream gap while 4 sessions open (bench/load.py);
- capacity under the SLO: the highest rate of arriving 4-turn conversations held with p95
  follow-up TTFT under 1 s, the session cache against the pixel cache (bench/capacity.py);
- chat clients' follow-ups: header-less against the session header and one-shot, and the
  100-turn curve beside the model's own forward (bench/chats.py);
- GPU bytes per session, just opened and after 4 turns (the sessions' own `usage`).
Results: bench/results/gpu/ (JSON, PNG, and summary.md: the table for docs/performance.md).

Where vLLM's GPU wheel is installed (the images; `pip install -e .[vllm]`), then on the same
checkpoint shape: the two engines side by side (bench/engines.py) and the kit on vLLM against
bare `vllm serve` (bench/peer.py, with a KV budget that memory pressure overflows); their
results land in bench/results/engines-llava15-7b.json and peer-llava15-7b.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import capacity  # noqa: E402
import chats  # noqa: E402
import engines  # noqa: E402
import load  # noqa: E402
import peer  # noqa: E402
import run  # noqa: E402

from llava.api.headers import SESSION_HEADER  # noqa: E402

PROFILE, LOGIC_PROFILE = "llava15-7b", "tiny"
VLLM_LOGIC_PROFILE = "tiny-vllm"  # vLLM's CPU attention takes heads 32 wide and up


def device_name(logic: bool) -> str:
    import torch

    if logic:
        return "CPU (logic run, tiny shape: not a GPU figure)"
    return torch.cuda.get_device_name(0)


def build(profile: str, logic: bool) -> Path:
    """Build the checkpoint where resolve_model looks for it (on the GPU in bf16)."""
    from llava.tools.tiny import build_checkpoint

    target = Path("build/models") / profile
    if not (target / "config.json").is_file():
        print(f"building the random-weight {profile} checkpoint in {target}", file=sys.stderr)
        started = time.monotonic()
        device, dtype = ("cpu", "float32") if logic else ("cuda", "bfloat16")
        build_checkpoint(target, profile, overwrite=True, device=device, dtype=dtype)
        print(f"built in {time.monotonic() - started:.0f} s", file=sys.stderr)
    return target


def session_bytes(model_dir: Path, work: Path, turns: int = 4) -> dict[str, int]:
    """A session's bytes as its own usage reports them: after the open's first turn, and after
    `turns` turns."""
    import httpx

    from llava.tools.archive import build_archive

    build_archive(model_dir, work / "store", name="llava")
    ts = load.start(work / "store", work / "bytes")
    try:
        client = load.Client(ts.url("/predictions/llava"))
        sid = client.open(load.photo_uri(7))
        figures = {}
        for turn in range(1, turns + 1):
            r = client.http.post(
                client.url,
                content=json.dumps(
                    {"type": "query", "prompt": run.PROMPTS[turn - 1], "max_new_tokens": 32}
                ).encode(),
                headers={**load.JSON, SESSION_HEADER: sid},
            )
            r.raise_for_status()
            figures[f"after_turn_{turn}"] = r.json()["usage"]["session_bytes"]
        client.close(sid)
        return figures
    except httpx.HTTPError as exc:
        raise SystemExit(f"the session-bytes run failed: {exc}\n{ts.log_tail(40)}") from exc
    finally:
        ts.stop()


def summary(out: Path, gpu: str, profile: str, extra: dict[str, Any]) -> str:
    """The README's table, from the JSON the runs wrote."""
    bench = json.loads((out / "bench.json").read_text())["results"]
    [figures] = bench.values()
    loads = json.loads((out / "load.json").read_text())
    capacities = json.loads((out / f"capacity-{profile}.json").read_text())
    chatting = json.loads((out / "chats.json").read_text())
    lines = [
        f"Measured on **{gpu}**, `{profile}` (random weights; "
        + ("real shapes, bf16" if profile == PROFILE else "tiny shapes, float32")
        + "), through TorchServe:",
        "",
        run.table(f"{profile} / torchserve", figures),
    ]
    lines += ["", load.table(loads), "", capacity.table(capacities), ""]
    lines += [chats.tables(chatting), ""]
    lines.append(
        "Session bytes (device + host, from `usage.session_bytes`): "
        + ", ".join(f"{k.replace('_', ' ')}: {v / 2**20:.1f} MiB" for k, v in extra.items())
    )
    return "\n".join(lines) + "\n"


def plan(
    profile: str, logic: bool, out: Path, repeats: int
) -> list[tuple[Callable[[list[str]], None], list[str]]]:
    """Each benchmark this runs, with its arguments (`--logic`: fewer and shorter runs)."""
    common = ["--model", profile, "--out", str(out)]
    concurrency = ["1", "2"] if logic else ["1", "8", "32"]
    rates = ["0.5", "1"] if logic else ["1", "2", "4", "8", "16", "32"]
    return [
        (
            run.main,
            ["--models", profile, "--envs", "torchserve", "--repeats", str(repeats)]
            + ["--concurrency", *concurrency, "--out", str(out)],
        ),
        (load.main, [*common, "--gap-runs", "1" if logic else "3"]),
        (capacity.main, [*common, "--rates", *rates, "--duration-s", "10" if logic else "60"]),
        (
            chats.main,
            [*common, "--repeats", "1" if logic else str(repeats)]
            + ["--long-turns", "20" if logic else "100", "--long-chats", "1" if logic else "3"],
        ),
    ]


def vllm_plan(logic: bool, repeats: int) -> list[tuple[Callable[[list[str]], None], list[str]]]:
    """The vLLM engine beside the transformers engine, and the kit against bare vLLM."""
    profile = VLLM_LOGIC_PROFILE if logic else PROFILE
    levels = "1,4" if logic else "1,4,8,16"
    # llava15-7b in bf16: ~0.5 MB of KV per token, ~700 tokens a conversation: 4 GiB holds ~11
    # of them, and 24 with think time between turns overflow it.
    kv, pressure = ("0.05", "6") if logic else ("4", "24")
    turns = ["--turns", "2" if logic else "4", "--repeats", "1" if logic else str(repeats)]
    return [
        (engines.main, ["--model", profile, *turns, "--concurrency", levels]),
        (
            peer.main,
            ["--model", profile, *turns, "--concurrency", levels, "--kv-gb", kv]
            + ["--pressure", pressure, "--think-s", "2"],
        ),
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--logic", action="store_true", help="no GPU: tiny shape on the CPU")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    import torch

    if not args.logic and not torch.cuda.is_available():
        print(
            "no CUDA device: make bench-gpu skips (python bench/gpu.py --logic runs its steps "
            "on the CPU)"
        )
        return
    profile = LOGIC_PROFILE if args.logic else PROFILE
    out = args.out or HERE / "results" / ("gpu-logic" if args.logic else "gpu")
    out.mkdir(parents=True, exist_ok=True)
    model_dir = build(profile, args.logic)
    # These figures are the transformers engine's: `auto` would pick vLLM where it is installed
    # (the TorchServes they start read LLAVA_* from this environment).
    os.environ["LLAVA_ENGINE"] = "transformers"
    for bench, argv in plan(profile, args.logic, out, args.repeats):
        bench(argv)
    extra = session_bytes(model_dir, Path(tempfile.mkdtemp()))
    (out / "session_bytes.json").write_text(json.dumps(extra, indent=2))
    text = summary(out, device_name(args.logic), profile, extra)
    (out / "summary.md").write_text(text)
    print(text)
    print(f"wrote {out}/", file=sys.stderr)
    if importlib.util.find_spec("vllm") is None:
        print(
            "vLLM is not installed here: the engine and peer comparisons skip (on a GPU, "
            "pip install -e '.[vllm]' or run in the image)",
            file=sys.stderr,
        )
        return
    del os.environ["LLAVA_ENGINE"]  # engines.py and peer.py say which engine each server runs
    for bench, argv in vllm_plan(args.logic, args.repeats):
        bench(argv)


if __name__ == "__main__":
    main()
