"""Train the default model, a tiny LLaVA that sees: ``python -m llava.tools.tiny.train``.

It has llava-1.5's architecture and files (CLIP vision tower, Llama text model, a
SentencePiece-style tokenizer, llava-1.5's chat template, pad-to-square preprocessing) at the
`shapes` profile's size, and learns the drawn scenes of `scenes.py` from a fixed seed in under an
hour on two CPU cores. Every example goes through the checkpoint's own processor and chat
template, as serving does.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from llava.core.paths import CHECKOUT
from llava.tools.tiny.build import family_parts, model_config, write_staged
from llava.tools.tiny.chatter import corpus as chatter_corpus
from llava.tools.tiny.chatter import text_dialogue
from llava.tools.tiny.hub_layout import to_hub_layout
from llava.tools.tiny.looks import decoded, random_look, render
from llava.tools.tiny.profiles import PROFILES
from llava.tools.tiny.scenes import Scene, Turn, describe, dialogue, draw_scene
from llava.tools.tiny.tokenizers import CORPUS, train_llama_tokenizer
from llava.tools.tiny.vision import cosine, pretrain_tower

SHIPPED = CHECKOUT / "models" / "shapes"  # the committed checkpoint `make serve` serves
PROFILE = "shapes"
SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "Answer the question about the image in one short sentence.",
    "You are a helpful assistant that describes pictures.",
)


@dataclass(frozen=True)
class Recipe:
    """Everything that decides the trained weights (with the code): change it, re-train."""

    seed: int = 0
    steps: int = 5000
    # Stage 0 (vision.py): the tower learns what is where, as CLIP's pretraining gives a real
    # LLaVA its tower. Then LLaVA's two stages in small: mostly captions ("Describe the
    # picture.") to align the features with words, then questions and follow-ups.
    vision_steps: int = 8000
    # Stage 0b's steps: the tower also learns which shape is furthest to each side, so "which
    # shape is on the left?" reads one patch, as "what colour is the circle?" does (0: none).
    extreme_steps: int = 8000
    align_steps: int = 300
    batch: int = 32
    # Stages 0 and 0b show the tower each scene ~40 times: with 12,000 (~85 times) it learnt them
    # by heart, and the model placed shapes 90% right on new scenes; with 24,000, 96%.
    scenes: int = 24000
    # Each scene is drawn in one random look (looks.py) with shapes this big (a range, of the
    # canvas's longer side): trained on one look and size, it saw 70-76% right elsewhere.
    sizes: tuple[float, float] = (0.12, 0.32)
    # The share of steps after aligning whose batch has no picture (chatter.py: chat clients
    # send those too), in batches of their own: a long request (Open WebUI's title prompt) pads
    # a whole batch.
    text_only: float = 0.05
    text_batch: int = 16
    # 1e-3 learnt colours but not to read the side flags (positions 65%); 5e-4 learns both.
    lr: float = 5e-4
    # After stage 0 the tower is frozen (0), so the words do not wash out what it learned to
    # see: fine-tuned even at 1e-4, it lost the side flags (a probe read them 37-46% right).
    vision_lr: float = 0.0
    warmup: int = 100
    weight_decay: float = 0.01
    max_turns: int = 3


def messages(
    turns: Sequence[Turn], system: str | None, picture: bool = True
) -> list[dict[str, Any]]:
    """Return the chat a client would send: the image (if any) with the first question, then the
    turns."""
    out: list[dict[str, Any]] = []
    if system:
        out.append({"role": "system", "content": [{"type": "text", "text": system}]})
    for i, turn in enumerate(turns):
        content = ([{"type": "image"}] if i == 0 and picture else []) + [
            {"type": "text", "text": turn.question}
        ]
        out.append({"role": "user", "content": content})
        out.append({"role": "assistant", "content": [{"type": "text", "text": turn.answer}]})
    return out


def encode(
    processor: Any,
    turns: Sequence[Turn],
    system: str | None,
    image_tokens: int,
) -> tuple[list[int], list[int]]:
    """Return a dialogue's token ids and labels: every answer's tokens, the last one then EOS
    (``image_tokens`` 0: a dialogue with no picture).

    The text is the chat template's rendering with the image placeholder expanded, exactly the
    ids serving feeds; the token after an earlier answer (the next "USER") is not a target, so the
    model learns to end an answer with EOS."""
    tokenizer = processor.tokenizer
    text = processor.apply_chat_template(messages(turns, system, image_tokens > 0), tokenize=False)
    image = processor.image_token
    text = text.replace(image, image * image_tokens, 1)
    spans, start = [], 0
    for turn in turns:
        begin = text.index("ASSISTANT: " + turn.answer, start) + len("ASSISTANT: ")
        start = begin + len(turn.answer)
        spans.append((begin, start))
    encoded = tokenizer(text[:start], return_offsets_mapping=True)
    ids: list[int] = encoded["input_ids"]
    labels = [
        token if any(a < end and b > begin for begin, end in spans) else -100
        for token, (a, b) in zip(ids, encoded["offset_mapping"], strict=True)
    ]
    return ids + [tokenizer.eos_token_id], labels + [tokenizer.eos_token_id]


def tokenizer_corpus(rng: random.Random, dialogues: int = 3000) -> str:
    """Return the tokenizer's text: the built-in corpus and many questions and answers."""
    lines = [CORPUS]
    for _ in range(dialogues):
        scene = draw_scene(rng)
        lines += [f"USER: {t.question} ASSISTANT: {t.answer}" for t in dialogue(scene, rng, 3)]
    return "\n".join([*lines, *SYSTEM_PROMPTS, chatter_corpus()])


