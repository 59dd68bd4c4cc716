"""Write a profile's checkpoint: config, random weights, processor, tokenizer, template, README."""

from __future__ import annotations

import argparse
import json
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from llava.tools.tiny.hub_layout import to_hub_layout
from llava.tools.tiny.profiles import PROFILES, TinySpec
from llava.tools.tiny.templates import CHATML_INTERLEAVE, CHATML_ONEVISION, LLAVA15, MISTRAL_NEXT
from llava.tools.tiny.tokenizers import (
    BOS,
    ENDOFTEXT,
    IM_START,
    IMAGE,
    PAD,
    UNK,
    VIDEO,
    train_llama_tokenizer,
    train_qwen_tokenizer,
)


def build_checkpoint(
    out_dir: str | Path,
    profile: str = "tiny",
    *,
    seed: int = 0,
    overwrite: bool = False,
    device: str = "cpu",
    dtype: str = "float32",
) -> Path:
    """Write a random-weight LLaVA checkpoint for ``profile`` to ``out_dir`` and return its path.

    The weights are made on ``device`` in ``dtype`` (a 7B profile: "cuda", "bfloat16", in
    seconds rather than the minutes and 28 GB a float32 build on the CPU takes)."""
    spec = PROFILES[profile]
    return write_staged(
        out_dir,
        lambda staging: _write_checkpoint(
            staging, spec, profile=profile, seed=seed, device=device, dtype=dtype
        ),
        overwrite=overwrite,
    )


def write_staged(
    out_dir: str | Path, write: Callable[[Path], None], *, overwrite: bool = False
) -> Path:
    """Run ``write`` on a staging directory beside ``out_dir`` and swap it in when it succeeds,
    so a failed build never leaves half a checkpoint where a loader would find it."""
    out = Path(out_dir)
    if out.exists() and not overwrite and any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty; pass overwrite=True to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        write(staging)
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def _write_checkpoint(
    out: Path, spec: TinySpec, *, profile: str, seed: int, device: str, dtype: str
) -> None:
    """Save model, processor, tokenizer, chat template and README for ``spec`` into ``out``."""
    import torch
    from transformers import GenerationConfig

    tokenizer = train_qwen_tokenizer() if spec.text == "qwen2" else train_llama_tokenizer()
    config = model_config(spec, tokenizer)
    model_class, processor = family_parts(spec, tokenizer)
    # Fork the RNG so seeding here leaves the caller's random stream untouched.
    on = torch.device(device)
    with torch.random.fork_rng(devices=[on] if on.type == "cuda" else []), on:
        torch.manual_seed(seed)
        model = model_class._from_config(config, dtype=getattr(torch, dtype)).eval()
    # A trained LLaVA never emits these. A zero output row pins their logit at 0, far below the
    # largest random logit, so greedy decoding cannot write an <image> that the next turn of a
    # session would then try to match with image features.
    never = [ENDOFTEXT, IM_START, IMAGE, VIDEO] if spec.text == "qwen2" else [UNK, BOS, IMAGE, PAD]
    with torch.no_grad():
        model.get_output_embeddings().weight[tokenizer.convert_tokens_to_ids(never)] = 0
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(out)
    to_hub_layout(out)
    processor.save_pretrained(out)
    if spec.family == "llava_onevision":
        (out / "video_preprocessor_config.json").write_text(json.dumps(_video_config(spec)))
    params = sum(parameter.numel() for parameter in model.parameters())
    (out / "README.md").write_text(_readme(spec, profile=profile, seed=seed, params=params))


