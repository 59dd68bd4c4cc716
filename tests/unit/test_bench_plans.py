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
    sys.modules.pop("gpu", None)
