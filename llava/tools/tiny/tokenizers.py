"""Tokenizers trained here on a built-in corpus, in the two kinds real LLaVA checkpoints use.

- SentencePiece-style (Metaspace) byte-fallback BPE, as Llama, Vicuna and Mistral ship it:
  llava-1.5, llava-v1.6-mistral/vicuna.
- Byte-level BPE with ChatML special tokens, as Qwen2 ships it: llava-interleave-qwen and
  llava-onevision-qwen2.
"""

from __future__ import annotations

import json
from typing import Any

# Llama's id layout: <unk>, <s>, </s>, then the 256 byte-fallback pieces, then learned pieces;
# <image> and <pad> come after the whole vocabulary, as 32000 and 32001 do in llava-1.5.
UNK, BOS, EOS, IMAGE, PAD = "<unk>", "<s>", "</s>", "<image>", "<pad>"
BPE_VOCAB_SIZE = 768
# Qwen2's special tokens: <|endoftext|> pads, <|im_end|> ends a chat turn (the model's EOS).
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
VIDEO = "<video>"  # OneVision's processor looks it up; nothing here feeds videos

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


def train_llama_tokenizer(corpus: str = CORPUS) -> Any:
    """Train a Llama-style byte-fallback BPE tokenizer on ``corpus``."""
    from tokenizers import AddedToken, Tokenizer, pre_tokenizers
    from tokenizers.models import BPE
    from tokenizers.trainers import BpeTrainer
    from transformers import LlamaTokenizer

    reserved = [UNK, BOS, EOS] + [f"<0x{byte:02X}>" for byte in range(256)]
    learner = Tokenizer(BPE())
    # Split on spaces while learning so merges stay inside words, as SentencePiece's do.
    learner.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always", split=True)
    trainer = BpeTrainer(vocab_size=BPE_VOCAB_SIZE - len(reserved), show_progress=False)
    learner.train_from_iterator(corpus.split("\n"), trainer)
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


def train_qwen_tokenizer() -> Any:
    """Train a Qwen2-style byte-level BPE tokenizer with ChatML special tokens on ``CORPUS``."""
    from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE
    from tokenizers.trainers import BpeTrainer
    from transformers import Qwen2Tokenizer

    learner = Tokenizer(BPE())
    learner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    learner.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    learner.train_from_iterator(CORPUS.split("\n"), trainer)
    model = json.loads(learner.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tokenizer = Qwen2Tokenizer(vocab=model["vocab"], merges=merges, errors="replace")
    specials = [ENDOFTEXT, IM_START, IM_END, IMAGE, VIDEO]
    tokenizer.add_tokens(
        [AddedToken(t, special=True, normalized=False) for t in specials], special_tokens=True
    )
    tokenizer.add_special_tokens({"eos_token": IM_END, "pad_token": ENDOFTEXT})
    return tokenizer
