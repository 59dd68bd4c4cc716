"""The session registry: what a worker records, what its successor recovers as lost."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from llava.core.errors import SessionClosed, SessionLost, SessionNotFound
from llava.core.ids import new_session_id
from llava.fronts.assembly import open_registry
from llava.sessions.registry import (
    ENV_DIR,
    LOST_RETENTION_S,
    SessionRegistry,
    registry_path,
)
from llava.sessions.session import CLOSED, EXPIRED, LOST
from llava.sessions.store import SessionStore

NOW = 1_700_000_000.0


class Wall:
    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def wall() -> Wall:
    return Wall()


def registry(path: Path, wall: Wall, **kwargs) -> SessionRegistry:
    return SessionRegistry(path, clock=wall, lock_wait_s=0.1, **kwargs)


def ids(n: int) -> list[str]:
    return [new_session_id() for _ in range(n)]


def test_path_is_per_model_under_tmpdir_or_the_env_dir(tmp_path, monkeypatch) -> None:
    (tmp_path / "t").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "t"))
    monkeypatch.delenv(ENV_DIR, raising=False)
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    assert registry_path("llava") == tmp_path / "t" / "llava-sessions-llava.registry"
    monkeypatch.setenv(ENV_DIR, str(tmp_path / "r"))
    assert registry_path("../evil name") == tmp_path / "r" / "llava-sessions-.._evil_name.registry"
    assert registry_path("m", tmp_path) == tmp_path / "llava-sessions-m.registry"


def test_a_successor_recovers_exactly_the_ids_never_ended(tmp_path, wall) -> None:
    path = tmp_path / "r"
    first = registry(path, wall)
    assert first.recover() == []
    a, b, c = ids(3)
    for sid in (a, b, c):
        first.opened(sid, NOW + 60)
    first.opened(a, NOW + 90)  # used again: the expiry moves
    first.ended(b)
    first.close()  # the process dies: the lock goes with it

    second = registry(path, wall)
    assert sorted(second.recover()) == sorted([a, c])
    assert second.stats() == {"live": 0, "lost": 2, "lines": 2}  # rewritten: just the lost ids
    d = ids(1)[0]
    second.opened(d, NOW + 60)
    second.close()

    third = registry(path, wall)  # a second crash: the first crash's ids are still lost
    assert sorted(third.recover()) == sorted([a, c, d])


def test_ids_long_past_their_expiry_are_forgotten(tmp_path, wall) -> None:
    path = tmp_path / "r"
    first = registry(path, wall)
    first.recover()
    old, recent = ids(2)
    first.opened(old, NOW - LOST_RETENTION_S - 10)
    first.opened(recent, NOW - 10)  # expired, but recently: still reported as lost
    first.close()
    assert registry(path, wall).recover() == [recent]


def test_torn_and_garbage_lines_are_skipped(tmp_path, wall) -> None:
    path = tmp_path / "r"
    good = new_session_id()
    path.write_text(
        f"o {good} {NOW + 5:.0f}\n"
        "o bad_id 123\n"
        "x whatever\n"
        f"o {new_session_id()} notanumber\n"
        f"e\n"
        f"o {new_session_id()[:7]}"  # torn: the worker died mid-line (no expiry)
    )
    assert registry(path, wall).recover() == [good]


def test_the_file_is_compacted_when_dead_lines_pile_up(tmp_path, wall) -> None:
    path = tmp_path / "r"
    reg = registry(path, wall)
    reg.recover()
    keep = ids(3)
    for sid in keep:
        reg.opened(sid, NOW + 60)
    for sid in ids(2000):
        reg.opened(sid, NOW + 60)
        reg.opened(sid, NOW + 61)
        reg.ended(sid)
    assert len(path.read_text().splitlines()) <= 2 * 3 + 1024 + 1
    assert reg.stats()["live"] == 3
    reg.close()
    assert sorted(registry(path, wall).recover()) == sorted(keep)


def test_a_second_worker_of_the_same_model_runs_without_a_registry(tmp_path, wall) -> None:
    path = tmp_path / "r"
    owner = registry(path, wall)
    owner.recover()
    sid = new_session_id()
    owner.opened(sid, NOW + 60)
    intruder = registry(path, wall)
    assert not intruder.enabled and intruder.recover() == []
    intruder.opened(new_session_id(), NOW)  # quietly ignored
    owner.close()
    assert registry(path, wall).recover() == [sid]


def test_write_errors_never_raise(tmp_path, wall) -> None:
    reg = registry(tmp_path / "r", wall)
    reg.recover()
    reg.path = tmp_path / "missing-dir" / "r"  # every later write fails
    reg.opened(new_session_id(), NOW)
    assert not reg.enabled
    reg.opened(new_session_id(), NOW)
    reg.ended(new_session_id())


def test_an_unusable_directory_disables_the_registry(tmp_path, wall) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    reg = registry(blocker / "sub" / "r", wall)
    assert not reg.enabled and reg.recover() == []


# -- with the session store -----------------------------------------------------------------


def test_the_store_reports_opens_turns_and_ends(tmp_path, wall) -> None:
    path = tmp_path / "r"
    reg = registry(path, wall)
    reg.recover()
    store = SessionStore(ttl_s=60, max_sessions=8, journal=reg, wall_clock=wall)
    kept = store.add(store.reserve(), object(), 1)
    closed = store.add(store.reserve(), object(), 1)
    with store.turn(kept.id):
        pass
    store.close(closed.id)
    failed = store.reserve()
    store.cancel(failed)  # a failed open never reaches the registry
    assert reg.stats()["live"] == 1
    text = path.read_text()
    assert text.count(f"o {kept.id}") == 2 and f"e {closed.id}" in text and failed.id not in text
    reg.close()

    successor = registry(path, wall)
    store2 = SessionStore(ttl_s=60, max_sessions=8, journal=successor)
    assert store2.load_tombstones(successor.recover()) == 1
    with pytest.raises(SessionLost, match="lost"):
        store2.get(kept.id)
    with pytest.raises(SessionNotFound):
        store2.get(closed.id)
    assert store2.stats() == {"sessions": 0, "opening": 0, "bytes": 0}  # no slot taken


def test_load_tombstones_leaves_open_sessions_alone() -> None:
    store = SessionStore(ttl_s=60, max_sessions=8)
    session = store.add(store.reserve(), object(), 1)
    assert store.load_tombstones([session.id, "abc"], CLOSED) == 1
    assert store.get(session.id) is session
    with pytest.raises(SessionClosed):
        store.get("abc")
    store.load_tombstones(["def"], EXPIRED)
    with pytest.raises(ValueError, match="unknown reason"):
        store.load_tombstones(["x"], "vanished")
    assert LOST == "lost"


def test_a_failing_journal_never_fails_the_store() -> None:
    class Broken:
        def opened(self, sid: str, expires_at: float) -> None:
            raise OSError("disk full")

        def ended(self, sid: str) -> None:
            raise RuntimeError("boom")

    store = SessionStore(ttl_s=60, max_sessions=8, journal=Broken())
    session = store.add(store.reserve(), object(), 1)
    with store.turn(session.id):
        pass
    store.close(session.id)
    assert len(store) == 0


def test_concurrent_events_keep_the_file_parseable(tmp_path, wall) -> None:
    path = tmp_path / "r"
    reg = registry(path, wall)
    reg.recover()
    survivors: list[str] = []

    def work(n: int) -> None:
        for i, sid in enumerate(ids(300)):
            reg.opened(sid, NOW + 60)
            if i % 3:
                reg.ended(sid)
            else:
                survivors.append(sid)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    reg.close()
    assert sorted(registry(path, wall).recover()) == sorted(survivors)


# -- the handler's wiring -------------------------------------------------------------------


def test_open_registry_uses_the_model_name_and_the_env_dir(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(ENV_DIR, str(tmp_path))
    reg, lost = open_registry("llava")
    assert lost == [] and reg is not None and reg.path.parent == tmp_path
    sid = new_session_id()
    reg.opened(sid, 4_000_000_000)
    reg.close()
    reg2, lost = open_registry("llava")
    assert lost == [sid]
    reg2.close()


def test_open_registry_without_a_usable_dir_gives_no_registry(tmp_path, monkeypatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(ENV_DIR, str(blocker / "sub"))
    assert open_registry("llava") == (None, [])
