"""The detokenizer both engines share: deltas that add up to the one-shot decode, at a cost per
token that does not grow with the answer, and stop strings searched only where they can be."""

from __future__ import annotations

import os
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from llava.engines.conversation.text import Detokenizer, visible_text
from llava.tools.tiny.tokenizers import train_llama_tokenizer, train_qwen_tokenizer

EXAMPLES = int(os.environ.get("LLAVA_DETOKENIZER_EXAMPLES", "300"))  # fixed examples in CI
TOKENIZERS = {"sentencepiece-style": train_llama_tokenizer(), "byte-level": train_qwen_tokenizer()}


class Counting:
    """A tokenizer that records how many ids each decode was given."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer, self.lengths = tokenizer, []
        self.all_special_ids = tokenizer.all_special_ids
        self.added_tokens_decoder = tokenizer.added_tokens_decoder

    def decode(self, ids: list[int], **kw: Any) -> str:
        self.lengths.append(len(ids))
        return str(self.tokenizer.decode(ids, **kw))

    def convert_ids_to_tokens(self, token_id: int) -> Any:
        return self.tokenizer.convert_ids_to_tokens(token_id)


def streamed(tokenizer: Any, ids: list[int]) -> tuple[list[str], Counting]:
    counting = Counting(tokenizer)
    detokenizer = Detokenizer(counting)
    deltas = [detokenizer.add(i) for i in ids]
    deltas.append(detokenizer.flush())
    assert detokenizer.text == "".join(deltas)
    return deltas, counting


@pytest.mark.parametrize("name", list(TOKENIZERS))
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True)
@given(text=st.text(min_size=0, max_size=80))
def test_deltas_of_any_text_add_up_to_its_one_shot_decode(name: str, text: str) -> None:
    tokenizer = TOKENIZERS[name]
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    deltas, _ = streamed(tokenizer, ids)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)


IDS = st.lists(st.integers(0, min(len(t) for t in TOKENIZERS.values()) - 1), max_size=60)


@pytest.mark.parametrize("name", list(TOKENIZERS))
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True)
@given(ids=IDS)
@example(ids=[3, 0, 131])  # a byte, a skipped special id, a byte: one run of bytes
def test_deltas_of_any_ids_add_up_to_their_one_shot_decode(name: str, ids: list[int]) -> None:
    """Random ids (special and byte-fallback ones included), as a sampled answer may hold."""
    tokenizer = TOKENIZERS[name]
    deltas, _ = streamed(tokenizer, ids)
    whole = tokenizer.decode(ids, skip_special_tokens=True)
    assert "".join(deltas) == whole


@pytest.mark.parametrize("name", list(TOKENIZERS))
def test_a_token_costs_the_same_however_long_the_answer(name: str) -> None:
    tokenizer = TOKENIZERS[name]
    text = "A red circle sits left of a blue square, and the title says yearly results. " * 80
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:1024]
    assert len(ids) == 1024  # max_new_tokens' default
    deltas, counting = streamed(tokenizer, ids)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)
    *per_token, final = counting.lengths
    assert max(per_token) <= 8, max(per_token)  # a window of a few ids, never the answer
    assert final == len(ids)  # the one whole decode, at the end


def test_stop_strings_are_searched_only_where_a_new_one_can_be() -> None:
    text = "x" * 10_000 + "wor"
    assert visible_text(text, ("world",), final=False, checked=10_000) == ("x" * 10_000, False)
    assert visible_text(text + "ld!", ("world",), final=False, checked=10_000) == (
        "x" * 10_000,
        True,
    )
    # a stop string starting just before what was checked is still found
    assert visible_text("abcwo" + "rld", ("world",), final=False, checked=5) == ("abc", True)
