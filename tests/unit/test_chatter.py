"""Text without a picture, as chat clients send it, is always answered with the one reply."""

from __future__ import annotations

import random

from llava.tools.tiny.chatter import GREETINGS, REPLY, TASKS, corpus, text_dialogue


def test_text_without_a_picture_is_answered_with_the_reply() -> None:
    rng = random.Random(0)
    turns = [t for _ in range(200) for t in text_dialogue(rng, 2)]
    assert {t.answer for t in turns} == {REPLY} and {t.kind for t in turns} == {"no-picture"}
    asked = {t.question for t in turns}
    assert any(q.startswith("### Task") for q in asked)  # a chat client's own requests
    assert asked & set(GREETINGS)
    # and questions about a picture that is not there, in the words asked with one
    assert any(not q.startswith("### Task") and q not in GREETINGS for q in asked)
    assert any(q.endswith("?") and "shape" in q for q in asked)
    # the tokenizer is trained on what the model must say and read
    assert all(task in corpus() for task in TASKS) and REPLY in corpus()
