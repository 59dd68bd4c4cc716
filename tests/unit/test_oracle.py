"""The GPU suite's comparison with the pipeline (`helpers.Greedy.assert_close`) can fail."""

from __future__ import annotations

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
