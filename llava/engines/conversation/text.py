"""Turn generated token ids into text deltas, and cut answers at stop strings: the same for
every engine, so an answer reads the same whichever engine produced it."""

from __future__ import annotations

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
    (`<0xE2>`: a run of them decodes as one UTF-8 sequence, or as U+FFFD per byte if invalid)
    and while it ends in U+FFFD. At the end the whole answer is decoded once, and whatever that
    adds to the text shown is the last delta.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # where the context window starts
        self._read = 0  # the ids before it are in `text`
        self._byte_ids: dict[int, bool] = {}
        self.text = ""  # the text emitted so far; the whole answer once flushed

    def add(self, token_id: int) -> str:
        """Append one id; return the text it completes (possibly empty)."""
        self._ids.append(token_id)
        if self._is_byte(token_id):
            return ""
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if len(after) <= len(before) or after.endswith("\ufffd") or not after.startswith(before):
            return ""
        delta = after[len(before) :]
        self._prefix, self._read = self._read, len(self._ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """Return whatever text is still held back at the end of the answer."""
        whole = self._decode(self._ids)
        if not whole.startswith(self.text):  # never taken back: what was shown stays
            return ""
        delta, self.text = whole[len(self.text) :], whole
        self._prefix = self._read = len(self._ids)
        return delta

    def _decode(self, ids: list[int]) -> str:
        return str(self._tokenizer.decode(ids, skip_special_tokens=True)) if ids else ""

    def _is_byte(self, token_id: int) -> bool:
        known = self._byte_ids.get(token_id)
        if known is None:
            piece = self._tokenizer.convert_ids_to_tokens(token_id)
            known = self._byte_ids[token_id] = bool(_BYTE_TOKEN.match(str(piece)))
        return known


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
