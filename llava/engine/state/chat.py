"""Turn a conversation into the exact token ids the model's own pipeline would feed it.

transformers' pipeline renders the whole conversation with the processor's chat template,
replaces each image placeholder with as many image tokens as that image takes, and tokenizes the
result in one call. Tokenizing a turn's text on its own gives different ids with SentencePiece
(Metaspace) tokenizers (a word-start piece where the whole-text tokenization has none), so a
session re-renders and re-tokenizes its whole conversation every turn and reuses its cache for
the longest common prefix of the cached ids and the new ones (see `common_prefix`).
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

Message = dict[str, Any]


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
        self.image_token: str = processor.image_token
        self._mark = "MARK" + secrets.token_hex(8)  # random, so user text cannot collide
        self._last: tuple[Any, Sequence[Message], list[int]] | None = None
        self.prefix_text(None)  # fail at load time, not on the first request

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

    def chat_ids(
        self, system_prompt: str | None, chat: Sequence[Message], image_tokens: Sequence[int]
    ) -> list[int]:
        """Render and tokenize a client's chat; the same chat object asked again (checked
        against held conversations, then answered) is rendered once."""
        key = (id(chat), system_prompt, tuple(image_tokens))
        if self._last is not None and self._last[0] == key and self._last[1] is chat:
            return self._last[2]
        ids = self.tokenize(self.render(self.chat_messages(system_prompt, chat)), image_tokens)
        self._last = (key, chat, ids)  # holds the chat, so its id cannot be reused meanwhile
        return ids

    def render(self, messages: list[Message]) -> str:
        """Render messages as the model sees them, ending with the assistant's cue."""
        return self._processor.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )

    def prefix_text(self, system_prompt: str | None, images: int = 1) -> str:
        """Return the text before the first question's words: system prompt and the images."""
        full = self.render(self.messages(system_prompt, [], self._mark, 0, images))
        at = full.find(self._mark)
        if at < 0:
            raise ValueError("chat template dropped the message text; it cannot be served")
        return full[:at]

    def tokenize(self, text: str, image_tokens: Sequence[int]) -> list[int]:
        """Tokenize rendered text as the processor does: each image placeholder expanded."""
        parts = text.split(self.image_token)
        if len(parts) - 1 != len(image_tokens):
            raise ValueError(
                f"the text has {len(parts) - 1} image placeholders for {len(image_tokens)} images"
            )
        expanded = parts[0]
        for count, part in zip(image_tokens, parts[1:], strict=True):
            expanded += self.image_token * count + part
        return self._tokenizer(expanded)["input_ids"]

    def count_tokens(self, text: str) -> int:
        """Count the tokens of a piece of user text on its own (for the prompt limit)."""
        return len(self._tokenizer(text, add_special_tokens=False)["input_ids"])


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Return the length of the longest common prefix of two id sequences."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _message(role: str, text: str) -> Message:
    return {"role": role, "content": [{"type": "text", "text": text}]}
