"""A turn's prompt from the last one's: render and tokenize only what the turn adds.

Rendering a conversation with its chat template and tokenizing it whole grows with the
conversation (200 messages: about 4 ms to render, 1.5 ms to tokenize), though a turn only adds
an answer and a question to the prompt before it. Both shortcuts are checked, so the ids are
always the ones the whole rendering and tokenization would give:
- the template must render each message on its own, so the new messages render the same after
  a fixed user message as after the held one: checked at load on probe conversations
  (`ChatFormatter` turns the shortcut off for a template that fails, such as one that moves the
  system prompt to the last user message or numbers images across the conversation);
- the tokenization is spliced a few words before the new text, and the tail's first tokens must
  come out as the held ones (a tokenizer that reads across the cut fails this, and the whole
  text is tokenized).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

Message = dict[str, Any]
RESYNC = 3  # held tokens the tail must re-tokenize identically before the splice is trusted
SEARCH = 24  # how many tokens back to look for a word boundary to cut at


@dataclass(frozen=True)
class Rendered:
    """A prompt as the model reads it: its messages, their text (image placeholders expanded,
    ending with the answer cue), its ids and where each id's text ends."""

    messages: tuple[Message, ...]
    text: str
    ids: list[int]
    ends: list[int]
    image_tokens: tuple[int, ...]  # each placeholder's expansion (an image's tokens)


def carried_on(
    held: Rendered | None, messages: Sequence[Message], image_tokens: Sequence[int]
) -> int:
    """Return how many of `messages` the held prompt rendered, if they carry it on (0 if not).

    The held prompt must end with a user message that the new messages keep, something must
    follow it, and its images must still take as many tokens (OneVision's change when an image
    joins them)."""
    if held is None or not held.messages or len(messages) <= len(held.messages):
        return 0
    count = len(held.messages)
    if held.messages[-1].get("role") != "user" or tuple(messages[:count]) != held.messages:
        return 0
    return count if tuple(image_tokens[: len(held.image_tokens)]) == held.image_tokens else 0


ANCHOR: Message = {"role": "user", "content": [{"type": "text", "text": "Hi"}]}


def tail_text(
    render: Callable[[list[Message], bool], str], before: str, new: Sequence[Message]
) -> str | None:
    """Render the messages after a held user message, after the fixed `ANCHOR` user message
    (`before` is its rendering alone, rendered once): a template that renders each message on
    its own renders them the same after any user message."""
    try:
        window = render([ANCHOR, *new], True)
    except Exception:  # a template refusing this shape: rendering it whole reports its error
        return None
    return window[len(before) :] if window.startswith(before) else None


def word_cut(text: str, ends: Sequence[int], shared: int) -> int | None:
    """Return how many held tokens to keep: the cut ends a token, at least `RESYNC` tokens
    before the text stops being shared, and just before a space (a word's start), where
    SentencePiece- and byte-level tokenizers both start a new piece."""
    last = bisect_right(ends, shared) - RESYNC  # tokens wholly in the shared text, less RESYNC
    for keep in range(last, max(0, last - SEARCH), -1):
        if keep >= 1 and ends[keep - 1] < len(text) and text[ends[keep - 1]] == " ":
            return keep
    return None


def splice_ids(
    tokenize: Callable[[str], tuple[list[int], list[int]]],
    held: Rendered,
    text: str,
    shared: int,
) -> tuple[list[int], list[int]] | None:
    """Return `text`'s ids and ends from the held ones up to a cut, and the rest tokenized on
    its own; None where the tail does not re-tokenize the held tokens after the cut."""
    keep = word_cut(text, held.ends, shared)
    if keep is None:
        return None
    cut = held.ends[keep - 1]
    ids, ends = tokenize(text[cut:])
    ends = [cut + end for end in ends]
    check = bisect_right(held.ends, shared) - keep  # held tokens after the cut, still shared
    if check < RESYNC or ids[:check] != held.ids[keep : keep + check]:
        return None
    if ends[:check] != held.ends[keep : keep + check]:
        return None
    return held.ids[:keep] + ids, held.ends[:keep] + ends
