"""Random-weight LLaVA checkpoints load and behave like llava-hf/llava-1.5-7b-hf."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402
from transformers import AutoProcessor, AutoTokenizer, LlavaForConditionalGeneration  # noqa: E402

from llava.tools.tiny import PROFILES, build_checkpoint, main  # noqa: E402

SPEC = PROFILES["tiny"]
CONVERSATION = [
    {"role": "system", "content": [{"type": "text", "text": "You are a helpful assistant."}]},
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]},
    {"role": "assistant", "content": [{"type": "text", "text": "A dog on a floor."}]},
    {"role": "user", "content": [{"type": "text", "text": "What color is it?"}]},
]
PROMPT = (
    "You are a helpful assistant. USER: <image>\nWhat is this? ASSISTANT: A dog on a floor. "
    "USER: What color is it? ASSISTANT:"
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Build the tiny profile once for the module."""
    return build_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny")


@pytest.fixture(scope="module")
def processor(checkpoint: Path) -> Any:
    """Load the processor the way a real checkpoint is loaded."""
    return AutoProcessor.from_pretrained(checkpoint)


@pytest.fixture(scope="module")
def model(checkpoint: Path) -> LlavaForConditionalGeneration:
    """Load the model the way a real checkpoint is loaded."""
    return LlavaForConditionalGeneration.from_pretrained(checkpoint).eval()


def noise_image(seed: int, size: tuple[int, int] = (48, 40)) -> Image.Image:
    """Return a random RGB image that is not square, so resize and crop both run."""
    pixels = np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def greedy(model: Any, processor: Any, image: Image.Image, prompt: str) -> list[int]:
    """Return 8 greedily generated token ids for one image and prompt."""
    inputs = processor(images=image, text=prompt, return_tensors="pt")
    with torch.inference_mode():
        output = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    return output[0, inputs["input_ids"].shape[1] :].tolist()


def test_chat_template_renders_llava_hf_format(checkpoint: Path, processor: Any) -> None:
    prompt = processor.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=False)
    assert prompt == PROMPT
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    assert tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=False)
    assert tokenizer.chat_template == processor.chat_template


def test_processor_expands_image_into_patch_tokens(processor: Any, model: Any) -> None:
    inputs = processor(images=noise_image(0), text=PROMPT, return_tensors="pt")
    ids = inputs["input_ids"][0]
    assert SPEC.num_image_tokens == 16
    assert (ids == model.config.image_token_index).sum().item() == SPEC.num_image_tokens
    assert model.config.image_seq_length == SPEC.num_image_tokens
    assert ids[0].item() == processor.tokenizer.bos_token_id
    assert tuple(inputs["pixel_values"].shape) == (1, 3, SPEC.image_size, SPEC.image_size)
    assert type(processor.image_processor).__name__.startswith("CLIPImageProcessor")


def test_tokenizer_round_trips_text_and_splits_special_tokens(processor: Any) -> None:
    tokenizer = processor.tokenizer
    text = "The picture shows a Zebra, 3 cats and a café!\nWhat else?"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert 500 <= len(tokenizer) <= 1000
    ids = tokenizer.encode("yes</s>no<image>", add_special_tokens=False)
    assert tokenizer.eos_token_id in ids
    assert tokenizer.convert_tokens_to_ids("<image>") in ids
    assert tokenizer.pad_token_id not in (None, tokenizer.eos_token_id)


def test_greedy_generation_depends_on_image_and_prompt(processor: Any, model: Any) -> None:
    first = greedy(model, processor, noise_image(1), PROMPT)
    second = greedy(model, processor, noise_image(2), PROMPT)
    other_prompt = greedy(
        model, processor, noise_image(1), "USER: <image>\nDescribe it. ASSISTANT:"
    )
    assert len(set(first)) > 2
    assert len(set(second)) > 2
    assert first != second
    assert first != other_prompt