def model_config(spec: TinySpec, tokenizer: Any) -> Any:
    """Return the model's config: the family's config class around a text and a vision config."""
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaNextConfig,
        LlavaOnevisionConfig,
        MistralConfig,
        Qwen2Config,
        SiglipVisionConfig,
    )

    vision_class = SiglipVisionConfig if spec.vision == "siglip" else CLIPVisionConfig
    vision_config = vision_class(
        hidden_size=spec.vision_hidden,
        intermediate_size=spec.vision_intermediate,
        num_hidden_layers=spec.vision_layers,
        num_attention_heads=spec.vision_heads,
        image_size=spec.image_size,
        patch_size=spec.patch_size,
        initializer_range=spec.initializer_range,
    )
    text_class = {"qwen2": Qwen2Config, "mistral": MistralConfig}.get(spec.text, LlamaConfig)
    text_config = text_class(
        vocab_size=len(tokenizer),
        hidden_size=spec.text_hidden,
        intermediate_size=spec.text_intermediate,
        num_hidden_layers=spec.text_layers,
        num_attention_heads=spec.text_heads,
        num_key_value_heads=spec.text_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=1e-5,
        initializer_range=spec.initializer_range,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    siglip = spec.vision == "siglip"  # no CLS token: every patch kept, from the last layer
    common: dict[str, Any] = {
        "vision_config": vision_config,
        "text_config": text_config,
        "image_token_index": tokenizer.convert_tokens_to_ids(IMAGE),
        "projector_hidden_act": "gelu",
        "vision_feature_select_strategy": spec.feature_strategy,
        "vision_feature_layer": -1 if siglip else -2,
        "pad_token_id": tokenizer.pad_token_id,
    }
    anyres = {"image_grid_pinpoints": [list(grid) for grid in spec.grid_pinpoints]}
    if spec.family == "llava_next":
        return LlavaNextConfig(**common, **anyres)
    if spec.family == "llava_onevision":
        return LlavaOnevisionConfig(**common, **anyres, vision_aspect_ratio="anyres_max_9")
    return LlavaConfig(**common, image_seq_length=spec.num_image_tokens)


def family_parts(spec: TinySpec, tokenizer: Any) -> tuple[Any, Any]:
    """Return the model class and the processor (torchvision-free image processors)."""
    import transformers

    from llava.engines.checkpoint import images_only

    size = spec.image_size
    square = {"height": size, "width": size}
    siglip = spec.vision == "siglip"
    template = {"qwen2": CHATML_INTERLEAVE, "mistral": MISTRAL_NEXT}.get(spec.text, LLAVA15)
    pinpoints = [list(grid) for grid in spec.grid_pinpoints]
    if spec.family == "llava_next":
        image_processor = transformers.LlavaNextImageProcessorPil(
            size={"shortest_edge": size}, crop_size=square, image_grid_pinpoints=pinpoints
        )
        return transformers.LlavaNextForConditionalGeneration, transformers.LlavaNextProcessor(
            image_processor=image_processor,
            tokenizer=tokenizer,
            patch_size=spec.patch_size,
            vision_feature_select_strategy=spec.feature_strategy,
            num_additional_image_tokens=1,
            chat_template=template,
        )
    if spec.family == "llava_onevision":
        image_processor = transformers.LlavaOnevisionImageProcessorPil(
            size=square, image_grid_pinpoints=pinpoints
        )
        # Its video processor needs torchvision, which is not installed here.
        processor_class = images_only(transformers.LlavaOnevisionProcessor)
        return transformers.LlavaOnevisionForConditionalGeneration, processor_class(
            image_processor=image_processor,
            tokenizer=tokenizer,
            num_image_tokens=spec.num_image_tokens,
            vision_feature_select_strategy=spec.feature_strategy,
            chat_template=CHATML_ONEVISION,
        )
    if siglip:
        image_processor = transformers.SiglipImageProcessorPil(size=square)
    elif spec.pad_to_square:
        image_processor = transformers.LlavaImageProcessorPil(
            size={"shortest_edge": size}, crop_size=square, do_pad=True
        )
    else:
        image_processor = transformers.CLIPImageProcessorPil(
            size={"shortest_edge": size}, crop_size=square
        )
    processor = transformers.LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=spec.patch_size,
        vision_feature_select_strategy=spec.feature_strategy,
        num_additional_image_tokens=0 if siglip else 1,
        chat_template=template,
    )
    return transformers.LlavaForConditionalGeneration, processor


def _video_config(spec: TinySpec) -> dict[str, Any]:
    """Return OneVision's video_preprocessor_config.json, for a loader that has torchvision."""
    return {
        "video_processor_type": "LlavaOnevisionVideoProcessor",
        "processor_class": "LlavaOnevisionProcessor",
        "size": {"height": spec.image_size, "width": spec.image_size},
    }


def _readme(spec: TinySpec, *, profile: str, seed: int, params: int) -> str:
    """Return the checkpoint's README text."""
    tokenizer = "byte-level BPE (Qwen2)" if spec.text == "qwen2" else "byte-fallback BPE (Llama)"
    anyres = f", anyres tiles {list(spec.grid_pinpoints)}" if spec.grid_pinpoints else ""
    return f"""\
# Random-weight LLaVA ({profile})

**These weights are random noise.** The model answers with gibberish. It exists to test and
benchmark serving code offline: it loads through the same code path as `{spec.mirrors}`
(`AutoModelForImageTextToText` + `AutoProcessor`), with that repository's config classes, image
processor kind, tokenizer kind and chat template.

- built by `python -m llava.tools.tiny OUT_DIR --profile {profile} --seed {seed}`
- {params:,} parameters
- image {spec.image_size}px, patch {spec.patch_size}px: \
{spec.num_image_tokens} image tokens per tile{anyres}
- model type: {spec.family}
- vision: {spec.vision}, hidden {spec.vision_hidden}, {spec.vision_layers} layers
- text: {spec.text}, hidden {spec.text_hidden}, {spec.text_layers} layers, \
{spec.text_heads} heads ({spec.text_kv_heads} KV)
- tokenizer: {tokenizer} trained on a few built-in English paragraphs
"""


def main(argv: Sequence[str] | None = None) -> int:
    """Build a checkpoint from the command line."""
    parser = argparse.ArgumentParser(
        prog="python -m llava.tools.tiny", description="Build a random-weight LLaVA checkpoint."
    )
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--profile", choices=sorted(PROFILES), default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args(argv)
    try:
        out = build_checkpoint(args.out_dir, args.profile, seed=args.seed, overwrite=args.overwrite)
    except FileExistsError as error:
        parser.error(str(error))
    print(out)
    return 0