def pixels(processor: Any, scene: Scene, rng: random.Random) -> Any:
    """Return a scene's pixel values as serving computes them, from its file in a random look."""
    image = decoded(render(scene, random_look(scene, rng)))
    return processor.image_processor(image, return_tensors="pt").pixel_values[0]


def train(out: str | Path = SHIPPED, recipe: Recipe = Recipe(), *, overwrite: bool = True) -> Path:
    """Train the model from ``recipe`` and write the checkpoint to ``out``; return its path."""
    import torch
    from tqdm import tqdm
    from transformers import GenerationConfig

    started = time.monotonic()  # the README states the whole run's time
    torch.manual_seed(recipe.seed)
    rng = random.Random(recipe.seed)
    spec = PROFILES[PROFILE]
    tokenizer = train_llama_tokenizer(tokenizer_corpus(rng))
    model_class, processor = family_parts(spec, tokenizer)
    model = model_class._from_config(model_config(spec, tokenizer), dtype=torch.float32)
    scenes = [
        draw_scene(rng, sizes=recipe.sizes) for _ in tqdm(range(recipe.scenes), desc="drawing")
    ]
    pool = torch.stack([pixels(processor, scene, rng) for scene in tqdm(scenes, desc="processing")])

    pretrain_tower(
        model,
        pool,
        scenes,
        image_size=spec.image_size,
        patch=spec.patch_size,
        steps=recipe.vision_steps,
        batch=64,
        lr=recipe.lr,
        rng=rng,
        extreme_steps=recipe.extreme_steps,
    )
    tower = list(model.model.vision_tower.parameters())
    in_tower = {id(p) for p in tower}
    rest = [p for p in model.parameters() if id(p) not in in_tower]
    optimizer = torch.optim.AdamW(
        [{"params": rest, "lr": recipe.lr}, {"params": tower, "lr": recipe.vision_lr}],
        weight_decay=recipe.weight_decay,
    )

    def rate(step: int) -> float:
        if step < recipe.warmup:
            return (step + 1) / recipe.warmup
        done = (step - recipe.warmup) / max(1, recipe.steps - recipe.warmup)
        return cosine(done)

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, rate)
    model.train()
    bar = tqdm(range(recipe.steps), desc="training")
    for step in bar:
        aligning = step < recipe.align_steps
        chosen, rows = [], []
        if not aligning and rng.random() < recipe.text_only:
            for _ in range(recipe.text_batch):
                talk = text_dialogue(rng, rng.randint(1, 2))
                rows.append(encode(processor, talk, _system(rng), 0))
        for _ in range(0 if rows else recipe.batch):
            chosen.append(rng.randrange(len(scenes)))
            scene = scenes[chosen[-1]]
            if aligning and rng.random() < 0.6:
                talk = [describe(scene, rng)]
            else:
                talk = dialogue(scene, rng, rng.randint(1, recipe.max_turns))
            rows.append(encode(processor, talk, _system(rng), spec.num_image_tokens))
        ids, labels, mask = _pad(rows, tokenizer.pad_token_id)
        images = pool[chosen] if chosen else None
        logits = model(input_ids=ids, attention_mask=mask, pixel_values=images).logits
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        targets = labels[:, 1:] != -100  # how many answer tokens the batch got right
        right = (logits[:, :-1].argmax(-1) == labels[:, 1:])[targets].float().mean()
        bar.set_postfix(loss=f"{loss.item():.4f}", right=f"{right.item():.3f}")
    model.eval()
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    minutes = (time.monotonic() - started) / 60

    def write(staging: Path) -> None:
        # Half precision halves the committed file (a few MB); loading upcasts it exactly.
        model.to(torch.float16).save_pretrained(staging)
        to_hub_layout(staging)
        processor.save_pretrained(staging)
        (staging / "recipe.json").write_text(json.dumps(asdict(recipe), indent=1) + "\n")
        (staging / "README.md").write_text(_readme(recipe, model, minutes))

    return write_staged(out, write, overwrite=overwrite)


