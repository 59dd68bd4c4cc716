"""Session snapshots: the directory (atomic, private, bounded, checked) and the engine's bytes.

A session restored from its snapshot into a freshly loaded engine answers its next question
exactly as the model's own pipeline answers the whole conversation.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import Reference, make_image
from safetensors.numpy import save as save_arrays

from llava.core.config import ServerConfig
from llava.core.ids import new_session_id
from llava.core.params import GenerationParams
from llava.engines.transformers import LlavaEngine, Tier
from llava.sessions.snapshots import PARTS, SUFFIX, CorruptSnapshot, SnapshotDir, recover
from llava.sessions.store import SessionStore

GREEDY = GenerationParams(max_new_tokens=8)
PROMPTS = ["What is this?", "Which colors do you see?", "Is it big?"]


@pytest.fixture()
def snaps(tmp_path: Path) -> SnapshotDir:
    directory = SnapshotDir(tmp_path / "snaps", budget_bytes=1 << 20)
    yield directory
    directory.close()


def written(snaps: SnapshotDir, sid: str, payload: bytes) -> Path:
    snaps.save(sid, lambda: payload)
    snaps.flush()
    return snaps.path / (sid + SUFFIX)


# -- the directory ---------------------------------------------------------------------------


def test_a_snapshot_is_written_privately_and_read_back(snaps: SnapshotDir) -> None:
    sid = new_session_id()
    path = written(snaps, sid, b"payload")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(snaps.path.stat().st_mode) == 0o700
    assert snaps.read(sid) == b"payload"
    assert snaps.size_of(sid) == path.stat().st_size
    assert snaps.stats() == {"snapshots": 1, "bytes": path.stat().st_size}
    assert entries(snaps.path) == [path.name]  # no temporary file left


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty"])
def test_a_torn_or_altered_snapshot_is_refused(snaps: SnapshotDir, damage: str) -> None:
    sid = new_session_id()
    path = written(snaps, sid, b"x" * 100)
    data = path.read_bytes()
    damaged = {
        "flip": data[:50] + bytes([data[50] ^ 1]) + data[51:],
        "truncate": data[:-10],
        "empty": b"",
    }[damage]
    path.write_bytes(damaged)
    with pytest.raises(CorruptSnapshot):
        snaps.read(sid)


def test_removal_follows_the_saves_queued_before_it(snaps: SnapshotDir) -> None:
    sid = new_session_id()
    snaps.save(sid, lambda: b"one")
    snaps.remove(sid)
    snaps.flush()
    assert not (snaps.path / (sid + SUFFIX)).exists()
    assert snaps.stats() == {"snapshots": 0, "bytes": 0}


def test_a_disk_behind_holds_one_waiting_snapshot_per_session(snaps: SnapshotDir) -> None:
    """While the writer is held up, 50 turns of one session and a save then removal of another
    leave one write waiting for the first (the latest) and none for the second."""
    import threading

    held, writing = threading.Event(), threading.Event()
    blocker, busy, gone = new_session_id(), new_session_id(), new_session_id()
    produced: list[bytes] = []

    def blocked() -> bytes:
        writing.set()
        held.wait(30)
        return b"blocker"

    snaps.save(blocker, blocked)
    assert writing.wait(30)
    for turn in range(50):
        snaps.save(busy, lambda turn=turn: produced.append(b"%d" % turn) or b"%d" % turn)
    snaps.save(gone, lambda: produced.append(b"gone") or b"gone")
    snaps.remove(gone)
    held.set()
    snaps.flush()
    assert produced == [b"49"] and snaps.read(busy) == b"49"
    assert not (snaps.path / (gone + SUFFIX)).exists()


def test_past_the_disk_budget_the_oldest_snapshots_go(tmp_path: Path) -> None:
    snaps = SnapshotDir(tmp_path / "s", budget_bytes=10**9)
    try:
        ids = [new_session_id() for _ in range(5)]
        written(snaps, ids[0], b"y" * 100)
        snaps.budget_bytes = 3 * snaps.size_of(ids[0])  # room for three
        for sid in ids:
            written(snaps, sid, b"y" * 100)
        written(snaps, ids[0], b"y" * 100)  # written again: now the newest
        kept = sorted(p.removesuffix(SUFFIX) for p in entries(snaps.path))
        assert kept == sorted([ids[0], ids[3], ids[4]])
        assert snaps.stats()["bytes"] <= snaps.budget_bytes
    finally:
        snaps.close()


def test_a_failing_producer_costs_only_its_own_snapshot(snaps: SnapshotDir) -> None:
    bad, good = new_session_id(), new_session_id()

    def fail() -> bytes:
        raise RuntimeError("boom")

    snaps.save(bad, fail)
    assert written(snaps, good, b"ok") and snaps.read(good) == b"ok"
    assert not (snaps.path / (bad + SUFFIX)).exists()


def test_a_restart_lists_snapshots_and_clears_half_written_files(tmp_path: Path) -> None:
    first = SnapshotDir(tmp_path / "s", budget_bytes=1 << 20)
    sid = new_session_id()
    written(first, sid, b"z")
    first.close()
    (first.path / f".{new_session_id()}.tmp").write_bytes(b"half")
    (first.path / "not a session id!.snap").write_bytes(b"?")
    second = SnapshotDir(tmp_path / "s", budget_bytes=1 << 20)
    try:
        assert second.found() == [sid]
        assert entries(second.path) == [sid + SUFFIX]
    finally:
        second.close()


# -- the engine's snapshot, restored into a fresh engine ------------------------------------


@pytest.fixture(scope="module")
def reference(either_checkpoint: Any) -> Reference:
    return Reference(either_checkpoint)


def load(checkpoint: Any) -> LlavaEngine:
    return LlavaEngine.load(checkpoint, ServerConfig(device="cpu", step_token_budget=64))


def ask(engine: LlavaEngine, state: Any, prompt: str) -> str:
    return engine.run_to_end(engine.start_turn(state, prompt, GREEDY)).text


def test_a_restored_session_answers_as_the_models_own_pipeline(either_checkpoint, reference):
    image = make_image(7, (64, 48))
    before = load(either_checkpoint)
    state = before.open_session(image, "Be brief.")
    ask(before, state, PROMPTS[0])
    ask(before, state, PROMPTS[1])
    produce = before.snapshot(state, {"expires_at": 123.0, "info": {"k": "v"}})
    assert produce is not None
    data = produce()

    after = load(either_checkpoint)  # a new worker: nothing shared but the checkpoint
    restored, extra = after.resume(data)
    assert extra == {"expires_at": 123.0, "info": {"k": "v"}}
    assert restored.tier is Tier.FEATURES and restored.cache is None
    assert [e.prompt for e in restored.history] == PROMPTS[:2]
    expected = reference.answers(image, PROMPTS, 8, "Be brief.")
    assert [e.answer for e in restored.history] == expected[:2]
    assert ask(after, restored, PROMPTS[2]) == expected[2]


def test_a_snapshot_of_another_model_or_not_a_snapshot_is_refused(tiny_checkpoint) -> None:
    engine = load(tiny_checkpoint)
    state = engine.open_session(make_image(8))
    produce = engine.snapshot(state, {})
    assert produce is not None
    data = produce()
    engine.fingerprint = "another-model"
    with pytest.raises(ValueError, match="different model"):
        engine.resume(data)
    with pytest.raises(ValueError, match="not a session snapshot"):
        engine.resume(b"\x00" * 64)


# -- recovery at start-up -------------------------------------------------------------------


class Engine:
    """Resumes b"ok:<expiry>" payloads; anything else is not a snapshot."""

    def __init__(self) -> None:
        self.released = 0
        self.adopted = 0

    def resume(self, data: bytes) -> tuple[Any, dict[str, Any]]:
        kind, _, expiry = data.decode().partition(":")
        if kind in UNEXPECTED:  # what a damaged file can raise besides ValueError
            raise UNEXPECTED[kind]
        if kind != "ok":
            raise ValueError("not a session snapshot")
        return _State(), {"expires_at": float(expiry), "info": {"image": "key"}}

    def adopt(self, state: Any) -> None:
        self.adopted += 1

    def release(self, state: Any) -> None:
        self.released += 1


class _State:
    nbytes = 10


UNEXPECTED: dict[str, BaseException] = {
    "key": KeyError("features"),
    "runtime": RuntimeError("shape '[576, 4096]' is invalid for input of size 12"),
    "index": IndexError("list index out of range"),
    "unicode": UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"),
}


def test_a_snapshot_that_raises_what_nobody_expects_costs_its_own_session_only(
    snaps: SnapshotDir,
) -> None:
    """A worker restarted into a directory holding damaged snapshots must start (it restarted
    into the same files for ever), restoring every other session."""
    now = 1_700_000_000.0
    store = SessionStore(ttl_s=600, wall_clock=lambda: now)
    good = new_session_id()
    written(snaps, good, f"ok:{now + 300}".encode())
    damaged = {kind: new_session_id() for kind in UNEXPECTED}
    for kind, sid in damaged.items():
        written(snaps, sid, f"{kind}:{now + 300}".encode())
    left_open = [good, *damaged.values()]
    counts = recover(snaps, Engine(), store, left_open, clock=lambda: now)  # type: ignore[arg-type]
    assert counts == {"restored": 1, "expired": 0, "corrupt": len(UNEXPECTED), "lost": 0}
    assert [s.id for s in store.snapshot()] == [good]
    for sid in damaged.values():
        with pytest.raises(Exception) as caught:
            store.get(sid)
        assert caught.value.code == "session_lost"


def test_recovery_restores_what_was_left_open_and_nothing_else(snaps: SnapshotDir) -> None:
    now = 1_700_000_000.0
    store = SessionStore(ttl_s=600, wall_clock=lambda: now)
    kept, corrupt, expired, ended, missing = (new_session_id() for _ in range(5))
    written(snaps, kept, f"ok:{now + 300}".encode())
    written(snaps, corrupt, b"garbage")
    written(snaps, expired, f"ok:{now - 1}".encode())
    written(snaps, ended, f"ok:{now + 300}".encode())  # closed before the crash
    engine = Engine()

    counts = recover(snaps, engine, store, [kept, corrupt, expired, missing], clock=lambda: now)  # type: ignore[arg-type]

    assert counts == {"restored": 1, "expired": 1, "corrupt": 1, "lost": 1}
    [session] = store.snapshot()
    assert session.id == kept and session.info == {"image": "key"}
    assert store.expires_at(session) == pytest.approx(now + 300)  # the idle time it had left
    for sid, code in ((corrupt, "session_lost"), (missing, "session_lost")):
        with pytest.raises(Exception) as caught:
            store.get(sid)
        assert caught.value.code == code
    with pytest.raises(Exception) as caught:
        store.get(expired)
    assert caught.value.code == "session_expired"
    assert engine.released == 1
    assert entries(snaps.path) == [kept + SUFFIX]


def test_a_restored_session_expires_when_its_idle_time_runs_out(snaps: SnapshotDir) -> None:
    now = [1_700_000_000.0]
    store = SessionStore(ttl_s=600, wall_clock=lambda: now[0], clock=lambda: now[0])
    sid = new_session_id()
    written(snaps, sid, f"ok:{now[0] + 120}".encode())
    recover(snaps, Engine(), store, [sid], clock=lambda: now[0])  # type: ignore[arg-type]
    now[0] += 119
    assert store.reap() == []
    now[0] += 2
    assert store.reap() == [sid]


def test_the_snapshot_directory_is_private_even_if_it_existed(tmp_path: Path) -> None:
    (tmp_path / "open").mkdir(mode=0o777)
    os.chmod(tmp_path / "open", 0o777)
    SnapshotDir(tmp_path / "open", budget_bytes=100).close()
    assert stat.S_IMODE((tmp_path / "open").stat().st_mode) == 0o700


def with_meta(data: bytes, change: Any) -> bytes:
    """A real snapshot with its metadata edited (a valid file holding a wrong snapshot)."""
    header_len = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + header_len])
    meta = json.loads(header["__metadata__"]["llava"])
    change(meta)
    header["__metadata__"]["llava"] = json.dumps(meta)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw + data[8 + header_len :]


def test_real_snapshots_damaged_in_each_way_cost_only_their_own_sessions(
    tiny_checkpoint, snaps: SnapshotDir
) -> None:
    engine = load(tiny_checkpoint)
    state = engine.open_session(make_image(9))
    ask(engine, state, PROMPTS[0])
    now = 1_700_000_000.0
    produce = engine.snapshot(state, {"expires_at": now + 300, "info": {}})
    assert produce is not None
    data = produce()
    damaged = {
        "bad header": b"\xff" * 8 + data[8:],
        "torn tensor": data[: len(data) - 100],
        "wrong shapes": with_meta(data, lambda m: m.update(tokens=[m["tokens"][0] + 3])),
        "missing field": with_meta(data, lambda m: m.pop("history")),
        "wrong type": with_meta(data, lambda m: m.update(history=[[1]])),
    }
    good = new_session_id()
    written(snaps, good, data)
    ids = {name: new_session_id() for name in damaged}
    for name, payload in damaged.items():
        written(snaps, ids[name], payload)
    store = SessionStore(ttl_s=600, wall_clock=lambda: now)
    counts = recover(snaps, engine, store, [good, *ids.values()], clock=lambda: now)
    assert counts == {"restored": 1, "expired": 0, "corrupt": len(damaged), "lost": 0}
    restored = store.get(good)
    assert ask(engine, restored.state, PROMPTS[1])  # the good one answers


def entries(path: Path) -> list[str]:
    """The snapshot directory's files, beside its folder of parts."""
    return sorted(p.name for p in path.iterdir() if p.name != PARTS)


