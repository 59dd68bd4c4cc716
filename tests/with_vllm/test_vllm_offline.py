"""vLLM's own engine on the kit's checkpoints (`make test-vllm`, in the vLLM environment that
`docker/vllm-cpu/install.sh` makes): what the `engine: vllm` work builds on.

- the install: no CUDA torchvision / torchaudio / torchcodec left, the one import that needs
  torchvision runs through the kit's hook, vLLM's LLaVA model imports;
- the kit's trained default (`shapes`, in llava-hf's hub layout) loads in vLLM, and vLLM's
  greedy answers over a whole conversation, given as the session's token ids with the image by
  content id, equal transformers' own pipeline's (the oracle the kit's engine is held to) turn
  after turn. (The `tiny` profile's 16-wide attention heads are below what vLLM's CPU attention
  takes: 32, 64, 80, ...; `shapes` has 32, `llava15` 64.)

Skipped in the kit's own environment, which has no vLLM.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM runs in its own environment: make test-vllm")

from helpers import Reference  # noqa: E402

from llava.core.paths import CHECKOUT  # noqa: E402

SHAPES = CHECKOUT / "models" / "shapes"
PROMPTS = ["What colour is the circle?", "And the other one?", "How many shapes are there?"]
TOKENS = 12


def test_the_vllm_environment_runs_what_the_images_ship() -> None:
    """vllm-cpu of the lock's vllm release, and the lock's transformers (the images' too)."""
    from importlib.metadata import version

    locked = dict(
        line.split("==")
        for line in (CHECKOUT / "docker/image.lock").read_text().splitlines()
        if "==" in line and not line.startswith("#")
    )
    assert version("vllm-cpu") == locked["vllm"]
    for name in ("transformers", "tokenizers", "huggingface_hub", "safetensors", "pillow"):
        assert version(name) == locked[name], name


def test_the_install_works_around_vllm_cpus_packaging() -> None:
    for broken in ("torchvision", "torchaudio", "torchcodec"):  # CUDA builds: they fail here
        assert importlib.util.find_spec(broken) is None, broken
    assert "llava_kit_no_torchvision" in sys.modules  # the .pth loaded the hook
    import vllm.model_executor.models.llava  # noqa: F401  (what failed without the hook)

    patched = sys.modules["transformers.models.pixtral.image_processing_pixtral"]
    assert patched.tvF is None
    import transformers.image_utils as image_utils

    assert not image_utils.is_torchvision_available()


@pytest.fixture(scope="module")
def llm() -> Any:
    """vLLM's offline engine on the trained default, in this process, eager, in float32."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM

    engine = LLM(
        model=str(SHAPES),
        dtype="float32",
        enforce_eager=True,
        max_model_len=2048,
        seed=0,
        kv_cache_memory_bytes=2**28,  # a quarter GiB, as the other engines in tests
    )
    yield engine
    del engine


@pytest.mark.parametrize("seed", [1, 2])
def test_vllm_answers_a_conversation_as_the_pipeline_does(llm: Any, seed: int) -> None:
    import random

    from vllm import SamplingParams

    from llava.tools.tiny.scenes import draw_scene

    reference = Reference(SHAPES)
    tokenizer = reference.processor.tokenizer
    eos = tokenizer.eos_token_id
    picture = draw_scene(random.Random(seed), count=2).draw()
    digest = hashlib.sha256(picture.tobytes()).hexdigest()
    past: list[tuple[str, str]] = []
    for turn, prompt in enumerate(PROMPTS, 1):
        messages = reference.messages(None, past, prompt)
        greedy = reference.greedy([picture], messages, TOKENS)
        text = reference.processor.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        # The session's ids as the kit holds them: BOS included (vLLM adds none to given ids),
        # one <image> per picture (vLLM expands it itself), the image by its content id.
        ids = tokenizer(text)["input_ids"]
        assert (
            ids[0] == tokenizer.bos_token_id
            and ids.count(tokenizer.convert_tokens_to_ids("<image>")) == 1
        )
        request = {
            "prompt_token_ids": ids,
            "multi_modal_data": {"image": picture},
            "multi_modal_uuids": {"image": [digest]},
        }
        [out] = llm.generate([request], SamplingParams(temperature=0, max_tokens=TOKENS))
        tokens = list(out.outputs[0].token_ids)
        while tokens and tokens[-1] == eos:
            tokens.pop()
        greedy.assert_close(tokens, f"turn {turn}")
        past.append((prompt, greedy.text))