def _system(rng: random.Random) -> str | None:
    """Return a system prompt for about one dialogue in seven, as clients sometimes send one."""
    return rng.choice(SYSTEM_PROMPTS) if rng.random() < 0.15 else None


def _pad(rows: list[tuple[list[int], list[int]]], pad: int) -> tuple[Any, Any, Any]:
    """Return right-padded ids, labels and attention mask tensors for a batch."""
    import torch

    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), pad)
    labels = torch.full((len(rows), width), -100)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for row, (row_ids, row_labels) in enumerate(rows):
        ids[row, : len(row_ids)] = torch.tensor(row_ids)
        labels[row, : len(row_labels)] = torch.tensor(row_labels)
        mask[row, : len(row_ids)] = 1
    return ids, labels, mask


def _readme(recipe: Recipe, model: Any, minutes: float) -> str:
    """Return the checkpoint's README: what it knows, and the one command that re-trains it."""
    params = sum(p.numel() for p in model.parameters())
    return f"""\
# shapes: a tiny LLaVA trained on drawn scenes

The kit's default model. It has llava-1.5's architecture and files (`LlavaForConditionalGeneration`,
CLIP vision tower, Llama text model, byte-fallback BPE tokenizer, llava-1.5's chat template,
pad-to-square preprocessing) with {params:,} parameters, and answers questions about pictures of one
to three shapes (circle, square, triangle) in red, orange, yellow, green, blue, purple, black or
white on a light or dark background: the colour of a shape, the shape of a colour, how many
shapes, which is left/right/top/bottom, is there a ..., and follow-ups ("And the other one?").
It trained on each scene in one of many looks (hard or anti-aliased edges, many shades of each
colour, tinted and graded backgrounds, blur, noise, JPEG; `llava/tools/tiny/looks.py`), and
to text without a picture (a greeting, Open WebUI's title request) it says what it can do.
It knows nothing else.

Re-train it (seed {recipe.seed}, {recipe.steps} steps, {minutes:.0f} minutes on two CPU cores):

    python -m llava.tools.tiny.train

Recipe: `recipe.json`. Accuracy on unseen scenes: `tests/integration/test_sees.py`.
"""


def main(argv: Sequence[str] | None = None) -> int:
    """Train from the command line."""
    parser = argparse.ArgumentParser(
        prog="python -m llava.tools.tiny.train", description="Train the seeing tiny LLaVA."
    )
    parser.add_argument("out", nargs="?", type=Path, default=SHIPPED)
    parser.add_argument("--seed", type=int, default=Recipe.seed)
    parser.add_argument("--steps", type=int, default=Recipe.steps)
    parser.add_argument("--lr", type=float, default=Recipe.lr)
    parser.add_argument("--vision-lr", type=float, default=Recipe.vision_lr)
    parser.add_argument("--extreme-steps", type=int, default=Recipe.extreme_steps)
    args = parser.parse_args(argv)
    recipe = Recipe(
        seed=args.seed,
        steps=args.steps,
        lr=args.lr,
        vision_lr=args.vision_lr,
        extreme_steps=args.extreme_steps,
    )
    print(train(args.out, recipe))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
