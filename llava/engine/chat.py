"""Turn a conversation into token-id deltas with the model's own chat template.

A session keeps token ids, never re-rendered text, so each turn must know only the text it adds:
the template is rendered with a random marker where the new content starts and cut there. This
works for any template that renders earlier messages the same whatever follows them (all LLaVA
templates do); `ChatFormatter` raises `ValueError` at load time for one that does not.
"""

from __future__ import annotations

import secrets
from typing import Any

Message = dict[str, Any]


class ChatFormatter:
    """Render the open prefix and each turn's added text with a processor's chat template."""

    def __init__(self, processor: Any) -> None:
        if getattr(processor, "chat_template", None) is None:
            raise ValueError(
                "the checkpoint has no chat template: use a llava-hf/* checkpoint or add "
                "chat_template.jinja next to its processor files"
            )
        self._processor = processor
        self._mark = "MARK" + secrets.token_hex(8)  # random, so user text cannot collide
        self.open_text(None)  # fail at load time, not on the first request

    def open_text(self, system_prompt: str | None) -> str:
        """Return the text before the first question: system prompt and the image."""
        full = self._render(self._opening(system_prompt, self._mark), generation=True)
        return full[: self._cut(full, self._mark)]

    def turn_text(
        self, system_prompt: str | None, history: list[tuple[str, str]], prompt: str
    ) -> str:
        """Return the text a new question adds after `history` (pairs of prompt and answer)."""
        if not history:
            opening = self.open_text(system_prompt)
            full = self._render(self._opening(system_prompt, prompt), generation=True)
            if not full.startswith(opening):
                raise ValueError(
                    "chat template renders the opening differently once a prompt follows"
                )
            return full[len(opening) :]
        messages = self._opening(system_prompt, history[0][0])
        for i, (question, answer) in enumerate(history):
            if i:
                messages.append(_message("user", question))
            last = i == len(history) - 1
            messages.append(_message("assistant", self._mark if last else answer))
        messages.append(_message("user", prompt))
        full = self._render(messages, generation=True)
        return full[self._cut(full, self._mark) + len(self._mark) :]

    def _opening(self, system_prompt: str | None, first_text: str) -> list[Message]:
        messages = [_message("system", system_prompt)] if system_prompt else []
        messages.append(
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": first_text}]}
        )
        return messages

    def _render(self, messages: list[Message], *, generation: bool) -> str:
        return self._processor.apply_chat_template(
            messages, add_generation_prompt=generation, tokenize=False
        )

    @staticmethod
    def _cut(text: str, mark: str) -> int:
        at = text.find(mark)
        if at < 0:
            raise ValueError("chat template dropped the message text; it cannot be split in turns")
        return at


def _message(role: str, text: str) -> Message:
    return {"role": role, "content": [{"type": "text", "text": text}]}
