"""The benchmarks that run only where nobody watches (`make bench-gpu` on a GPU lent now and
then) hand each benchmark script arguments its parser takes: a script's options can move
(capacity left bench/load.py) without the GPU run finding out hours in."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


class Parsed(Exception):
    """Raised in place of running a benchmark once its arguments parsed."""


@pytest.mark.parametrize("logic", [False, True])
def test_bench_gpu_hands_every_benchmark_arguments_it_takes(
    logic: bool, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.syspath_prepend(str(BENCH))
    import gpu  # bench/gpu.py

    real = argparse.ArgumentParser.parse_args

    def parse_only(self: argparse.ArgumentParser, args: list[str] | None = None) -> None:
        real(self, args)  # exits 2 on an argument the script does not take
        raise Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_only)
    steps = gpu.plan("tiny", logic, tmp_path, repeats=1)
    assert {bench.__module__ for bench, _ in steps} == {"run", "load", "capacity", "chats"}
    for bench, argv in steps:
        with pytest.raises(Parsed):
            bench(argv)
    steps = gpu.vllm_plan(logic, repeats=1)  # where vLLM's GPU wheel is installed
    assert {bench.__module__ for bench, _ in steps} == {"engines", "peer"}
    for bench, argv in steps:
        with pytest.raises(Parsed):
            bench(argv)
    for name in ("gpu", "engines", "peer"):
        sys.modules.pop(name, None)


def test_peer_and_engines_on_a_gpu_share_the_card_in_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU the servers of one run share the card: each asks for its part of the memory
    and runs in bf16; on a CPU neither flag is passed and float32 stays."""
    monkeypatch.syspath_prepend(str(BENCH))
    import engines
    import peer

    for gpu, ray, share in ((True, True, 0.3), (True, False, 0.45), (False, True, None)):
        args = argparse.Namespace(
            dtype="auto", ray=ray, max_model_len=2048, kv_gb=4.0, model="llava15-7b", step_tokens=0
        )
        peer.settle(args, gpu)
        assert args.gpu_share == share
        command = peer.vllm_command(Path("/ckpt"), args, 8000)
        env = peer.kit_env(args)
        dtype = "bfloat16" if gpu else "float32"
        assert command[command.index("--dtype") + 1] == env["LLAVA_DTYPE"] == dtype
        if gpu:
            assert command[command.index("--gpu-memory-utilization") + 1] == str(share)
            assert env["LLAVA_GPU_MEMORY_UTILIZATION"] == str(share)
        else:
            assert "--gpu-memory-utilization" not in command
            assert "LLAVA_GPU_MEMORY_UTILIZATION" not in env
        assert env["LLAVA_KV_CACHE_GB"] == "4.0" and "--kv-cache-memory-bytes" in command
        assert "--max-num-batched-tokens" not in command and "LLAVA_STEP_TOKEN_BUDGET" not in env
        args.step_tokens = 2048  # both servers at one step budget, when asked
        command = peer.vllm_command(Path("/ckpt"), args, 8000)
        assert command[command.index("--max-num-batched-tokens") + 1] == "2048"
        assert peer.kit_env(args)["LLAVA_STEP_TOKEN_BUDGET"] == "2048"
        for engine in engines.ENGINES:
            env = engines.engine_env(engine, gpu)
            assert env["LLAVA_DTYPE"] == dtype and env["LLAVA_ENGINE"] == engine
            assert ("LLAVA_GPU_MEMORY_UTILIZATION" in env) == (gpu and engine == "vllm")
    for name in ("engines", "peer"):
        sys.modules.pop(name, None)
