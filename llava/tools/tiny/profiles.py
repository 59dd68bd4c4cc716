"""Shapes of the random-weight checkpoint profiles, each mirroring one real llava-hf repository."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class TinySpec:
    """Shapes and kinds of one checkpoint profile."""

    mirrors: str  # the llava-hf repository whose files and loading path it copies
    image_size: int
    patch_size: int
    vision_hidden: int
    vision_layers: int
    vision_heads: int
    vision_intermediate: int
    text_hidden: int
    text_layers: int
    text_heads: int
    text_kv_heads: int
    text_intermediate: int
    max_position_embeddings: int
    family: str = "llava"  # the config's model_type: llava, llava_next or llava_onevision
    # "llama" / "mistral": SentencePiece-style tokenizer; "qwen2": byte-level BPE
    text: str = "llama"
    vision: str = "clip"  # "clip" (CLS token dropped) or "siglip" (no CLS, every patch kept)
    # anyres (NeXT, OneVision): the (height, width) grids an image is tiled to, in pixels
    grid_pinpoints: tuple[tuple[int, int], ...] = ()
    # Random weights at the usual 0.02 give near-flat logits, so greedy decoding repeats one
    # token whatever the input; a wide init makes outputs depend on the image and prompt.
    initializer_range: float = 0.2
    # llava-1.5's own preprocessing: pad to a square in the mean colour, then resize (the CLIP
    # processor's centre crop would cut off the sides of a wide picture).
    pad_to_square: bool = False

    @property
    def feature_strategy(self) -> str:
        """Return which vision features the projector takes: SigLIP has no CLS token to drop."""
        return "full" if self.vision == "siglip" else "default"

    @property
    def num_image_tokens(self) -> int:
        """Return the image tokens of one base tile (anyres families add tiles and newlines)."""
        return (self.image_size // self.patch_size) ** 2


PROFILES: dict[str, TinySpec] = {
    "tiny": TinySpec(
        mirrors="llava-hf/llava-1.5-7b-hf",
        image_size=32,
        patch_size=8,
        vision_hidden=32,
        vision_layers=2,
        vision_heads=2,
        vision_intermediate=64,
        text_hidden=64,
        text_layers=2,
        text_heads=4,
        text_kv_heads=2,
        text_intermediate=128,
        max_position_embeddings=2048,
    ),
    "llava15": TinySpec(
        mirrors="llava-hf/llava-1.5-7b-hf",
        image_size=336,
        patch_size=14,
        vision_hidden=128,
        vision_layers=4,
        vision_heads=4,
        vision_intermediate=512,
        # Llama-7B's head size (64), MHA without GQA and MLP ratio (11008/4096), at 1/8 width.
        text_hidden=512,
        text_layers=6,
        text_heads=8,
        text_kv_heads=8,
        text_intermediate=1376,
        max_position_embeddings=4096,
    ),
}

# The trained default (`python -m llava.tools.tiny.train`): llava-1.5's architecture, sized so it
# learns the scenes in `scenes.py` in under an hour on two CPU cores.
PROFILES["shapes"] = replace(
    PROFILES["tiny"],
    image_size=64,
    patch_size=16,  # 16 image tokens, each holding about one shape: quick to learn to read
    vision_hidden=128,
    vision_layers=4,  # the projector reads layer -2: three layers to compare patches in
    vision_heads=4,
    vision_intermediate=384,
    text_hidden=192,
    text_layers=4,
    text_heads=6,
    text_kv_heads=6,
    text_intermediate=512,
    initializer_range=0.02,
    pad_to_square=True,
)

# tiny's shapes with Qwen2 text (byte-level BPE, ChatML) behind a SigLIP tower, as
# llava-interleave-qwen.
PROFILES["interleave"] = replace(
    PROFILES["tiny"],
    mirrors="llava-hf/llava-interleave-qwen-0.5b-hf",
    text="qwen2",
    vision="siglip",
)

# llava-v1.6-mistral-7b-hf: LLaVA-NeXT with Mistral text (SentencePiece, [INST] template) behind
# CLIP, anyres tiling over its five grids (336x672 ... 1008x336), scaled to the 32px tile.
PROFILES["next"] = replace(
    PROFILES["tiny"],
    mirrors="llava-hf/llava-v1.6-mistral-7b-hf",
    family="llava_next",
    text="mistral",
    grid_pinpoints=((32, 64), (64, 32), (64, 64), (32, 96), (96, 32)),
)

# llava-onevision-qwen2-0.5b-ov-hf: Qwen2 text (byte-level BPE, ChatML) behind SigLIP, anyres_max_9
# over a 1..6 x 1..6 tile grid (384px tiles), scaled to a 1..3 x 1..3 grid of 32px tiles.
PROFILES["onevision"] = replace(
    PROFILES["tiny"],
    mirrors="llava-hf/llava-onevision-qwen2-0.5b-ov-hf",
    family="llava_onevision",
    text="qwen2",
    vision="siglip",
    grid_pinpoints=tuple((32 * h, 32 * w) for h in range(1, 4) for w in range(1, 4)),
)

# Real shapes, random weights: what `make test-gpu` and `make bench-gpu` build on the GPU (in
# bf16, with no download). The vocabulary is the locally trained tokenizer's, smaller than the
# real 32k, so the embedding and output layers are smaller; everything a forward, a KV cache or
# a vision tower costs per token is the real model's. The usual 0.02 init: at this depth the
# wide init of the small profiles would overflow bf16.
PROFILES["llava15-7b"] = TinySpec(
    mirrors="llava-hf/llava-1.5-7b-hf",
    image_size=336,
    patch_size=14,
    vision_hidden=1024,
    vision_layers=24,
    vision_heads=16,
    vision_intermediate=4096,
    text_hidden=4096,
    text_layers=32,
    text_heads=32,
    text_kv_heads=32,
    text_intermediate=11008,
    max_position_embeddings=4096,
    initializer_range=0.02,
)
# llava-v1.6-mistral-7b-hf: Mistral-7B (GQA, 8 key/value heads) behind CLIP-L/336, anyres.
PROFILES["next-7b"] = replace(
    PROFILES["llava15-7b"],
    mirrors="llava-hf/llava-v1.6-mistral-7b-hf",
    family="llava_next",
    text="mistral",
    text_kv_heads=8,
    text_intermediate=14336,
    max_position_embeddings=32768,
    grid_pinpoints=((336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008)),
)

# The same profiles with 32-wide attention heads: vLLM's CPU attention takes head sizes 32, 64,
# 80, ... (not tiny's 16), so the `engine: vllm` tests serve these. Their 4px patches give a
# picture 64 tokens, two of the blocks vLLM's prefix cache holds on a CPU (32 tokens each), so
# what a follow-up reuses shows there as it does on the reference.
for _name in ("tiny", "interleave", "next", "onevision"):
    _spec = PROFILES[_name]
    PROFILES[f"{_name}-vllm"] = replace(
        _spec, text_heads=_spec.text_hidden // 32, text_kv_heads=1, patch_size=4
    )