def with_picture(seed: int, turns: int) -> bytes:
    """A snapshot as an engine writes one: a big picture array, then the conversation's ids."""
    rng = np.random.default_rng(seed)
    arrays = {
        "image.0": rng.integers(0, 255, 100_000, dtype=np.uint8),
        "ids": np.arange(10 * turns, dtype=np.int32),
    }
    return bytes(save_arrays(arrays))


def test_a_picture_is_written_once_shared_and_goes_with_its_last_session(tmp_path: Path) -> None:
    snaps = SnapshotDir(tmp_path / "snaps", 10**9)
    a, b = new_session_id(), new_session_id()
    for turn in range(1, 4):  # three turns of a: one picture file, a small snapshot file
        snaps.save(a, lambda turn=turn: with_picture(1, turn))
        snaps.flush()
    [part] = (snaps.path / PARTS).iterdir()
    assert part.stat().st_size == 100_000 and (snaps.path / (a + SUFFIX)).stat().st_size < 2_000
    assert snaps.read(a) == with_picture(1, 3)
    snaps.save(b, lambda: with_picture(1, 1))  # the same picture in another session
    snaps.flush()
    assert list((snaps.path / PARTS).iterdir()) == [part]
    snaps.remove(a)
    snaps.flush()
    assert part.exists() and snaps.read(b) == with_picture(1, 1)  # b still uses it
    (snaps.path / PARTS / ("0" * 64)).write_bytes(b"a part no snapshot uses")
    snaps.close()
    again = SnapshotDir(snaps.path, 10**9)  # a restarted worker: orphans go, used parts stay
    assert again.found() == [b] and [p.name for p in (snaps.path / PARTS).iterdir()] == [part.name]
    assert again.read(b) == with_picture(1, 1)
    again.remove(b)
    again.flush()
    assert list((snaps.path / PARTS).iterdir()) == []
    again.close()
