"""The session store: ids, TTL, reaping, the session cap and the byte budget, with a fake clock."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from llava.core.errors import (
    CapacityExceeded,
    SessionBusy,
    SessionClosed,
    SessionExpired,
    SessionNotFound,
)
from llava.core.ids import SESSION_ID_RE, is_valid_session_id, new_session_id
from llava.sessions.session import Session
from llava.sessions.store import SessionStore

TTL = 60.0
WALL0 = 1_700_000_000.0


class FakeClock:
    """A monotonic clock that moves only when told to."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def wall(self) -> float:
        return WALL0 + self.now


class Releases:
    """Record every release(session, reason) the store makes."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, Any]] = []

    def __call__(self, session: Session, reason: str) -> None:
        self.calls.append((session.id, reason, session.state))

    def reasons(self) -> dict[str, str]:
        return {sid: reason for sid, reason, _ in self.calls}


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def releases() -> Releases:
    return Releases()


def make_store(clock: FakeClock, releases: Any, **kwargs: Any) -> SessionStore:
    options: dict[str, Any] = {"ttl_s": TTL, "max_sessions": 8}
    options.update(kwargs)
    return SessionStore(release=releases, clock=clock, wall_clock=clock.wall, **options)


@pytest.fixture
def store(clock: FakeClock, releases: Releases) -> SessionStore:
    return make_store(clock, releases)


def open_one(store: SessionStore, nbytes: int = 10, state: Any = None) -> Session:
    slot = store.reserve()
    return store.add(slot, state if state is not None else object(), nbytes)


# -- ids -----------------------------------------------------------------------------------


def test_session_ids_are_40_hex_chars_valid_for_sagemaker_and_unique() -> None:
    ids = [new_session_id() for _ in range(1000)]
    assert len(set(ids)) == 1000
    for sid in ids:
        assert len(sid) == 40
        assert set(sid) <= set("0123456789abcdef")
        assert SESSION_ID_RE.match(sid)
        assert is_valid_session_id(sid)


def test_reserved_slot_ids_are_unique_session_ids(clock: FakeClock, releases: Releases) -> None:
    store = make_store(clock, releases, max_sessions=1000)
    slots = [store.reserve() for _ in range(1000)]
    assert len({slot.id for slot in slots}) == 1000
    assert all(is_valid_session_id(slot.id) for slot in slots)


# -- open, use, close ----------------------------------------------------------------------


def test_reserve_then_add_opens_a_session(store: SessionStore) -> None:
    slot = store.reserve()
    assert store.stats() == {"sessions": 0, "opening": 1, "bytes": 0}
    state = object()
    session = store.add(slot, state, 123, model="tiny")
    assert session.id == slot.id
    assert session.state is state
    assert session.info == {"model": "tiny"}
    assert store.stats() == {"sessions": 1, "opening": 0, "bytes": 123}
    assert slot.id in store
    assert len(store) == 1


def test_past_max_opening_a_new_open_is_refused_until_one_finishes(
    clock: FakeClock, releases: Releases
) -> None:
    store = make_store(clock, releases, max_opening=2, max_sessions=10)
    first, second = store.reserve(), store.reserve()
    with pytest.raises(CapacityExceeded, match="opening already") as refused:
        store.reserve()
    assert refused.value.retry_after_s == 1
    store.add(first, object(), 1)  # one opened: room for one more opening
    third = store.reserve()
    store.cancel(second)
    store.cancel(third)
    assert store.stats() == {"sessions": 1, "opening": 0, "bytes": 1}


def test_get_returns_the_session(store: SessionStore) -> None:
    session = open_one(store)
    assert store.get(session.id) is session


def test_add_of_an_unreserved_slot_is_refused(store: SessionStore) -> None:
    slot = store.reserve()
    store.cancel(slot)
    with pytest.raises(SessionNotFound):
        store.add(slot, object(), 1)
    assert store.stats() == {"sessions": 0, "opening": 0, "bytes": 0}


def test_cancel_frees_the_slot(clock: FakeClock, releases: Releases) -> None:
    store = make_store(clock, releases, max_sessions=1)
    slot = store.reserve()
    with pytest.raises(CapacityExceeded):
        store.reserve()
    store.cancel(slot)
    assert store.stats()["opening"] == 0
    store.reserve()


def test_close_releases_and_later_get_says_closed(store: SessionStore, releases: Releases) -> None:
    state = object()
    session = open_one(store, state=state)
    assert store.close(session.id) is session
    assert releases.calls == [(session.id, "closed", state)]
    assert session.id not in store
    assert store.stats() == {"sessions": 0, "opening": 0, "bytes": 0}
    with pytest.raises(SessionClosed) as info:
        store.get(session.id)
    assert info.value.status == 400
    assert info.value.code == "session_closed"


def test_close_twice_says_closed(store: SessionStore, releases: Releases) -> None:
    session = open_one(store)
    store.close(session.id)
    with pytest.raises(SessionClosed):
        store.close(session.id)
    assert len(releases.calls) == 1


def test_get_of_unknown_id_is_not_found(store: SessionStore) -> None:
    with pytest.raises(SessionNotFound) as info:
        store.get("nope")
    assert info.value.code == "session_not_found"
    assert "nope" in info.value.message


def test_constructor_rejects_non_positive_limits() -> None:
    with pytest.raises(ValueError):
        SessionStore(ttl_s=0)
    with pytest.raises(ValueError):
        SessionStore(max_sessions=0)


# -- TTL -----------------------------------------------------------------------------------


def test_get_after_ttl_says_expired_and_releases(
    store: SessionStore, clock: FakeClock, releases: Releases
) -> None:
    session = open_one(store)
    clock.advance(TTL + 0.001)
    with pytest.raises(SessionExpired) as info:
        store.get(session.id)
    assert info.value.code == "session_expired"
    assert releases.reasons() == {session.id: "expired"}
    assert session.id not in store
    with pytest.raises(SessionExpired):  # and it stays expired
        store.get(session.id)


def test_session_idle_exactly_ttl_is_still_open(store: SessionStore, clock: FakeClock) -> None:
    session = open_one(store)
    clock.advance(TTL)
    assert store.get(session.id) is session


def test_get_refreshes_the_ttl(store: SessionStore, clock: FakeClock) -> None:
    session = open_one(store)
    for _ in range(5):
        clock.advance(TTL * 0.8)
        assert store.get(session.id) is session
    assert store.expires_at(session) == pytest.approx(clock.wall() + TTL)


def test_expires_at_counts_down_while_idle(store: SessionStore, clock: FakeClock) -> None:
    session = open_one(store)
    assert store.expires_at(session) == pytest.approx(clock.wall() + TTL)
    clock.advance(10)
    assert store.expires_at(session) == pytest.approx(clock.wall() + TTL - 10)
    clock.advance(TTL)
    assert store.expires_at(session) == pytest.approx(clock.wall())


def test_reap_frees_only_idle_sessions_past_ttl(
    store: SessionStore, clock: FakeClock, releases: Releases
) -> None:
    old, fresh = open_one(store, nbytes=5), open_one(store, nbytes=7)
    clock.advance(TTL / 2)
    store.get(fresh.id)
    clock.advance(TTL / 2 + 1)
    assert store.reap() == [old.id]
    assert releases.reasons() == {old.id: "expired"}
    assert old.state is None and old.nbytes == 0
    assert store.stats() == {"sessions": 1, "opening": 0, "bytes": 7}
    assert store.reap() == []


def test_busy_session_is_never_reaped(
    store: SessionStore, clock: FakeClock, releases: Releases
) -> None:
    session = open_one(store)
    store.begin_turn(session.id)
    clock.advance(TTL * 10)
    assert store.reap() == []
    assert store.get(session.id) is session  # busy: get does not expire it either
    assert releases.calls == []
    store.end_turn(session)
    clock.advance(TTL / 2)
    assert store.reap() == []  # end_turn counts as use
    clock.advance(TTL)
    assert store.reap() == [session.id]


def test_reserve_reaps_expired_sessions_to_make_room(clock: FakeClock, releases: Releases) -> None:
    store = make_store(clock, releases, max_sessions=2)
    first, second = open_one(store), open_one(store)
    clock.advance(TTL + 1)
    store.reserve()
    assert releases.reasons() == {first.id: "expired", second.id: "expired"}


def test_reaper_thread_frees_idle_sessions_without_requests() -> None:
    released = threading.Event()
    reasons: list[str] = []

    def release(session: Session, reason: str) -> None:
        reasons.append(reason)
        released.set()

    store = SessionStore(ttl_s=0.2, max_sessions=4, release=release)
    session = store.add(store.reserve(), object(), 1000)
    store.start_reaper(interval_s=0.02)
    try:
        assert released.wait(3.0), "the reaper never released the idle session"
        assert reasons == ["expired"]
        assert session.id not in store
        assert store.stats() == {"sessions": 0, "opening": 0, "bytes": 0}
    finally:
        store.stop_reaper()


def test_stop_reaper_stops_the_thread() -> None:
    calls: list[str] = []
    store = SessionStore(ttl_s=0.1, max_sessions=4, release=lambda s, r: calls.append(r))
    store.start_reaper(interval_s=0.01)
    thread = store._reaper
    assert thread is not None and thread.is_alive()
    store.stop_reaper()
    assert not thread.is_alive()  # joined: nothing can reap any more
    assert store._reaper is None
    assert calls == []


def test_reaper_survives_a_failing_release() -> None:
    calls: list[str] = []
    first, done = threading.Event(), threading.Event()

    def release(session: Session, reason: str) -> None:
        calls.append(session.id)
        (done if len(calls) >= 2 else first).set()
        raise RuntimeError("release failed")

    store = SessionStore(ttl_s=0.1, max_sessions=4, release=release)
    store.add(store.reserve(), object(), 1)
    store.start_reaper(interval_s=0.02)
    try:
        assert first.wait(3.0), "the reaper never reaped the first session"
        store.add(store.reserve(), object(), 1)
        assert done.wait(3.0), "the reaper stopped after a failing release"
        assert len(store) == 0
    finally:
        store.stop_reaper()


# -- capacity ------------------------------------------------------------------------------


def test_max_sessions_counts_open_sessions_and_reserved_slots(
    clock: FakeClock, releases: Releases
) -> None:
    store = make_store(clock, releases, max_sessions=3)
    open_one(store)
    store.reserve()
    store.reserve()
    with pytest.raises(CapacityExceeded) as info:
        store.reserve()
    error = info.value
    assert error.status == 429
    assert error.code == "capacity_exceeded"
    assert error.retry_after_s == 30
    assert error.to_body()["error"]["retry_after_s"] == 30
    assert store.stats() == {"sessions": 1, "opening": 2, "bytes": 10}


@pytest.mark.parametrize(("ttl", "retry"), [(5.0, 5), (0.5, 1), (3600.0, 30)])
def test_retry_after_is_between_1_and_30_seconds(
    clock: FakeClock, releases: Releases, ttl: float, retry: int
) -> None:
    store = make_store(clock, releases, max_sessions=1, ttl_s=ttl)
    store.reserve()
    with pytest.raises(CapacityExceeded) as info:
        store.reserve()
    assert info.value.retry_after_s == retry


def test_closing_a_session_makes_room(clock: FakeClock, releases: Releases) -> None:
    store = make_store(clock, releases, max_sessions=1)
    session = open_one(store)
    with pytest.raises(CapacityExceeded):
        store.reserve()
    store.close(session.id)
    store.reserve()


# -- byte budget ---------------------------------------------------------------------------


def test_budget_evicts_least_recently_used_idle_session(
    clock: FakeClock, releases: Releases
) -> None:
    store = make_store(clock, releases, budget_bytes=250)
    a, b = open_one(store, 100), open_one(store, 100)
    clock.advance(1)
    store.get(a.id)  # a is now more recent than b
    c = open_one(store, 100)
    assert releases.reasons() == {b.id: "evicted"}
    assert a.id in store and c.id in store and b.id not in store
    assert store.stats()["bytes"] == 200
    with pytest.raises(SessionExpired) as info:
        store.get(b.id)
    assert "evicted" in info.value.message


def test_budget_evicts_as_many_as_needed_oldest_first(clock: FakeClock, releases: Releases) -> None:
    store = make_store(clock, releases, budget_bytes=300)
    a, b, c = open_one(store, 100), open_one(store, 100), open_one(store, 100)
    big = open_one(store, 250)
    assert [sid for sid, _, _ in releases.calls] == [a.id, b.id, c.id]
    assert big.id in store


def test_budget_never_evicts_the_session_just_added(clock: FakeClock, releases: Releases) -> None:
    store = make_store(clock, releases, budget_bytes=50)
    a = open_one(store, 100)
    assert a.id in store
    assert releases.calls == []
    b = open_one(store, 100)
    assert releases.reasons() == {a.id: "evicted"}
    assert b.id in store


def test_budget_never_evicts_busy_sessions(clock: FakeClock, releases: Releases) -> None:
    store = make_store(clock, releases, budget_bytes=150)
    a = open_one(store, 100)
    store.begin_turn(a.id)
    b = open_one(store, 100)
    assert releases.calls == []  # a is busy, b is the one just added: over budget for now
    assert store.stats()["bytes"] == 200
    store.end_turn(a)  # a is kept as the one just used; b goes
    assert releases.reasons() == {b.id: "evicted"}
    assert a.id in store


def test_end_turn_updates_bytes_and_enforces_the_budget(
    clock: FakeClock, releases: Releases
) -> None:
    store = make_store(clock, releases, budget_bytes=300)
    a, b = open_one(store, 100), open_one(store, 100)
    session = store.begin_turn(b.id)
    store.end_turn(session, nbytes=250)
    assert b.nbytes == 250
    assert releases.reasons() == {a.id: "evicted"}
    assert store.stats() == {"sessions": 1, "opening": 0, "bytes": 250}


# -- turns ---------------------------------------------------------------------------------


def test_second_begin_turn_is_busy_409(store: SessionStore) -> None:
    session = open_one(store)
    assert store.begin_turn(session.id).busy
    with pytest.raises(SessionBusy) as info:
        store.begin_turn(session.id)
    assert info.value.status == 409
    assert info.value.code == "session_busy"
    store.end_turn(session)
    assert not session.busy
    store.begin_turn(session.id)


def test_turn_context_manager_ends_the_turn_even_on_error(store: SessionStore) -> None:
    session = open_one(store)
    with pytest.raises(RuntimeError), store.turn(session.id) as held:
        assert held.busy
        raise RuntimeError("boom")
    assert not session.busy


def test_close_while_busy_defers_release_until_end_turn(
    store: SessionStore, releases: Releases
) -> None:
    session = open_one(store, nbytes=40)
    store.begin_turn(session.id)
    store.close(session.id)
    assert releases.calls == []
    assert session.id in store  # memory still held by the running answer
    with pytest.raises(SessionClosed):
        store.get(session.id)
    with pytest.raises(SessionClosed):
        store.begin_turn(session.id)
    store.end_turn(session, nbytes=50)
    assert releases.reasons() == {session.id: "closed"}
    assert session.id not in store
    assert store.stats() == {"sessions": 0, "opening": 0, "bytes": 0}


def test_release_raising_does_not_leak_the_session(clock: FakeClock) -> None:
    def release(session: Session, reason: str) -> None:
        raise RuntimeError("engine could not free it")

    store = make_store(clock, release, max_sessions=1)
    session = open_one(store, nbytes=10)
    store.close(session.id)  # does not raise
    assert session.id not in store
    assert store.stats() == {"sessions": 0, "opening": 0, "bytes": 0}
    other = open_one(store)
    clock.advance(TTL + 1)
    assert store.reap() == [other.id]
    assert len(store) == 0


def test_stats_counts_sessions_slots_and_bytes(store: SessionStore) -> None:
    assert store.stats() == {"sessions": 0, "opening": 0, "bytes": 0}
    open_one(store, 3)
    open_one(store, 4)
    store.reserve()
    assert store.stats() == {"sessions": 2, "opening": 1, "bytes": 7}
