"""What the images install on a GPU machine, resolved here: the kit with vLLM's CUDA wheel
(ENGINE=vllm, VLLM_BUILD=gpu, what ships) under docker/image.lock, for AWS's base's Python 3.13
on x86-64 Linux. `pip install --dry-run --report` resolves from PyPI's metadata without
downloading the wheels (no GPU, no CUDA base here): a lock that vLLM's release cannot be
installed under fails here, not in a user's `build_and_push.sh`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LOCK = REPO / "docker" / "image.lock"
# Wheels that run on AWS's base: Amazon Linux 2023's glibc is 2.34.
PLATFORMS = ["manylinux2014_x86_64", "any", *(f"manylinux_2_{n}_x86_64" for n in range(17, 35))]


def _locked() -> dict[str, str]:
    pins = {}
    for line in LOCK.read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==")
            pins[name.strip().lower().replace("_", "-")] = version.strip()
    return pins


@pytest.fixture(scope="module")
def kit_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("kit-wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(REPO)],
        check=True,
        timeout=300,
    )
    return next(out.glob("*.whl"))


@pytest.mark.parametrize(
    ("front", "extras", "base_pins"),
    [("torchserve", "engine,aws,serve,vllm", []), ("ray", "engine,ray,aws,vllm", ["ray==2.55.1"])],
)
def test_vllm_s_gpu_wheel_resolves_under_the_lock(
    front: str, extras: str, base_pins: list[str], kit_wheel: Path, tmp_path: Path
) -> None:
    report = tmp_path / "report.json"
    cert = ["--cert", os.environ["PIP_CERT"]] if os.environ.get("PIP_CERT") else []
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--isolated",  # not this machine's pip settings (its local CPU torch wheel)
            "install",
            *cert,
            "--dry-run",
            "--ignore-installed",
            "--quiet",
            "--report",
            str(report),
            "--python-version",
            "3.13",
            "--only-binary=:all:",
            *(flag for platform in PLATFORMS for flag in ("--platform", platform)),
            "--target",
            str(tmp_path / "nowhere"),
            "-c",
            str(LOCK),
            f"{kit_wheel}[{extras}]",
            *base_pins,
        ],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    chosen = {
        item["metadata"]["name"].lower().replace("_", "-"): item["metadata"]["version"]
        for item in json.loads(report.read_text())["install"]
    }
    locked = _locked()
    assert chosen["vllm"] == locked["vllm"]
    assert chosen["torch"] == "2.13.0"  # vLLM's CUDA build, not a local +cpu one
    assert any(name.startswith("nvidia-") for name in chosen)  # the CUDA libraries come along
    drift = {name: (v, chosen[name]) for name, v in locked.items() if chosen.get(name, v) != v}
    assert drift == {}
    if front == "ray":
        assert chosen["ray"] == "2.55.1"
