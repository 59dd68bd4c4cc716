"""vLLM's own offline `generate` over whole conversations (tests/with_vllm's `engine: vllm`
oracle) for the image tests, whose environment has no vLLM: run with .venv-vllm's python (the
same vLLM release as the images), a request as JSON on stdin, the answers as JSON on stdout:

    {"checkpoint": ..., "tokens": N, "conversations": [{"picture": PNG path, "prompts": [...]}]}
    -> [[answer, ...], ...]
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(TESTS / "with_vllm"), str(TESTS)]
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def main() -> None:
    from conftest import Oracle, expected_text  # tests/with_vllm/conftest.py
    from PIL import Image

    request = json.load(sys.stdin)
    oracle = Oracle(Path(request["checkpoint"]))
    answers = []
    for conversation in request["conversations"]:
        picture = Image.open(conversation["picture"]).convert("RGB")
        history: list[tuple[str, str]] = []
        for prompt in conversation["prompts"]:
            answer = expected_text(oracle, history, prompt, picture, request["tokens"])
            history.append((prompt, answer))
        answers.append([answer for _, answer in history])
    print(json.dumps(answers))


if __name__ == "__main__":
    main()
