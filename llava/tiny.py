"""Build random-weight LLaVA checkpoints offline that load like ``llava-hf/llava-1.5-7b-hf``.

The checkpoint is a plain ``save_pretrained`` directory: ``LlavaForConditionalGeneration`` weights
(safetensors), a ``LlavaProcessor`` with a CLIP image processor, a Llama tokenizer trained here on
a built-in corpus, llava-hf's own chat template and a generation config. The model is scaled down
and its weights are noise, so it answers gibberish, but its files, token layout and loading path
are those of the real model.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import LlamaTokenizer


@dataclass(frozen=True)
class TinySpec:
    """Shapes of one checkpoint profile."""

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
    # Random weights at the usual 0.02 give near-flat logits, so greedy decoding repeats one
    # token whatever the input; a wide init makes outputs depend on the image and prompt.
    initializer_range: float = 0.2

    @property
    def num_image_tokens(self) -> int:
        """Return how many ``<image>`` tokens one image expands to (CLS dropped, as in 1.5)."""
        return (self.image_size // self.patch_size) ** 2


PROFILES: dict[str, TinySpec] = {
    "tiny": TinySpec(
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

# llava-hf/llava-1.5-7b-hf's chat_template, verbatim: a system turn is its bare text, other turns
# are "ROLE: ", images come before text, and every text part is followed by one space.
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}"
    "{{ message['role'].upper() + ': '}}{% endif %}"
    "{# Render all images first #}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}{% endfor %}"
    "{# Render all text next #}"
    "{% if message['role'] != 'assistant' %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] + ' '}}{% endfor %}"
    "{% else %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{% generation %}{{ content['text'] + ' '}}{% endgeneration %}{% endfor %}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)

# Llama's id layout: <unk>, <s>, </s>, then the 256 byte-fallback pieces, then learned pieces;
# <image> and <pad> come after the whole vocabulary, as 32000 and 32001 do in llava-1.5.
UNK, BOS, EOS, IMAGE, PAD = "<unk>", "<s>", "</s>", "<image>", "<pad>"
BPE_VOCAB_SIZE = 768

CORPUS = """\
The picture shows a small brown dog sitting on a wooden floor next to a red ball. Behind the dog
there is a white door and a window with green plants on the sill. The light comes from the left,
so the shadow of the dog falls to the right.

What is in this image? This image shows a city street at night. Cars drive along the road, their
lights drawing long lines of yellow and red. People walk on the sidewalk under tall buildings,
and a sign above a shop reads open.

Describe the scene in detail. A woman is reading a book in a park. She sits on a bench under a
large tree, and the grass around her is bright green. Two children play with a kite in the
distance, and the sky is blue with a few white clouds.

USER: What color is the car? ASSISTANT: The car is blue, with black wheels and a silver stripe
along the side. USER: How many people are there? ASSISTANT: There are three people in the photo:
a man, a woman and a child.

The chart has four bars. The first bar is the highest and the last bar is the lowest. Numbers
from one to ten are written along the bottom, and the title at the top says yearly results.
A table holds a cup of coffee, a plate with bread, an apple, a phone and a pair of glasses.

