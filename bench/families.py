"""Print docs/models.md's table of supported checkpoints: image tokens per image and session memory.

Token counts come from transformers' own processors (their `_get_number_of_features`, the code
that expands `<image>`), configured as the llava-hf repositories are; the KV-cache size per token
from each text model's published config (layers x KV heads x head size x 2 x 2 bytes, bf16).
Nothing is downloaded.

    python bench/families.py        # prints the table, saves bench/results/families.md
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path

from transformers import LlavaNextImageProcessorPil, LlavaNextProcessor, LlavaOnevisionProcessor
from transformers import LlavaOnevisionImageProcessorPil as OnevisionImages

from llava.engines.transformers.model.budget import GIB, device_budget
from llava.tools.tiny.tokenizers import train_qwen_tokenizer

# (height, width) of the images the table is computed for.
IMAGES = {"640x480": (480, 640), "1024x768": (768, 1024), "1920x1080": (1080, 1920)}
NEXT_GRIDS = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]
ONEVISION_GRIDS = [[384 * h, 384 * w] for h in range(1, 7) for w in range(1, 7)]


@dataclass(frozen=True)
class Checkpoint:
    repo: str
    kind: str  # "fixed", "next" or "onevision": how its processor counts image tokens
    fixed_tokens: int  # tokens per image for "fixed"; per tile for the anyres kinds
    layers: int
    kv_heads: int
    head_dim: int
    several_images: str = "no"

    @property
    def kv_bytes_per_token(self) -> int:
        return self.layers * self.kv_heads * self.head_dim * 2 * 2  # keys and values, bf16


CHECKPOINTS = [
    Checkpoint("llava-hf/llava-1.5-7b-hf", "fixed", 576, 32, 32, 128),
    Checkpoint("llava-hf/llava-1.5-13b-hf", "fixed", 576, 40, 40, 128),
    Checkpoint("llava-hf/llava-v1.6-mistral-7b-hf", "next", 576, 32, 8, 128),
    Checkpoint("llava-hf/llava-v1.6-vicuna-7b-hf", "next", 576, 32, 32, 128),
    Checkpoint("llava-hf/llava-v1.6-34b-hf", "next", 576, 60, 8, 128),
    Checkpoint("llava-hf/llava-interleave-qwen-0.5b-hf", "fixed", 729, 24, 16, 64, "yes, appended"),
    Checkpoint("llava-hf/llava-interleave-qwen-7b-hf", "fixed", 729, 32, 32, 128, "yes, appended"),
    Checkpoint(
        "llava-hf/llava-onevision-qwen2-0.5b-ov-hf", "onevision", 729, 24, 2, 64, "yes, 730 each"
    ),
    Checkpoint(
        "llava-hf/llava-onevision-qwen2-7b-ov-hf", "onevision", 729, 28, 4, 128, "yes, 730 each"
    ),
]


@cache
def _next_processor() -> LlavaNextProcessor:
    """Return LLaVA-NeXT's processor as llava-hf configures it (the tokenizer does not matter)."""
    return LlavaNextProcessor(
        LlavaNextImageProcessorPil(image_grid_pinpoints=NEXT_GRIDS),
        train_qwen_tokenizer(),
        patch_size=14,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
    )


@cache
def _onevision_processor(tile_tokens: int) -> LlavaOnevisionProcessor:
    """Return OneVision's processor as llava-hf configures it, without its video part."""
    processor = LlavaOnevisionProcessor.__new__(LlavaOnevisionProcessor)
    processor.image_processor = OnevisionImages(image_grid_pinpoints=ONEVISION_GRIDS)
    processor.num_image_tokens = tile_tokens
    processor.vision_aspect_ratio = "anyres_max_9"
    return processor


def image_tokens(checkpoint: Checkpoint, height: int, width: int) -> int:
    """Count the image tokens the checkpoint's processor expands one image of this size to."""
    if checkpoint.kind == "fixed":
        return checkpoint.fixed_tokens
    if checkpoint.kind == "next":  # the CLS token is dropped ("default" feature strategy)
        return _next_processor()._get_number_of_features(height, width, 336, 336) - 1
    processor = _onevision_processor(checkpoint.fixed_tokens)
    return processor._get_number_of_features(height, width, 384, 384)


def table() -> str:
    """Return the markdown table."""
    sizes = " | ".join(f"tokens, {name}" for name in IMAGES)
    lines = [
        f"| checkpoint | {sizes} | KV per token | session after open, 1024x768 | added images |",
        "|---|" + "---:|" * len(IMAGES) + "---:|---:|---|",
    ]
    for checkpoint in CHECKPOINTS:
        counts = [image_tokens(checkpoint, h, w) for h, w in IMAGES.values()]
        per_token = checkpoint.kv_bytes_per_token
        opening = (image_tokens(checkpoint, 768, 1024) + 40) * per_token  # + ~40 template ids
        cells = " | ".join(f"{n:,}" for n in counts)
        lines.append(
            f"| `{checkpoint.repo}` | {cells} | {per_token / 1024:,.0f} KiB | "
            f"{opening / 2**20:,.0f} MiB | {checkpoint.several_images} |"
        )
    return "\n".join(lines) + "\n"


# Memory torch reports on each card (mem_get_info's total), and what the CUDA context and
# cuBLAS workspaces take before the weights load.
GPUS = {"A10G 24 GB": 22.49, "L4 24 GB": 22.49, "A100 40 GB": 39.39, "A100 80 GB": 79.15}
CUDA_CONTEXT_GIB = 0.6
# Parameters (billions) of the 7B checkpoints, bf16 weights.
SIZED = {
    "llava-hf/llava-1.5-7b-hf": 7.06,
    "llava-hf/llava-v1.6-mistral-7b-hf": 7.57,
    "llava-hf/llava-onevision-qwen2-7b-ov-hf": 8.03,
}
TURN_TOKENS = 125  # a question with its template (~25) and a 100-token answer


def gpu_table() -> str:
    """Sessions held on the device under the derived budget (engine/budget.py), per GPU."""
    gpus = " | ".join(GPUS)
    lines = [
        f"| checkpoint, 1024x768 image | {gpus} |",
        "|---|" + "---:|" * len(GPUS),
    ]
    for checkpoint in CHECKPOINTS:
        if checkpoint.repo not in SIZED:
            continue
        weights = SIZED[checkpoint.repo] * 1e9 * 2 / GIB
        opening = image_tokens(checkpoint, 768, 1024) + 40
        after = opening + 4 * TURN_TOKENS
        cells = []
        for total in GPUS.values():
            budget = device_budget(int((total - weights - CUDA_CONTEXT_GIB) * GIB))
            per_open = opening * checkpoint.kv_bytes_per_token
            per_chat = after * checkpoint.kv_bytes_per_token
            sessions = f"{budget // per_open} open / {budget // per_chat} at 4 turns"
            cells.append(f"{budget / GIB:.1f} GiB: {sessions}")
        lines.append(f"| `{checkpoint.repo}` | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    text = table() + "\n" + gpu_table()
    print(text)
    out = Path(__file__).parent / "results" / "families.md"
    out.parent.mkdir(exist_ok=True)
    out.write_text(text)
    print(f"saved {out}")


if __name__ == "__main__":
    main()
