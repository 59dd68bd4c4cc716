"""What the service tracks for each request between steps: waiting for an image, opening a
session (its image encoded and prefilled over several steps), or answering."""

from __future__ import annotations

import time
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Generic

from llava.api.openai import ChatCompletion
from llava.api.replies import Replies, Reply, error_reply
from llava.api.session_api import Generate, OpenSession, Query
from llava.core.errors import KitError
from llava.server.contract import StateT, TurnT
from llava.sessions.session import Session, Slot


@dataclass(frozen=True)
class Incoming:
    """One request as seen in one step: its id, its body (until it has had a reply) and its
    headers."""

    request_id: str
    body: Any
    headers: Mapping[str, Any]


@dataclass(eq=False)
class Fetching:
    """A request waiting for its image: an open, a one-shot generate or a query adding one."""

    request: OpenSession | Generate | Query | ChatCompletion
    image: Future
    slot: Slot | None = None  # an open's reserved session slot
    session: Session | None = None  # a query's session, held busy while its image arrives
    replies: Replies | None = None  # how the answer is written, when not the session API's


@dataclass(eq=False)
class Opening(Generic[StateT, TurnT]):
    """A session being opened: its state exists, its image and prefix are computed in steps."""

    request: OpenSession | ChatCompletion
    slot: Slot
    state: StateT
    turn: TurnT
    info: dict[str, Any]  # what the store keeps of the opening (image key, system prompt)
    replies: Replies | None = None  # a chat completion's: it answers once the session is open


@dataclass(eq=False)
class Answering(Generic[TurnT]):
    """A request whose answer is being generated, one step at a time."""

    session: Session
    turn: TurnT
    stream: bool
    replies: Replies
    transient: bool = False  # a one-shot answer: its state is dropped at the end, unless
    adopt: Slot | None = None  # ... a header-less chat's, kept as a session in this slot
    key: str | None = None  # ... under this conversation key (`chats.py`)
    kept: bool = False  # ... which it was: the state lives on in the store
    admitted: float = field(default_factory=time.monotonic)
    sent_tokens: int = 0  # tokens out with the head or a line (`streaming` once any)
    headers: dict[str, str] = field(default_factory=dict)  # sent with the first reply

    def overdue(self, limit_s: float | None, now: float) -> bool:
        """Whether a whole (not streamed) answer with some text has outlasted its caller's
        time limit: SageMaker drops a response that takes over 60 s."""
        late = limit_s is not None and now - self.admitted > limit_s
        return late and not self.stream and bool(self.turn.generated)

    @property
    def streaming(self) -> bool:
        """The HTTP head has gone out: with the first token's line, or a large whole answer's
        first token (`head_reply`)."""
        return self.sent_tokens > 0

    def chunk(self) -> Reply | None:
        """What a step that did not finish the answer sends: its token's line, if streamed."""
        if not self.stream:
            return None
        tokens = len(self.turn.generated)
        if tokens == self.sent_tokens:
            return None  # no token this step (the prompt is still prefilling): stay silent
        # One line per token, even one whose text is held back (half a character): a client
        # sees every step of its answer, so a live stream never looks stalled. The head
        # (status 200) goes out with the first token: until then a failing prefill still
        # answers with its own status.
        reply = self.stream_reply(self.replies.chunk(self.turn.delta), last=False)
        self.sent_tokens = tokens
        return reply

    def head_reply(self) -> Reply | None:
        """A whole answer's head (200, no body) once its first token is out, as a stream's goes:
        TorchServe re-sends a request's body every step until it has had a reply."""
        if self.stream or self.streaming or not self.turn.generated:
            return None
        self.sent_tokens = len(self.turn.generated)
        return Reply(b"", headers=self.headers, last=False)

    def finished(self, **more_usage: Any) -> Reply:
        """The reply of a finished answer: its last stream chunk, or the whole response."""
        turn = self.turn
        usage = {**turn.usage(), **more_usage}
        if self.stream:
            return self.stream_reply(
                self.replies.last(turn.delta, usage, turn.finish_reason), last=True
            )
        whole = self.replies.whole(turn.text, usage, turn.finish_reason)
        if self.streaming:  # its head went out early (`head_reply`): the body's one chunk
            return Reply(whole, last=True)
        return Reply(whole, headers=self.headers)

    def failed(self, error: KitError) -> Reply:
        """The reply of a failed answer: in-band once its head has gone out, else an error."""
        if self.streaming and not self.stream:  # the whole answer's body is the error
            return Reply(error_reply(error).body, last=True)
        if self.streaming:  # the head is gone: report in-band and end the stream
            kind = self.replies.stream_content_type
            return Reply(self.replies.error(error.to_body()), content_type=kind, last=True)
        return error_reply(error)

    def stream_reply(self, body: bytes, *, last: bool) -> Reply:
        first = not self.streaming
        kind = self.replies.stream_content_type
        headers = self.headers if first else {}
        if first and last:  # a stream that is over at its first step is just a whole response
            return Reply(body, headers=headers, content_type=kind, last=None)
        return Reply(body, headers=headers, content_type=kind, last=last)
