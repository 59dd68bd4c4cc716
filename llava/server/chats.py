"""OpenAI chat completions in the step loop: with a session header, or reusing what the instance
holds of a conversation sent without one (what every off-the-shelf chat client does).

A chat client re-sends the whole conversation every turn, every image in it again. Without a
session header the kit still reuses what it holds: the conversation's image is matched by its
content (the image file's bytes, however they were sent), the text by token prefix. A chat that
carries on a held conversation is answered in that conversation's session, which grows with
it; one that shares only a start with it (a side request over the same history, an edited or
regenerated answer) is answered in a fork holding the shared prefix, so the original stays as
it was. Either way only the new tokens are prefilled and the vision tower does not run again.
Chats sent with a `cache_salt` (a tenant's own) find only what was held for the same salt.
What is held this way is an ordinary session (`implicit`): under the same budgets and memory
tiers, evicted least recently used first, and never pinned: an open that finds every slot
taken ends the oldest idle one.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Generic

from llava.api.headers import NEW_SESSION
from llava.api.openai import ChatCompletion, check_same_chat, is_handle, message_text
from llava.api.openai_replies import OpenAIReplies
from llava.api.replies import Replies, Reply, as_kit_error, error_reply
from llava.core.errors import CapacityExceeded, InvalidRequest, UnknownImageHandle
from llava.images.background import BackgroundImages
from llava.server.contract import Engine, StateT, TurnT
from llava.server.image_handles import ImageHandles, unknown_handle
from llava.server.inflight import Answering, Fetching
from llava.server.opening import SessionOpener
from llava.sessions.session import Session, Slot
from llava.sessions.store import SessionStore

CANDIDATES = 4  # held conversations compared with a chat (each costs a tokenization)


class ChatDesk(Generic[StateT, TurnT]):
    """Admit chat completions and find what the instance holds of their conversations."""

    def __init__(
        self,
        engine: Engine[StateT, TurnT],
        store: SessionStore,
        opener: SessionOpener[StateT, TurnT],
        images: BackgroundImages,
    ) -> None:
        self.engine = engine
        self.store = store
        self.opener = opener
        self.images = images
        self._held: dict[str, list[str]] = {}  # conversation key -> session ids, newest last
        self.handles = ImageHandles()

    def admit(self, request: ChatCompletion) -> Fetching | Answering[TurnT]:
        """Start a chat: fetch its image (header-less or opening), or answer in its session."""
        replies = OpenAIReplies(request.model, request.include_usage)
        salt = request.cache_salt
        if request.session is None:
            named = {i: self.handles.resolve(salt, u) for i, u in request.handles.items()}
            image = self.images.submit_all(request.images, self._is_held(request), named)
            return Fetching(request, image, replies=replies)
        if request.session == NEW_SESSION:
            if request.handles:
                raise InvalidRequest(
                    "a session opens with its pictures' bytes, not their uuids alone",
                    field="messages",
                )
            return self.opener.fetch(request, replies)
        session = self.store.begin_turn(request.session)
        try:
            check_same_chat(session.info, request)
            return self.answer(session, request, replies)
        except BaseException:
            self.store.end_turn(session)
            raise

    def answer(
        self,
        session: Session,
        request: ChatCompletion,
        replies: Replies,
        headers: dict[str, str] | None = None,
    ) -> Answering[TurnT]:
        """Answer a chat in a session held busy for it (committed to it when finished)."""
        turn = self.engine.start_chat(session.state, request.chat, request.params)
        return Answering(session, turn, request.stream, replies, headers=headers or {})

    def answer_opened(
        self,
        opened: Session,
        request: ChatCompletion,
        replies: Replies | None,
        headers: dict[str, str],
    ) -> Answering[TurnT] | Reply:
        """Answer a chat completion sent with NEW_SESSION in the session just opened for it."""
        session = self.store.begin_turn(opened.id)
        assert replies is not None
        try:
            return self.answer(session, request, replies, headers)
        except BaseException as exc:  # the client never learns the id: close the session
            self.store.end_turn(session)
            self.store.close(session.id)
            return error_reply(as_kit_error(exc))

    def arrived(self, work: Fetching) -> Fetching | Answering[TurnT] | Reply:
        """Answer a header-less chat whose image is read: in a held session, a fork of one, or
        a new state that is kept once answered."""
        request, replies = work.request, work.replies
        assert isinstance(request, ChatCompletion) and replies is not None
        try:
            prepared, digest = work.image.result()
        except UnknownImageHandle:
            raise unknown_handle(next(iter(request.handles.values()))) from None
        self._bind(request, digest)  # a uuid sent with other bytes than before: refused here
        key = self._key(digest, request)
        chat = request.chat
        best: tuple[int, bool, Session] | None = None
        for session in self._candidates(key):
            held, carries = self.engine.held_of_chat(session.state, chat)
            if request.handles and not (carries and _answered_in(session, request)):
                continue  # a handle: only the chat that carries on it, its last answer too
            if best is None or held > best[0]:
                best = (held, carries, session)
        if request.handles and best is None:
            raise unknown_handle(next(iter(request.handles.values())))
        if best is not None and best[1] and not best[2].busy:
            session = self.store.begin_turn(best[2].id)
            try:
                return self.answer(session, request, replies)
            except BaseException:
                self.store.end_turn(session)
                raise
        if best is not None:
            state = self.engine.fork(best[2].state, best[0])
        elif request.images and prepared is None:  # what held it is gone: prepare it after all
            image = self.images.submit_all(request.images, _never_held)
            return Fetching(request, image, replies=replies)
        else:
            state = self.engine.new_session(prepared, request.system_prompt)
        return self._answer_kept(state, request, replies, key)

    def adopt(self, work: Answering[TurnT]) -> bool:
        """Keep a header-less chat's answered state as a session; tell whether it was kept."""
        if work.adopt is None:
            return False
        state = work.session.state
        answer = answer_digest(work.turn.text)
        session = self.store.add(
            work.adopt, state, state.nbytes, implicit=True, key=work.key, answer=answer
        )
        work.adopt, work.kept = None, True
        self._held.setdefault(work.key or "", []).append(session.id)
        if len(self._held) > 2 * self.store.max_sessions:  # keys of chats long gone: drop them
            for key in list(self._held):
                self._candidates(key)
        return True

    def note_answer(self, work: Answering[TurnT]) -> None:
        """Keep a header-less chat's last answer with its session (what a handle checks)."""
        if work.session.info.get("implicit"):
            work.session.info["answer"] = answer_digest(work.turn.text)

    def _bind(self, request: ChatCompletion, digest: str) -> None:
        """Name each picture sent with bytes and a uuid by its content, for later turns."""
        digests = digest.split("+") if digest else []
        for i, (ref, uuid) in enumerate(request.refs_and_uuids):
            if uuid is not None and not is_handle(ref) and i < len(digests):
                self.handles.bind(request.cache_salt, uuid, digests[i])

    def _answer_kept(
        self, state: StateT, request: ChatCompletion, replies: Replies, key: str
    ) -> Answering[TurnT] | Reply:
        """Answer in a state of its own, kept as a session afterwards if a slot is free."""
        try:
            turn = self.engine.start_chat(state, request.chat, request.params)
        except BaseException as exc:
            self.engine.release(state)
            return error_reply(as_kit_error(exc))
        slot: Slot | None
        try:
            slot = self.store.reserve()
        except CapacityExceeded:  # no slot (all held, or max_opening opening): answer, keep nothing
            slot = None
        session = Session("", state, 0, 0.0, busy=True)
        return Answering(
            session, turn, request.stream, replies, transient=True, adopt=slot, key=key
        )

    def _still_held(self, key: str) -> list[Session]:
        """The sessions kept under this key that have not ended, oldest first (reads only: an
        image thread asks too)."""
        sessions = (self.store.peek(sid) for sid in list(self._held.get(key, ())))
        return [s for s in sessions if s is not None]

    def _candidates(self, key: str) -> list[Session]:
        """The sessions still holding a conversation with this key, newest first."""
        held = self._still_held(key)
        if held:
            self._held[key] = [s.id for s in held]
        else:
            self._held.pop(key, None)
        return [s for s in reversed(held[-CANDIDATES:]) if s.state is not None]

    def _is_held(self, request: ChatCompletion) -> Callable[[str], bool]:
        """What tells the image threads that a session holds this image (skip preparing it)."""

        def known(digest: str) -> bool:  # none, or all ended since: prepare them now, once
            held = self._still_held(self._key(digest, request))
            return any(s.state is not None for s in held)

        return known

    @staticmethod
    def _key(digest: str, request: ChatCompletion) -> str:
        """What a held conversation is found by: its pictures, system prompt and cache salt."""
        return json.dumps([request.cache_salt, digest, request.system_prompt])


def answer_digest(text: str) -> str:
    """What a header-less chat's session keeps of its last answer (`info["answer"]`)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _answered_in(session: Session, request: ChatCompletion) -> bool:
    """Whether a chat's last answer is the one this session gave: a picture named by its uuid
    alone is resolved only for the caller who holds the whole conversation so far."""
    earlier = [m for m in request.chat[:-1] if m["role"] == "assistant"]
    answer = session.info.get("answer")
    return bool(earlier) and answer == answer_digest(message_text(earlier[-1]))


def _never_held(digest: str) -> bool:
    """Hash the images (their digest keys what is kept) but prepare them whatever it is."""
    return False
