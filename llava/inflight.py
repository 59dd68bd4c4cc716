"""What the service tracks for each request between steps: waiting for an image, or answering."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Generic

from llava.chat_completions import ChatCompletion
from llava.contract import TurnT
from llava.protocol import Generate, OpenSession, Query
from llava.replies import Replies
from llava.sessions import Session, Slot


@dataclass(eq=False)
class Fetching:
    """A request waiting for its image: an open, a one-shot generate or a query adding one."""

    request: OpenSession | Generate | Query | ChatCompletion
    image: Future
    slot: Slot | None = None  # an open's reserved session slot
    session: Session | None = None  # a query's session, held busy while its image arrives
    replies: Replies | None = None  # how the answer is written, when not the session API's


@dataclass(eq=False)
class Answering(Generic[TurnT]):
    """A request whose answer is being generated, one step at a time."""

    session: Session
    turn: TurnT
    stream: bool
    replies: Replies
    transient: bool = False  # a one-shot generate: its state is dropped at the end
    streaming: bool = False  # the HTTP head has gone out
    headers: dict[str, str] = field(default_factory=dict)  # sent with the first reply
