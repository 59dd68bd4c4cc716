"""Turn a conversation into the exact token ids the model's own pipeline would feed it.

transformers' pipeline renders the whole conversation with the processor's chat template,
replaces each image placeholder with as many image tokens as that image takes, and tokenizes the
result in one call. Tokenizing a turn's text on its own gives different ids with SentencePiece
(Metaspace) tokenizers (a word-start piece where the whole-text tokenization has none), so a
turn's ids are those of its whole conversation (rendered and tokenized from the last turn's where
that provably gives the same ids: `incremental.py`), and the session reuses its cache for the
longest common prefix of the cached ids and the new ones (see `common_prefix`).
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from llava.engines.conversation.incremental import (
    ANCHOR,
    Message,
    Rendered,
    carried_on,
    splice_ids,
    tail_text,
)


@dataclass(frozen=True)
class Exchange:
    """One finished question and answer."""

    prompt: str
    answer: str
    added_images: int = 0  # images sent with this question (the opening image not counted)


class ChatFormatter:
    """Render conversations with a processor's chat template and tokenize them whole."""

    def __init__(self, processor: Any) -> None:
        if getattr(processor, "chat_template", None) is None:
            raise ValueError(
                "the checkpoint has no chat template: use a llava-hf/* checkpoint or add "
                "chat_template.jinja next to its processor files"
            )
        self._processor = processor
        self._tokenizer = processor.tokenizer
        self._backend = self._same_backend()  # the fast tokenizer's own, without the wrapper
        self.image_token: str = processor.image_token
        self._mark = "MARK" + secrets.token_hex(8)  # random, so user text cannot collide
        self._last: tuple[Any, Sequence[Message], Rendered] | None = None
        self.prefix_text(None)  # fail at load time, not on the first request
        self._cue = self._answer_cue()
        self._anchor = self._anchor_text()  # what the new messages are rendered after
        # The shortcut needs the cue, offsets (a fast tokenizer) and a template that passes.
        self.incremental = self._cue is not None and self._anchor is not None
        self.incremental = self.incremental and bool(getattr(self._tokenizer, "is_fast", 0))
        self.incremental = self.incremental and self._renders_messages_alone()

    def messages(
        self,
        system_prompt: str | None,
        history: Sequence[Exchange],
        prompt: str,
        added_images: int = 0,
        opening_images: int = 1,
    ) -> list[Message]:
        """Build the chat messages: each image comes with the question it was sent with."""
        out = [_message("system", system_prompt)] if system_prompt else []
        questions = [(e.prompt, e.added_images) for e in history] + [(prompt, added_images)]
        for i, (question, added) in enumerate(questions):
            images = added + (opening_images if i == 0 else 0)
            content: list[dict[str, str]] = [{"type": "image"}] * images
            content.append({"type": "text", "text": question})
            out.append({"role": "user", "content": content})
            if i < len(history):
                out.append(_message("assistant", self.as_text(history[i].answer)))
        return out

    def as_text(self, answer: str) -> str:
        """Keep an answer text: one that spells the image placeholder (sampled piece by piece)
        would otherwise be read back as an image, and fail every later question. A zero-width
        space keeps it text."""
        return answer.replace(
            self.image_token, self.image_token[:1] + "\u200b" + self.image_token[1:]
        )

    def chat_messages(self, system_prompt: str | None, chat: Sequence[Message]) -> list[Message]:
        """Prepend the system prompt to a client's messages (already in the template's format)."""
        return [_message("system", system_prompt), *chat] if system_prompt else list(chat)

    def chat_prompt(
        self,
        system_prompt: str | None,
        chat: Sequence[Message],
        image_tokens: Sequence[int],
        held: Rendered | None = None,
    ) -> Rendered:
        """Render and tokenize a client's chat (from `held` where it carries that on); the same
        chat object asked again (checked against held conversations, then answered) is rendered
        once: its ids do not depend on which held prompt they were spliced from."""
        key = (id(chat), system_prompt, tuple(image_tokens))
        if self._last is not None and self._last[0] == key and self._last[1] is chat:
            return self._last[2]
        rendered = self.prompt(self.chat_messages(system_prompt, chat), image_tokens, held)
        self._last = (key, chat, rendered)  # holds the chat, so its id cannot be reused meanwhile
        return rendered

    def prompt(
        self, messages: list[Message], image_tokens: Sequence[int], held: Rendered | None = None
    ) -> Rendered:
        """Render and tokenize messages up to the answer cue: only what they add to `held`
        where they carry it on, else whole. Either way the ids are the whole text's."""
        count = carried_on(held, messages, image_tokens) if self.incremental else 0
        if held is not None and count and self._cue is not None and self._anchor is not None:
            tail = tail_text(self._render, self._anchor, messages[count:])
            parts = None if tail is None else tail.split(self.image_token)
            had = len(held.image_tokens)
            if parts is not None and had + len(parts) - 1 == len(image_tokens):
                base = held.text[: len(held.text) - len(self._cue)]
                text = base + self._expand(parts, image_tokens[had:])
                spliced = splice_ids(self._encode, held, text, len(base))
                ids, ends = spliced or self._encode(text, whole=True)
                return Rendered(tuple(messages), text, ids, ends, tuple(image_tokens))
        text = self._expand(self.render(messages).split(self.image_token), image_tokens)
        ids, ends = self._encode(text, whole=True)
        return Rendered(tuple(messages), text, ids, ends, tuple(image_tokens))

    def render(self, messages: list[Message]) -> str:
        """Render messages as the model sees them, ending with the assistant's cue."""
        return self._render(messages, True)

    def prefix_text(self, system_prompt: str | None, images: int = 1) -> str:
        """Return the text before the first question's words: system prompt and the images."""
        full = self.render(self.messages(system_prompt, [], self._mark, 0, images))
        at = full.find(self._mark)
        if at < 0:
            raise ValueError("chat template dropped the message text; it cannot be served")
        return full[:at]

    def tokenize(self, text: str, image_tokens: Sequence[int]) -> list[int]:
        """Tokenize rendered text as the processor does: each image placeholder expanded."""
        return self._encode(self._expand(text.split(self.image_token), image_tokens), True)[0]

    def _expand(self, parts: list[str], image_tokens: Sequence[int]) -> str:
        """Join text split at its image placeholders, each expanded to its image's tokens."""
        if len(parts) - 1 != len(image_tokens):
            raise ValueError(
                f"the text has {len(parts) - 1} image placeholders for {len(image_tokens)} images"
            )
        expanded = parts[0]
        for count, part in zip(image_tokens, parts[1:], strict=True):
            expanded += self.image_token * count + part
        return expanded

    def _encode(self, text: str, whole: bool = False) -> tuple[list[int], list[int]]:
        """Return text's ids and where each one's text ends (a whole text gets BOS)."""
        if self._backend is not None:
            out = self._backend.encode(text, add_special_tokens=whole)
            return out.ids, [end for _, end in out.offsets]
        if not self.incremental:  # nothing is spliced: no offsets (a slow tokenizer has none)
            return self._tokenizer(text, add_special_tokens=whole)["input_ids"], []
        out = self._tokenizer(text, add_special_tokens=whole, return_offsets_mapping=True)
        return out["input_ids"], [end for _, end in out["offset_mapping"]]

    def _same_backend(self) -> Any:
        """Return the fast tokenizer's `tokenizers` object where it gives the tokenizer's own ids
        and offsets on probe texts (the wrapper adds only Python around it), else None."""
        backend = getattr(self._tokenizer, "backend_tokenizer", None)
        if backend is None:
            return None
        for text in ("USER: <image>\nWhat is this? ASSISTANT: A cat.</s>", " Ünïcode ✓ 😀  a\nb "):
            for whole in (True, False):
                want = self._tokenizer(text, add_special_tokens=whole, return_offsets_mapping=True)
                got = backend.encode(text, add_special_tokens=whole)
                if got.ids != want["input_ids"] or got.offsets != list(
                    map(tuple, want["offset_mapping"])
                ):
                    return None
        return backend

    def _render(self, messages: list[Message], cue: bool) -> str:
        return self._processor.apply_chat_template(
            messages, add_generation_prompt=cue, tokenize=False
        )

    def _answer_cue(self) -> str | None:
        """Return what the template appends for the answer ("" for one whose user message ends
        with it, as Mistral's [/INST]; None if the cued text does not extend the bare one)."""
        probe = self.messages(None, [Exchange("Hi", "Hello")], "Why?")
        bare, cued = self._render(probe, False), self._render(probe, True)
        return cued[len(bare) :] if cued.startswith(bare) else None

    def _anchor_text(self) -> str | None:
        """Render the fixed user message the new messages follow (None for a template that
        refuses it, as one requiring an image in the first message: no shortcut)."""
        try:
            return self._render([ANCHOR], False)
        except Exception:
            return None

    def _renders_messages_alone(self) -> bool:
        """Check on probe conversations that rendering and tokenizing from the last turn's
        prompt gives the whole conversation's text and ids (the template renders each message
        on its own: no system prompt moved to the last message, no images numbered across)."""
        words = ["What is this?", "Ünïcode ✓ and 😀", "two  spaces ", "a\nnew line", "Yes."]
        for system in (None, "Be brief."):
            for opening, added_at in ((1, None), (0, None), (1, 2)):
                held: Rendered | None = None
                history: list[Exchange] = []
                for turn, prompt in enumerate(words):
                    added = int(turn == added_at)
                    tokens = [3] * (opening + sum(e.added_images for e in history) + added)
                    messages = self.messages(system, history, prompt, added, opening)
                    try:
                        got = self.prompt(messages, tokens, held)
                        want = self.tokenize(self.render(messages), tokens)
                    except Exception:  # a template that refuses a probe: no shortcut
                        return False
                    if got.ids != want:
                        return False
                    held = got
                    history.append(Exchange(prompt, words[-1 - turn], added))
        return True

    def tokens_over(self, text: str, limit: int) -> int | None:
        """Return the token count of user text on its own if over `limit`, else None. A text
        whose normalized UTF-8 bytes are within the limit is not tokenized: no token holds less
        than a byte (plus one for a prefix space the tokenizer adds)."""
        if self._backend is not None:
            normalizer = self._backend.normalizer
            normalized = text if normalizer is None else normalizer.normalize_str(text)
            if len(normalized.encode()) + 1 <= limit:
                return None
        count = len(self._encode(text)[0])
        return count if count > limit else None


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Return the length of the longest common prefix of two id sequences."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case, compared at C speed
        return n
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _message(role: str, text: str) -> Message:
    return {"role": role, "content": [{"type": "text", "text": text}]}
