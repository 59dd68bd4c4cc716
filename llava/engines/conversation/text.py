"""Turn generated token ids into text deltas, and cut answers at stop strings: the same for
every engine, so an answer reads the same whichever engine produced it."""

from __future__ import annotations

import os
import re
import time
from typing import Any, Protocol

from llava.core.params import GenerationParams


class Detokenizer:
    """Decode generated ids incrementally so the deltas add up to a one-shot decode.

    Each id decodes a window of the last few ids only, as vLLM's and TGI's detokenizers do
    (the text of `ids[prefix:]` less that of `ids[prefix:read]`: the ids before `read` give the
    new ones their context, a leading space included), so a token costs the same however long
    the answer is. Text is held back while it could still change: after a byte-fallback token
    (`<0xE2>`: a run of them decodes as one UTF-8 sequence, or as U+FFFD per byte if invalid),
    after a special id (skipped, it does not end such a run) and while it ends in U+FFFD. Where
    the window decodes otherwise than the text shown, the whole answer decides; at the end the
    whole answer is decoded once, and what it adds to the text shown is the last delta.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # where the context window starts
        self._read = 0  # the ids before it are in `text`
        self._byte_ids: dict[int, bool] = {}
        self._special = special_ids(tokenizer)
        self.text = ""  # the text emitted so far; the whole answer once flushed

    def add(self, token_id: int) -> str:
        """Append one id; return the text it completes (possibly empty)."""
        self._ids.append(token_id)
        if self._is_byte(token_id) or token_id in self._special:
            return ""  # a special id adds no text: a run of bytes may go on past it
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if after.startswith(before):
            if len(after) <= len(before) or after.endswith("\ufffd"):
                return ""
            return self._emit(after[len(before) :])
        # the window decodes differently from the text shown (ids that merge across it): the
        # whole answer decides, once
        whole = self._decode(self._ids)
        if whole.startswith(self.text) and not whole.endswith("\ufffd"):
            return self._emit(whole[len(self.text) :])
        return ""

    def flush(self) -> str:
        """Return whatever text is still held back at the end of the answer (if the whole
        answer decodes to other text than was shown, what differs from it)."""
        whole = self._decode(self._ids)
        same = len(os.path.commonprefix([whole, self.text]))
        delta, self.text = whole[same:], whole
        self._prefix = self._read = len(self._ids)
        return delta

    def _emit(self, delta: str) -> str:
        self._prefix, self._read = self._read, len(self._ids)
        self.text += delta
        return delta

    def _decode(self, ids: list[int]) -> str:
        return str(self._tokenizer.decode(ids, skip_special_tokens=True)) if ids else ""

    def _is_byte(self, token_id: int) -> bool:
        known = self._byte_ids.get(token_id)
        if known is None:
            piece = self._tokenizer.convert_ids_to_tokens(token_id)
            known = self._byte_ids[token_id] = bool(_BYTE_TOKEN.match(str(piece)))
        return known


def special_ids(tokenizer: Any) -> set[int]:
    """The ids a decode with `skip_special_tokens` leaves out: the named special tokens and
    the tokens added as special (an image placeholder)."""
    ids = set(getattr(tokenizer, "all_special_ids", None) or ())
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids.update(i for i, token in added.items() if getattr(token, "special", False))
    return ids


_BYTE_TOKEN = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")


def visible_text(
    text: str, stops: tuple[str, ...], *, final: bool, checked: int = 0
) -> tuple[str, bool]:
    """Return the part of an answer that may be shown, and whether a stop string ended it.

    The answer is cut before the first stop string; until the answer ends, a tail that could
    still grow into one is held back, so no streamed text is ever taken back. `checked`: the
    length of a start already searched (shown, so holding no stop string); only what follows
    it, and the stop strings that could end in it, is searched again.
    """
    longest = max((len(stop) for stop in stops), default=0)
    start = max(checked - longest + 1, 0)
    cuts = [at for stop in stops if (at := text.find(stop, start)) >= 0]
    if cuts:
        return text[: min(cuts)], True
    if final or not stops:
        return text, False
    hold = max(
        (n for stop in stops for n in range(1, len(stop)) if text.endswith(stop[:n])), default=0
    )
    return text[: len(text) - hold], False


class Answer(Protocol):
    """An answer being generated, as `show` and `finish_answer` update it."""

    detokenizer: Detokenizer
    params: GenerationParams
    text: str
    delta: str
    done: bool
    finish_reason: str | None
    finished_at: float | None


def show(answer: Answer, *, final: bool) -> bool:
    """Extend an answer's shown text and this step's delta; return True if it reached a stop
    string."""
    stops, text = answer.params.stop, answer.detokenizer.text
    shown, stopped = visible_text(text, stops, final=final, checked=len(answer.text))
    answer.delta += shown[len(answer.text) :]
    answer.text = shown
    return stopped


def finish_answer(answer: Answer, reason: str) -> None:
    """End an answer with the text it has: what was held back shows, and if that completes a
    stop string the reason is "stop"."""
    answer.detokenizer.flush()
    if show(answer, final=True):
        reason = "stop"
    answer.done, answer.finish_reason = True, reason
    answer.finished_at = time.perf_counter()


def answer_usage(
    prefill: int, cached: int, generated: int, times: tuple[float, float | None, float | None]
) -> dict[str, Any]:
    """Report an answer's token counts and timings, as either engine does: `times` are when it
    started, produced its first token and finished (None: not yet, counted up to now)."""
    started, first_token_at, finished_at = times
    end = finished_at or time.perf_counter()
    first = first_token_at or end
    return {
        "prefill_tokens": prefill,
        "cached_tokens": cached,
        "generated_tokens": generated,
        "ttft_ms": round((first - started) * 1000, 3),
        "total_ms": round((end - started) * 1000, 3),
    }
