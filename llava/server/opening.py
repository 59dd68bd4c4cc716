"""Opening sessions: a slot held while the image loads, the state computed in steps, then stored.

An open passes through three stages, each bounded so the shared step loop never waits on it:
1. `fetch` holds a session slot while the image is loaded, decoded and prepared off the step
   loop (the image reference's digest is taken there too, for chat completions to recognise it);
2. `begin` makes the session's state and the turn that encodes its image and prefills its
   prefix, which the engine's scheduler runs in pieces, step by step, with everyone's answers;
3. `finish` stores the session once that turn is done; `abort` frees everything at any stage.
"""

from __future__ import annotations

from typing import Generic

from llava.api.headers import NEW_SESSION_HEADER, SESSION_HEADER, expires_header, iso_utc
from llava.api.openai import ChatCompletion, chat_info, image_key
from llava.api.replies import (
    KitReplies,
    Replies,
    Reply,
    as_kit_error,
    error_reply,
    internal_error,
    json_reply,
)
from llava.api.session_api import Generate, OpenSession
from llava.images.background import BackgroundImages
from llava.server.contract import Engine, StateT, TurnT
from llava.server.inflight import Answering, Fetching, Opening
from llava.sessions.session import Session, Slot
from llava.sessions.store import SessionStore


class SessionOpener(Generic[StateT, TurnT]):
    """Take an open from its slot to a stored session, or free what it held."""

    def __init__(
        self, engine: Engine[StateT, TurnT], store: SessionStore, images: BackgroundImages
    ) -> None:
        self.engine = engine
        self.store = store
        self.images = images

    def fetch(self, request: OpenSession | ChatCompletion, replies: Replies | None) -> Fetching:
        """Hold a session slot while the image loads (freed if the load cannot start)."""
        slot = self.store.reserve()
        if isinstance(request, OpenSession):
            refs = [request.image] if request.image is not None else []
        else:
            refs = list(request.images)
        try:
            image = self.images.submit_all(refs)
        except BaseException:
            self.store.cancel(slot)
            raise
        return Fetching(request, image, slot, replies=replies)

    def begin(self, work: Fetching) -> Opening[StateT, TurnT] | Reply:
        """Make the new session's state; its image and prefix are computed in later steps."""
        request = work.request
        assert work.slot is not None and isinstance(request, (OpenSession, ChatCompletion))
        state: StateT | None = None
        try:
            prepared, _ = work.image.result()
            state = self.engine.new_session(prepared, request.system_prompt)
            if isinstance(request, OpenSession) and request.history:
                self.engine.replay(state, list(request.history))
            turn = self.engine.start_open(state, isinstance(request, ChatCompletion))
        except BaseException as exc:
            self._cancel(work.slot, state)
            return error_reply(as_kit_error(exc))
        if isinstance(request, ChatCompletion):
            key = request.image_key
        else:
            key = image_key(request.image or "")
        chat = request if isinstance(request, ChatCompletion) else None
        info = chat_info(key, request.system_prompt, chat)
        return Opening(request, work.slot, state, turn, info, work.replies)

    def finish(self, work: Opening[StateT, TurnT]) -> Session | Reply:
        """Store a session whose opening is computed."""
        try:
            self.engine.finish_turn(work.turn)
            return self.store.add(work.slot, work.state, work.state.nbytes, **work.info)
        except BaseException as exc:
            self._cancel(work.slot, work.state)
            return error_reply(as_kit_error(exc))

    def abort(self, work: Opening[StateT, TurnT]) -> None:
        """Drop an open whose turn failed or whose client left."""
        try:
            self.engine.abort_turn(work.turn)
        finally:
            self._cancel(work.slot, work.state)

    def one_shot(self, work: Fetching) -> Answering[TurnT]:
        """Turn a one-shot generate whose image arrived into an answer with a transient state."""
        request = work.request
        assert isinstance(request, Generate)
        prepared, _ = work.image.result()
        state = self.engine.new_session(prepared, request.system_prompt)
        try:
            self.engine.replay(state, list(request.history))
            turn = self.engine.start_turn(state, request.prompt, request.params)
        except BaseException:
            self.engine.release(state)
            raise
        session = Session("", state, 0, 0.0, busy=True)
        replies = work.replies or KitReplies(None)
        return Answering(session, turn, request.stream, replies, transient=True)

    def opened_reply(self, session: Session) -> Reply:
        """The reply to `open_session`: the id and expiry, in the body and the headers."""
        body = {"session_id": session.id, "expires_at": iso_utc(self.store.expires_at(session))}
        return json_reply(body, self.headers(session))

    def headers(self, session: Session) -> dict[str, str]:
        """SageMaker's new-session header (and the sticky one) for a session just opened."""
        value = expires_header(session.id, self.store.expires_at(session))
        return {NEW_SESSION_HEADER: value, SESSION_HEADER: value}

    def _cancel(self, slot: Slot, state: StateT | None) -> None:
        """Free an open's slot and whatever engine state it had (or its memory leaks)."""
        self.store.cancel(slot)
        if state is not None:
            try:
                self.engine.release(state)
            except Exception as exc:
                internal_error(exc)
