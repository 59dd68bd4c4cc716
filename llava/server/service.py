"""The session service: advance every in-flight request by one step per call.

TorchServe's continuous batching calls the handler once per generation step with every active
request; this module is what the handler delegates to, with no TorchServe types in sight. Each
call to `step()` admits new requests, turns those whose images have arrived (fetched on the
image threads, decoded and run through the processor in the image processes) into engine turns,
runs one engine step over every open being computed and every answer (the engine's scheduler
decides how much of each, under a token budget), and returns, per request, either a `Reply` or
`None` ("nothing to send yet": the request stays in the batch and comes back next step). A
request that disappears from the batch has lost its client: its work is rolled back. A step
that runs out of device memory frees what it can (idle sessions' caches move to host memory)
and is retried once.

Nothing a request does can fail another: every error is caught per request and becomes that
request's own 4xx/5xx reply (or, once a stream has started, an in-band error line).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import FIRST_COMPLETED, wait
from typing import Any, Generic

from llava.api.dispatch import parse_request
from llava.api.openai import ChatCompletion, ListModels, models_body
from llava.api.replies import (
    KitReplies,
    Reply,
    as_kit_error,
    error_reply,
    internal_error,
    json_reply,
)
from llava.api.session_api import CloseSession, Generate, OpenSession, Query, Rollback
from llava.core.errors import KitError
from llava.core.params import Limits
from llava.images.background import BackgroundImages, ImageSource
from llava.server.chats import ChatDesk
from llava.server.contract import Engine, StateT, TurnT
from llava.server.draining import refuse_if_draining, stopped_replies
from llava.server.inflight import Answering, Fetching, Incoming, Opening
from llava.server.keeping import Keeper
from llava.server.opening import SessionOpener
from llava.server.out_of_memory import step_with_retry
from llava.server.resuming import Resuming, SessionResumer, closed_reply, resumed_usage
from llava.sessions.session import LOST, Session
from llava.sessions.shared import SharedStore
from llava.sessions.snapshots import SnapshotDir
from llava.sessions.store import SessionStore

log = logging.getLogger(__name__)

# How long a step with nothing else to do waits for an image download, so a batch of pending
# opens does not spin the frontend in a tight loop.
IDLE_WAIT_S = 0.02


_Work = Fetching | Resuming | Opening[Any, Any] | Answering[Any]


class SessionService(Generic[StateT, TurnT]):
    """Serve open / query / close requests over an engine, a session store and an image source."""

    def __init__(
        self,
        engine: Engine[StateT, TurnT],
        store: SessionStore,
        images: ImageSource,
        *,
        limits: Limits = Limits(),
        fetch_threads: int = 16,
        image_processes: int = 0,
        snapshots: SnapshotDir | None = None,
        shared: SharedStore | None = None,
        model_name: str = "llava",
        whole_answer_s: float | None = None,
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        self.whole_answer_s = whole_answer_s  # a whole answer ends in time (SageMaker's 60 s)
        self.started = int(time.time())
        self.store = store
        self.images = images
        self.limits = limits
        self.keeper = Keeper(engine, store, snapshots, shared)
        self.resumer = SessionResumer(engine, store, shared) if shared is not None else None
        self.draining = False  # shutting down: no new sessions
        self.stopping = False  # past the drain's grace: nothing new, answers ended
        self.usage_extra: dict[str, Any] = {}  # a front's own figures, e.g. which replica
        self._images = BackgroundImages(
            images, engine.image_preparer(), threads=fetch_threads, processes=image_processes
        )
        self.opener: SessionOpener[StateT, TurnT] = SessionOpener(engine, store, self._images)
        self.chats = ChatDesk(engine, store, self.opener, self._images)
        self._work: dict[str, _Work] = {}

    def start_image_processes(self) -> None:
        """Start the image processes now, so the first images do not wait for them."""
        if self._images.processes is not None:
            self._images.processes.start()

    def close(self) -> None:
        """Stop the image threads and processes."""
        self._images.close()

    @property
    def in_flight(self) -> int:
        return len(self._work)

    @property
    def answering(self) -> int:
        """Answers and opens being computed (what a drain lets finish)."""
        return sum(not isinstance(w, (Fetching, Resuming)) for w in list(self._work.values()))

    def step(self, batch: list[Incoming]) -> list[Reply | None]:
        """Advance every request of the batch by one step; never raises."""
        present = {item.request_id for item in batch}
        for request_id in [r for r in self._work if r not in present]:
            self._abandon(request_id)
        replies: dict[str, Reply] = {}
        for item in batch:
            if item.request_id not in self._work:
                reply = self._guard(self._admit, item)
                if reply is not None:
                    replies[item.request_id] = reply
        self._wait_if_idle(replies)
        for request_id, work in list(self._work.items()):
            reply = None
            if isinstance(work, Fetching) and work.image.done():
                reply = self._image_arrived(request_id, work)
            elif isinstance(work, Resuming) and work.ready():
                reply = self._resumed(request_id, work)
            if reply is not None:
                replies[request_id] = reply
        replies.update(self._advance_answers())
        return [replies.get(item.request_id) for item in batch]

    def head_reply(self, request_id: str) -> Reply | None:
        """A whole answer's head, once its first token is out (`Answering.head_reply`)."""
        work = self._work.get(request_id)
        return work.head_reply() if isinstance(work, Answering) else None

    # -- admission -------------------------------------------------------------------------
    def _guard(self, fn: Any, item: Incoming | None) -> Reply | None:
        try:
            return fn(item)
        except KitError as exc:
            return error_reply(exc)
        except Exception as exc:
            return error_reply(internal_error(exc))

    def _admit(self, item: Incoming, checked: bool = False) -> Reply | None:
        """Start a request; `checked`: its held session was checked against the store."""
        request = parse_request(item.body, item.headers, self.limits)
        if isinstance(request, ListModels):
            return json_reply(models_body(self.model_name, self.started))
        if self.resumer is not None and self.stopping:  # held: refused once stored
            waiting = self.resumer.admit(request, item, stopping=True)
            if waiting is not None:
                return self._put(item.request_id, waiting)
        refuse_if_draining(request, self.draining, self.stopping)
        if self.resumer is not None and (
            waiting := self.resumer.admit(request, item, False, checked)
        ):
            return self._put(item.request_id, waiting)
        if isinstance(request, OpenSession) and request.resume is not None:  # held here
            return self.opener.opened_reply(self.store.get(request.resume))
        if isinstance(request, ChatCompletion):
            return self._put(item.request_id, self.chats.admit(request))
        if isinstance(request, Generate):
            image = self._images.submit_all([request.image] if request.image else [])
            return self._put(item.request_id, Fetching(request, image))
        if isinstance(request, OpenSession):
            return self._put(item.request_id, self.opener.fetch(request, None))
        if isinstance(request, Query):
            session = self.store.begin_turn(request.session_id)
            try:
                if request.image is not None:
                    earlier = self.engine.earlier_images(session.state)
                    image = self._images.submit(request.image, earlier)
                    self._work[item.request_id] = Fetching(request, image, session=session)
                else:
                    self._start_query(item.request_id, request, session)
            except BaseException:
                self.store.end_turn(session)
                raise
            return None
        if isinstance(request, Rollback):
            return self._rollback(request)
        assert isinstance(request, CloseSession)
        return closed_reply(self.store.close(request.session_id).id)

    def _resumed(self, request_id: str, work: Resuming) -> Reply | None:
        """A session's stored state is read: restore it, then admit its request."""
        del self._work[request_id]
        assert self.resumer is not None
        resumer, opener = self.resumer, self.opener
        reply = self._guard(lambda _: resumer.arrived(work, opener), None)
        if reply is not None:
            return reply
        return self._guard(lambda item: self._admit(item, checked=True), work.item)

    def _rollback(self, request: Rollback) -> Reply:
        """Undo a session's last question and answer (a regenerate then reuses its cache)."""
        session = self.store.begin_turn(request.session_id)
        try:
            turns = self.engine.rollback(session.state)
            self.keeper.keep(session)
        finally:
            self.store.end_turn(session, self._nbytes(session))
        body = {"session_id": session.id, "rolled_back": True, "turns": turns}
        return json_reply(body)

    def _wait_if_idle(self, replies: dict[str, Reply]) -> None:
        if replies or self.answering:
            return
        pending = [
            w.image if isinstance(w, Fetching) else w.data
            for w in self._work.values()
            if isinstance(w, (Fetching, Resuming))
        ]
        if pending:
            wait(pending, timeout=IDLE_WAIT_S, return_when=FIRST_COMPLETED)

    def _start_query(
        self, request_id: str, request: Query, session: Session, image: Any = None
    ) -> None:
        turn = self.engine.start_turn(
            session.state, request.prompt, request.params, history=request.history, image=image
        )
        replies = KitReplies(session.id, sample_reply=request.sample_reply)
        self._work[request_id] = Answering(session, turn, request.stream, replies)

    # -- opening ---------------------------------------------------------------------------
    def _image_arrived(self, request_id: str, work: Fetching) -> Reply | None:
        del self._work[request_id]
        request = work.request
        if isinstance(request, Generate):
            return self._guard(lambda _: self._start_one_shot(request_id, work), None)
        if isinstance(request, ChatCompletion) and work.slot is None:  # no session header
            return self._guard(lambda _: self._put(request_id, self.chats.arrived(work)), None)
        if isinstance(request, Query):
            assert work.session is not None  # a query always holds its session
            session = work.session
            try:
                self._start_query(request_id, request, session, work.image.result())
            except BaseException as exc:
                self.store.end_turn(session)
                return error_reply(as_kit_error(exc))
            return None
        opening = self.opener.begin(work)
        if isinstance(opening, Reply):
            return opening
        self._work[request_id] = opening
        return None

    def _start_one_shot(self, request_id: str, work: Fetching) -> None:
        self._work[request_id] = self.opener.one_shot(work)

    def _put(self, request_id: str, outcome: Reply | _Work) -> Reply | None:
        """Keep a request's next stage as its work, or return its reply."""
        if isinstance(outcome, Reply):
            return outcome
        self._work[request_id] = outcome
        return None

    # -- answering -------------------------------------------------------------------------
    def _advance_answers(self) -> dict[str, Reply]:
        """Run one engine step over every open and answer; reply to those it finished."""
        running = [(r, w) for r, w in self._work.items() if not isinstance(w, (Fetching, Resuming))]
        if not running:
            return {}
        if self.stopping:  # the drain's grace is over: end what is left, rolled back
            stopped = stopped_replies(running)
            for request_id in stopped:
                self._discard(request_id)
            return stopped
        now = time.monotonic()
        for _, work in running:  # end overdue whole answers with the text they have
            if isinstance(work, Answering) and work.overdue(self.whole_answer_s, now):
                self.engine.cut_short(work.turn)
        errors = step_with_retry(self.engine, self.store, [w.turn for _, w in running])
        replies: dict[str, Reply] = {}
        for i, (request_id, work) in enumerate(running):
            reply: Reply | None
            try:
                if isinstance(work, Opening):
                    reply = self._advance_open(request_id, work, errors.get(i))
                elif i in errors:
                    reply = self._fail_answer(request_id, work, errors[i])
                elif work.turn.done:
                    reply = self._finish_answer(request_id, work)
                else:
                    reply = work.chunk()
            except Exception as exc:  # finishing this request failed: fail it alone
                error = internal_error(exc)
                reply = work.failed(error) if isinstance(work, Answering) else error_reply(error)
                self._discard(request_id)  # rolled back and freed: its session goes on
            if reply is not None:
                replies[request_id] = reply
        return replies

    def _advance_open(
        self, request_id: str, work: Opening[StateT, TurnT], error: BaseException | None
    ) -> Reply | None:
        """Store an open whose turn is done (answering a chat's first question), or drop it."""
        if error is None and not work.turn.done:
            return None
        del self._work[request_id]
        if error is not None:
            self.opener.abort(work)
            return error_reply(as_kit_error(error))
        session = self.opener.finish(work)
        if isinstance(session, Reply):
            return session
        self.keeper.keep(session)
        if isinstance(work.request, ChatCompletion):
            headers = self.opener.headers(session)
            return self._put(
                request_id, self.chats.answer_opened(session, work.request, work.replies, headers)
            )
        return self.opener.opened_reply(session)

    def _finish_answer(self, request_id: str, work: Answering) -> Reply:
        try:
            self.engine.finish_turn(work.turn)
        except Exception as exc:  # not committed (a copy out of the stacked batch failed):
            return self._fail_answer(request_id, work, exc)  # rolled back to its last turn
        del self._work[request_id]
        more = {**self.usage_extra, **resumed_usage(work.session)}
        try:
            if not work.transient:
                self.chats.note_answer(work)
                self.keeper.keep(work.session)
            elif self.chats.adopt(work):
                return work.finished(**more)
        finally:
            self._end_turn(work)
        if self.keeper.enabled and not work.transient:
            more["snapshot_bytes"] = self.keeper.size_of(work.session.id)
        return work.finished(**more)

    def _end_turn(self, work: Answering) -> None:
        if work.transient:
            if work.adopt is not None:  # a header-less chat's state, not kept after all
                self.store.cancel(work.adopt)
            if not work.kept:
                self.engine.release(work.session.state)
        else:
            self.store.end_turn(work.session, self._nbytes(work.session))

    def _fail_answer(self, request_id: str, work: Answering, exc: BaseException) -> Reply:
        self._drop_answer(request_id, work)
        return work.failed(as_kit_error(exc))

    def _drop_answer(self, request_id: str, work: Answering) -> None:
        del self._work[request_id]
        try:
            self.engine.abort_turn(work.turn)
        except Exception as exc:  # the cache may be inconsistent: the session cannot go on
            internal_error(exc)
            if not work.transient:
                self.store.end(work.session, LOST)
        finally:
            self._end_turn(work)

    def _abandon(self, request_id: str) -> None:
        """Roll back a request whose client went away."""
        log.info("request %s left the batch (client gone); dropping its work", request_id)
        self._discard(request_id)

    def _discard(self, request_id: str) -> None:
        """Roll a request's work back and free what it holds (its session stays usable)."""
        work = self._work.get(request_id)
        try:
            if isinstance(work, Answering):
                self._drop_answer(request_id, work)
            elif isinstance(work, Opening):
                del self._work[request_id]
                self.opener.abort(work)
            elif isinstance(work, Resuming):
                del self._work[request_id]
                work.data.cancel()
            elif isinstance(work, Fetching):
                del self._work[request_id]
                work.image.cancel()
                if work.slot is not None:
                    self.store.cancel(work.slot)
                if work.session is not None:
                    self.store.end_turn(work.session)
        except Exception as exc:
            internal_error(exc)

    @staticmethod
    def _nbytes(session: Session) -> int:
        state = session.state
        return int(getattr(state, "nbytes", 0)) if state is not None else 0
