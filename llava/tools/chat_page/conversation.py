"""One browser tab's conversation: its image, its finished turns and the session that holds them.

Talks to the endpoint through the kit's own `SessionClient` (HTTP to TorchServe, boto3 to
SageMaker or a local runtime). The session is the server's; this object keeps what is needed to
rebuild it: when the server answers that the session expired, was lost (a worker restart without
snapshots) or is unknown, the conversation is reopened with the same image, system prompt and
finished turns (`open_session` with `history`), and the page shows a notice.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from llava.client import Session, SessionClient
from llava.core.errors import SessionBusy, SessionError

# A stopped stream leaves its session busy until the server notices the client went (a step).
BUSY_WAIT_S = 5.0


@dataclass(frozen=True)
class Settings:
    """What the page sets for each answer."""

    system_prompt: str | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    max_new_tokens: int = 256


@dataclass
class Conversation:
    """The conversation of one tab; `ask` and `regenerate` stream the growing answer."""

    client: SessionClient
    image: str | None = None  # the image reference sent to open_session
    system_prompt: str | None = None
    turns: list[tuple[str, str]] = field(default_factory=list)
    session: Session | None = None
    notice: str = ""  # what the page should tell the user about the last answer
    usage: dict[str, Any] = field(default_factory=dict)
    stopping: bool = False  # the page asked to stop the answer being streamed

    def start(self, image: str | None, system_prompt: str | None) -> None:
        """Begin a new conversation about `image`: the old session is closed now, the new one
        opens with the first question (an image picked and replaced opens nothing)."""
        self.close()
        self.image, self.system_prompt, self.turns, self.usage = image, system_prompt, [], {}

    def ask(self, prompt: str, settings: Settings) -> Iterator[str]:
        """Stream the answer to `prompt` (the text so far, growing); the turn is kept once the
        answer is whole. A stream the page stops is dropped by the server too."""
        self.notice = ""
        if self.image is None:
            raise ValueError("upload an image or paste an image URL first")
        if settings.system_prompt != self.system_prompt:  # a new system prompt: a new session
            self.system_prompt = settings.system_prompt
            self._reopen("The system prompt changed: the conversation continues in a new session.")
        text = ""
        for delta in self._stream(prompt, settings):
            text += delta
            yield text
        self.turns.append((prompt, text))
        self.usage = dict(self.session.last_usage or {}) if self.session else {}

    def regenerate(self, settings: Settings) -> Iterator[str]:
        """Answer the last question again; the session rolls its last turn back first, so the
        new answer costs only its own tokens."""
        if not self.turns:
            raise ValueError("there is no answer to regenerate yet")
        prompt, _ = self.turns.pop()
        if self.session is not None:
            try:
                self._unbusy(self.session.rollback)
            except SessionError:  # gone: the reopen below carries the remaining turns
                self.session = None
        yield from self.ask(prompt, settings)

    def close(self) -> None:
        """Close the session on the server (idempotent)."""
        if self.session is not None:
            # Closing is a courtesy: the server's TTL frees a session it never hears from.
            with contextlib.suppress(Exception):
                self.session.close()
            self.session = None

    def _stream(self, prompt: str, settings: Settings) -> Iterator[str]:
        if self.session is None:
            self._reopen("")
        assert self.session is not None
        params = {
            "max_new_tokens": settings.max_new_tokens,
            "temperature": settings.temperature,
            "top_p": settings.top_p,
        }
        try:
            deltas = self._unbusy(lambda: self._first(self.session, prompt, params))
        except SessionError as exc:
            self._reopen(
                f"The session had ended ({exc.code}): it was reopened with the same "
                "image and conversation."
            )
            deltas = self._first(self.session, prompt, params)
        yield from deltas

    @staticmethod
    def _first(session: Session | None, prompt: str, params: dict[str, Any]) -> Iterator[str]:
        """Start a stream and wait for its first delta, so session errors raise here."""
        assert session is not None
        stream = session.stream(prompt, **params)
        try:
            first = next(stream)
        except StopIteration:
            return iter(())
        return _chain(first, stream)

    def _reopen(self, notice: str) -> None:
        self.close()
        assert self.image is not None
        self.session = self.client.session(
            self.image, system_prompt=self.system_prompt, history=list(self.turns)
        )
        self.notice = notice

    @staticmethod
    def _unbusy(call: Any) -> Any:
        """Call, retrying while the session still finishes a stopped answer."""
        deadline = time.monotonic() + BUSY_WAIT_S
        while True:
            try:
                return call()
            except SessionBusy:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)


def _chain(first: str, rest: Iterator[str]) -> Iterator[str]:
    yield first
    yield from rest


def usage_line(usage: dict[str, Any]) -> str:
    """One line under an answer: time to first token, tokens generated and reused."""
    if not usage:
        return ""
    return (
        f"time to first token {usage.get('ttft_ms', 0):.0f} ms · "
        f"{usage.get('generated_tokens', 0)} tokens generated · "
        f"{usage.get('cached_tokens', 0)} reused from the session · "
        f"{usage.get('prefill_tokens', 0)} prefilled"
    )