def test_output_layer_cannot_pick_control_tokens(processor: Any, model: Any) -> None:
    rows = model.get_output_embeddings().weight
    tokenizer = processor.tokenizer
    for token in ("<unk>", "<s>", "<image>", "<pad>"):
        assert not rows[tokenizer.convert_tokens_to_ids(token)].any(), token
    assert rows[tokenizer.eos_token_id].any()


def test_same_seed_gives_identical_files(tmp_path: Path) -> None:
    one = build_checkpoint(tmp_path / "one", seed=3)
    two = build_checkpoint(tmp_path / "two", seed=3)
    other = build_checkpoint(tmp_path / "other", seed=4)
    names = sorted(path.name for path in one.iterdir())
    assert "model.safetensors" in names
    assert names == sorted(path.name for path in two.iterdir())
    for name in names:
        assert (one / name).read_bytes() == (two / name).read_bytes(), name
    assert (one / "model.safetensors").read_bytes() != (other / "model.safetensors").read_bytes()
    assert (one / "tokenizer.json").read_bytes() == (other / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("profile", ["tiny", "onevision"])
def test_checkpoints_are_written_in_the_hubs_layout_and_load_alike(
    profile: str, tmp_path: Path
) -> None:
    """vLLM reads llava-hf's hub layout only (`vision_tower.vision_model.*`), transformers
    both: the kit's checkpoints, built and trained, are in the hub's."""
    from safetensors import safe_open
    from transformers import AutoModelForImageTextToText

    from llava.core.paths import CHECKOUT
    from llava.tools.tiny.hub_layout import hub_key, to_hub_layout

    built = build_checkpoint(tmp_path / profile, profile)
    for directory in (built, CHECKOUT / "models" / "shapes"):
        with safe_open(directory / "model.safetensors", "pt") as f:
            tower = [k for k in f.keys() if "vision_tower." in k]  # noqa: SIM118
        assert tower and all(".vision_tower.vision_model." in f".{k}" for k in tower), tower[:3]
    loaded = AutoModelForImageTextToText.from_pretrained(built).state_dict()
    assert to_hub_layout(built) == 0  # already the hub's: nothing to rename
    assert (
        hub_key("model.vision_tower.embeddings.x") == "model.vision_tower.vision_model.embeddings.x"
    )
    assert hub_key("language_model.model.vision_tower.x") == "language_model.model.vision_tower.x"
    again = AutoModelForImageTextToText.from_pretrained(built).state_dict()
    assert loaded.keys() == again.keys() and all(torch.equal(loaded[k], again[k]) for k in loaded)


def test_llava15_profile_has_576_image_tokens(tmp_path: Path) -> None:
    checkpoint = build_checkpoint(tmp_path / "llava15", "llava15")
    processor = AutoProcessor.from_pretrained(checkpoint)
    model = LlavaForConditionalGeneration.from_pretrained(checkpoint)
    inputs = processor(images=noise_image(0, (480, 640)), text=PROMPT, return_tensors="pt")
    assert PROFILES["llava15"].num_image_tokens == 576
    assert model.config.image_seq_length == 576
    assert (inputs["input_ids"] == model.config.image_token_index).sum().item() == 576
    assert tuple(inputs["pixel_values"].shape) == (1, 3, 336, 336)
    assert 15e6 < sum(parameter.numel() for parameter in model.parameters()) < 30e6


def test_refuses_to_replace_without_overwrite(checkpoint: Path, tmp_path: Path) -> None:
    with pytest.raises(FileExistsError):
        build_checkpoint(checkpoint)
    target = tmp_path / "cli"
    (target / "stale").mkdir(parents=True)
    assert main([str(target), "--seed", "1", "--overwrite"]) == 0
    assert not (target / "stale").exists()
    assert "random noise" in (target / "README.md").read_text()
    assert not [path for path in tmp_path.iterdir() if path.name.startswith(".")]


def test_import_stays_light() -> None:
    code = "import sys, llava.tools.tiny; assert not {'torch', 'transformers'} & set(sys.modules)"
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], cwd=root, check=True)
