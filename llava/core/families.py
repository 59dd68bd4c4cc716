"""The llava-hf model families the kit serves, and what each can do.

Pure: no torch import, so the archive builder can refuse an unsupported checkpoint before
anything is packed, with the same message a worker gives at start.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Family:
    """One supported `model_type` and its abilities."""

    model_type: str
    examples: str
    # Text models of the checkpoints trained on several images per conversation.
    multi_image_text: frozenset[str]
    # Several images are encoded together, differently from one (no anyres tiling).
    joint_images: bool = False

    def multi_image(self, text_model_type: str) -> bool:
        """Tell whether a checkpoint of this family with this text model takes added images."""
        return text_model_type in self.multi_image_text


FAMILIES: dict[str, Family] = {
    family.model_type: family
    for family in (
        # llava-1.5 (Llama text) saw one image per conversation; llava-interleave-qwen, several.
        Family(
            "llava",
            "llava-hf/llava-1.5-7b-hf, llava-hf/llava-interleave-qwen-0.5b-hf",
            frozenset({"qwen2"}),
        ),
        Family(
            "llava_next",
            "llava-hf/llava-v1.6-mistral-7b-hf, llava-v1.6-vicuna-7b-hf",
            frozenset(),
        ),
        Family(
            "llava_onevision",
            "llava-hf/llava-onevision-qwen2-0.5b-ov-hf, llava-onevision-qwen2-7b-ov-hf",
            frozenset({"qwen2"}),
            joint_images=True,
        ),
    )
}


class UnsupportedModel(ValueError):
    """The checkpoint's model type is not one the kit serves."""


def check_model_type(model_type: object, where: str) -> Family:
    """Return the family of a checkpoint's `model_type`, or refuse it naming the supported ones."""
    family = FAMILIES.get(str(model_type)) if model_type is not None else None
    if family is None:
        supported = "; ".join(f"{f.model_type} (e.g. {f.examples})" for f in FAMILIES.values())
        raise UnsupportedModel(
            f"{where}: model_type {model_type!r} is not served by this kit. Supported: {supported}"
        )
    return family


def checkpoint_family(model_dir: Path) -> Family:
    """Read a checkpoint's `config.json` and return its family, or refuse it."""
    config_file = model_dir / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(
            f"{model_dir} has no config.json: point the archive at a LLaVA checkpoint "
            "directory (see docs/models.md)"
        )
    return check_model_type(json.loads(config_file.read_text()).get("model_type"), str(model_dir))