You are a helpful assistant. Answer the question about the image as well as you can. If you do
not know the answer, say that you are not sure. Keep the answer short and clear, and describe
only what you can see: objects, people, animals, colors, text, shapes and where they are.
"""


def build_checkpoint(
    out_dir: str | Path, profile: str = "tiny", *, seed: int = 0, overwrite: bool = False
) -> Path:
    """Write a random-weight LLaVA checkpoint for ``profile`` to ``out_dir`` and return its path."""
    spec = PROFILES[profile]
    out = Path(out_dir)
    if out.exists() and not overwrite and any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty; pass overwrite=True to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and swap in at the end, so a failed build never leaves half a
    # checkpoint where a loader would find it.
    staging = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        _write_checkpoint(staging, spec, profile=profile, seed=seed)
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def _write_checkpoint(out: Path, spec: TinySpec, *, profile: str, seed: int) -> None:
    """Save model, processor, tokenizer, chat template and README for ``spec`` into ``out``."""
    import torch
    from transformers import (
        CLIPImageProcessorPil,
        CLIPVisionConfig,
        GenerationConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    tokenizer = _train_tokenizer()
    image_id = tokenizer.convert_tokens_to_ids(IMAGE)
    pad_id = tokenizer.pad_token_id
    vision_config = CLIPVisionConfig(
        hidden_size=spec.vision_hidden,
        intermediate_size=spec.vision_intermediate,
        num_hidden_layers=spec.vision_layers,
        num_attention_heads=spec.vision_heads,
        image_size=spec.image_size,
        patch_size=spec.patch_size,
        projection_dim=spec.vision_hidden,
        initializer_range=spec.initializer_range,
    )
    text_config = LlamaConfig(
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
        pad_token_id=pad_id,
    )
    config = LlavaConfig(
        vision_config=vision_config,
        text_config=text_config,
        image_token_index=image_id,
        image_seq_length=spec.num_image_tokens,
        projector_hidden_act="gelu",
        vision_feature_select_strategy="default",
        vision_feature_layer=-2,
        pad_token_id=pad_id,
    )
    # Fork the RNG so seeding here leaves the caller's random stream untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlavaForConditionalGeneration(config).eval()
    # A trained LLaVA never emits these. A zero output row pins their logit at 0, far below the
    # largest random logit, so greedy decoding cannot write an <image> that the next turn of a
    # session would then try to match with image features.
    never_emitted = tokenizer.convert_tokens_to_ids([UNK, BOS, IMAGE, PAD])
    with torch.no_grad():
        model.get_output_embeddings().weight[never_emitted] = 0
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=pad_id,
    )
    model.save_pretrained(out)

    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": spec.image_size},
        crop_size={"height": spec.image_size, "width": spec.image_size},
    )
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=spec.patch_size,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(out)
    params = sum(parameter.numel() for parameter in model.parameters())
    (out / "README.md").write_text(_readme(spec, profile=profile, seed=seed, params=params))


def _train_tokenizer() -> LlamaTokenizer:
    """Train a Llama-style byte-fallback BPE tokenizer on ``CORPUS``."""
    from tokenizers import AddedToken, Tokenizer, pre_tokenizers
    from tokenizers.models import BPE
    from tokenizers.trainers import BpeTrainer
    from transformers import LlamaTokenizer

    reserved = [UNK, BOS, EOS] + [f"<0x{byte:02X}>" for byte in range(256)]
    learner = Tokenizer(BPE())
    # Split on spaces while learning so merges stay inside words, as SentencePiece's do.
    learner.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always", split=True)
    trainer = BpeTrainer(vocab_size=BPE_VOCAB_SIZE - len(reserved), show_progress=False)
    learner.train_from_iterator(CORPUS.split("\n"), trainer)
    learned = sorted(learner.get_vocab().items(), key=lambda item: item[1])
    vocab = {token: index for index, token in enumerate(reserved)}
    vocab.update((token, len(reserved) + index) for index, (token, _) in enumerate(learned))
    merges = [tuple(merge) for merge in json.loads(learner.to_str())["model"]["merges"]]

    tokenizer = LlamaTokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=UNK,
        bos_token=BOS,
        eos_token=EOS,
        add_bos_token=True,
        add_eos_token=False,
        legacy=False,
    )
    tokenizer.add_tokens([AddedToken(IMAGE, special=True, normalized=False)], special_tokens=True)
    tokenizer.add_special_tokens({"pad_token": PAD})
    return tokenizer


def _readme(spec: TinySpec, *, profile: str, seed: int, params: int) -> str:
    """Return the checkpoint's README text."""
    return f"""\
# Random-weight LLaVA ({profile})

**These weights are random noise.** The model answers with gibberish. It exists to test and
benchmark serving code offline: it loads through the same code path as
`llava-hf/llava-1.5-7b-hf` (`LlavaForConditionalGeneration` + `AutoProcessor` with a CLIP image
processor, a Llama tokenizer and llava-hf's chat template).

- built by `python -m llava.tiny OUT_DIR --profile {profile} --seed {seed}`
- {params:,} parameters
- image {spec.image_size}px, patch {spec.patch_size}px: {spec.num_image_tokens} image tokens
- vision: CLIP, hidden {spec.vision_hidden}, {spec.vision_layers} layers
- text: Llama, hidden {spec.text_hidden}, {spec.text_layers} layers, \
{spec.text_heads} heads ({spec.text_kv_heads} KV)
- tokenizer: byte-fallback BPE trained on a few built-in English paragraphs
"""


def main(argv: Sequence[str] | None = None) -> int:
    """Build a checkpoint from the command line."""
    parser = argparse.ArgumentParser(
        prog="python -m llava.tiny", description="Build a random-weight LLaVA checkpoint."
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


if __name__ == "__main__":
    raise SystemExit(main())
