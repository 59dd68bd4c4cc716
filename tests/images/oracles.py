"""Each engine's own pipeline as the image tests' oracle: transformers' `generate` (helpers'
Reference) in this environment, vLLM's offline `generate` in .venv-vllm (vllm_answers.py), both
over the whole conversation from scratch."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from helpers import Reference
from PIL import Image

from llava.core.paths import CHECKOUT


def pipeline_answers(
    engine: str, checkpoint: Path, pictures: list[Path], prompts: list[str], tokens: int
) -> list[list[str]]:
    """For each picture, the greedy answers to `prompts` asked in turn in one conversation."""
    if engine == "transformers":
        reference = Reference(checkpoint)
        return [reference.answers(Image.open(p).convert("RGB"), prompts, tokens) for p in pictures]
    python = CHECKOUT / ".venv-vllm" / "bin" / "python"
    assert python.exists(), "vLLM's oracle runs in .venv-vllm: make venv-vllm"
    request = {
        "checkpoint": str(checkpoint),
        "tokens": tokens,
        "conversations": [{"picture": str(p), "prompts": prompts} for p in pictures],
    }
    run = subprocess.run(
        [str(python), str(Path(__file__).with_name("vllm_answers.py"))],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return list(json.loads(run.stdout.strip().splitlines()[-1]))
