"""The GPU suite's comparisons with the pipeline (`helpers.Greedy.assert_close`, and
`assert_text_close` for text through a server) pass near-ties and fail what is not one."""

from __future__ import annotations

from typing import Any

import pytest
from helpers import Greedy

PIPELINE = Greedy(tokens=[1, 2, 3, 4], top=[[1, 8], [2, 9], [3, 7], [4, 6]], text="")


@pytest.mark.parametrize(
    "kit",
    [
        [1, 2, 3, 4],  # the same answer
        # a near-tie at token 1 (9 is the pipeline's second choice): not compared past it
        [1, 9, 5, 5],
    ],
)
def test_equal_up_to_a_near_tie_passes(kit: list[int]) -> None:
    PIPELINE.assert_close(kit)


@pytest.mark.parametrize(
    "kit",
    [
        [1, 5, 3, 4],  # 5 is not among the pipeline's top tokens at step 1
        [1, 2, 3],  # stopped early with no difference: not the pipeline's answer
    ],
)
def test_a_token_outside_the_top_or_another_length_fails(kit: list[int]) -> None:
    with pytest.raises(AssertionError):
        PIPELINE.assert_close(kit)


# -- answers known by their text alone (through a server): compared in text space ------------


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    """The tiny checkpoints' Llama-style tokenizer (SentencePiece word markers, byte fallback)."""
    from llava.tools.tiny.tokenizers import train_llama_tokenizer

    return train_llama_tokenizer()


def ids(tokenizer: Any, *pieces: str) -> list[int]:
    return [int(i) for i in tokenizer.convert_tokens_to_ids(list(pieces))]


def pipeline(tokenizer: Any, tokens: list[int], top: list[list[int]]) -> Greedy:
    return Greedy(tokens, top, tokenizer.decode(tokens, skip_special_tokens=True))


def test_a_first_token_near_tie_without_the_word_marker_passes(tokenizer: Any) -> None:
    """The H200 run's turn 3 (bench/results/gpu-check/gpu-suite-torchserve-test.log): the
    pipeline answered `ting` + a cut character + ` Cars`..., with `People` (486) its second
    choice at token 0; the kit answered `People colors,` + a cut character + `People`, whose
    text re-tokenizes as `▁People` (563), outside the top."""
    ting, cars, people, colors, xef = ids(
        tokenizer, "ting", "▁Cars", "People", "▁colors,", "<0xEF>"
    )
    tokens = [ting, xef, cars, cars, cars]
    top = [[ting, people, 462, 156, cars]] + [[t] for t in tokens[1:]]
    reference = pipeline(tokenizer, tokens, top)
    kit = tokenizer.decode([people, colors, xef, people], skip_special_tokens=True)
    assert kit == "People colors,\ufffdPeople"
    reference.assert_text_close(kit, tokenizer)


def test_an_answer_cut_inside_a_byte_fallback_character_passes(tokenizer: Any) -> None:
    """The kit's answer takes the second choice at its first token and ends cut inside a
    character of three bytes, which its text shows as U+FFFD."""
    the, car, people, walk, e2, x80 = ids(
        tokenizer, "▁The", "▁car", "People", "▁walk", "<0xE2>", "<0x80>"
    )
    reference = pipeline(tokenizer, [the, car, car, car], [[the, people], [car], [car], [car]])
    kit = tokenizer.decode([people, walk, e2, x80], skip_special_tokens=True)
    assert kit.startswith("People walk") and kit.endswith("\ufffd")
    reference.assert_text_close(kit, tokenizer)


def test_a_near_tie_at_the_first_byte_of_a_character_passes(tokenizer: Any) -> None:
    """A tie at a character's first byte shows only once the character is whole."""
    the, space, e2, e3, x80, x81, x94 = ids(
        tokenizer, "▁The", "▁", "<0xE2>", "<0xE3>", "<0x80>", "<0x81>", "<0x94>"
    )
    tokens = [the, space, e2, x80, x94]  # "The —"
    reference = pipeline(tokenizer, tokens, [[t, x81] for t in tokens[:2]] + [[e2, e3]] * 3)
    kit = tokenizer.decode([the, space, e3, x81, x81], skip_special_tokens=True)  # "The ぁ"
    assert kit == "The \u3041"
    reference.assert_text_close(kit, tokenizer)


def test_the_text_check_still_fails_what_is_not_a_near_tie(tokenizer: Any) -> None:
    the, car, people, walk, eos = ids(tokenizer, "▁The", "▁car", "People", "▁walk", "</s>")
    reference = pipeline(tokenizer, [the, car], [[the, car], [car, walk], [eos, walk]])
    with pytest.raises(AssertionError, match="at token 0"):  # `People` is outside the top
        reference.assert_text_close("People walk", tokenizer)
    with pytest.raises(AssertionError, match="at token 1"):  # stopped where EOS is not a tie
        reference.assert_text_close("The", tokenizer)
    reference.assert_text_close("The car walk", tokenizer)  # went on where EOS was chosen
    with pytest.raises(AssertionError, match="at token 2"):  # ... with a token not in the top
        reference.assert_text_close("The car people", tokenizer)
    capped = pipeline(tokenizer, [the, car], [[the], [car]])  # its whole length: no step past
    with pytest.raises(AssertionError, match="goes on past"):
        capped.assert_text_close("The car walk", tokenizer)
