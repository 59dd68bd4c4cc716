"""Fenced writes to the shared session store, against a real S3 API server (moto's, which
applies S3's `If-Match` / `If-None-Match: *` on PutObject and `If-Match` on DeleteObject).

Two instances hold one conversation when a router gives up on one and comes back to it: the
interleavings below (answer on A, resume on B and answer twice, answer on A again; a close then
a stale write; an older object put back) must never lose a finished turn, bring a closed
conversation back, or answer from a stale copy; every answer is the model's own pipeline's over
the conversation as the store holds it.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import Reference, data_uri, make_image
from test_shared_store import (  # noqa: F401 (fixtures)
    BUCKET,
    PROMPTS,
    TOKENS,
    ask,
    call,
    instance,
    pair,
    raw,
    reference,
    s3_url,
    shared,
)

from llava.core.ids import new_session_id
from llava.sessions.fenced import ClosedInStore
from llava.sessions.shared import SharedStore
from llava.sessions.snapshots import CorruptSnapshot

QUESTIONS = [*PROMPTS, "What shape is it?"]
STALE = "A question from a stale copy"


def moved_on(s3: str, prefix: str) -> tuple[SharedStore, SharedStore, str]:
    """`here` wrote a session's first state; `there` resumed it and wrote its second."""
    here, there = shared(s3, prefix), shared(s3, prefix)
    sid = new_session_id()
    here.save(sid, lambda: b"one", 1)
    assert here.flush(10)
    assert there.fetch(sid).result(10) == b"one"
    there.save(sid, lambda: b"two", 2)
    assert there.flush(10)
    return here, there, sid


def opened(inst: Any, seed: int) -> tuple[str, Any]:
    picture = make_image(seed)
    status, body = call(inst, {"type": "open_session", "image": data_uri(picture)})
    assert status == 200, body
    return body["session_id"], picture


def answered(inst: Any, sid: str, prompt: str) -> dict[str, Any]:
    status, body = ask(inst, sid, prompt)
    assert status == 200, body
    inst.shared.flush(10)
    return dict(body)


def stored_object(s3: str, inst: Any, sid: str) -> bytes:
    key = inst.shared.object_key(sid)
    return bytes(raw(s3).get_object(Bucket=BUCKET, Key=key)["Body"].read())


def test_a_stale_holder_never_answers_and_resumes_the_newer_turns(
    pair: tuple[Any, Any],  # noqa: F811
    reference: Reference,  # noqa: F811
) -> None:
    """Answer on A; resume on B and answer twice; answer on A again: A's copy is a turn old,
    so it is dropped and B's state resumed; A's answer is the pipeline's over all four turns."""
    a, b = pair
    sid, picture = opened(a, 81)
    texts = [answered(a, sid, QUESTIONS[0])["text"]]
    texts += [answered(b, sid, q)["text"] for q in QUESTIONS[1:3]]
    last = answered(a, sid, QUESTIONS[3])
    assert [*texts, last["text"]] == reference.answers(picture, QUESTIONS, TOKENS)
    assert last["usage"]["session_tier"] == "store"  # resumed, not its own stale copy
    assert a.shared.stats()["fenced"] == 0  # nothing stale was ever written


def test_without_turn_checks_a_stale_write_is_refused_and_the_copy_dropped(
    tiny_checkpoint: Path,
    tmp_path: Path,
    s3_url: str,  # noqa: F811
    reference: Reference,  # noqa: F811
) -> None:
    """With `session_store_verify_turns` off, the stale copy answers once (what that setting
    trades), but its write is refused: the store keeps B's turns, A drops its copy, and A's
    next answer is the pipeline's over the store's conversation."""
    a = instance(tiny_checkpoint, tmp_path, s3_url, "a", session_store_verify_turns=False)
    b = instance(tiny_checkpoint, tmp_path, s3_url, "b", session_store_verify_turns=False)
    sid, picture = opened(a, 82)
    texts = [answered(a, sid, QUESTIONS[0])["text"]]
    texts += [answered(b, sid, q)["text"] for q in QUESTIONS[1:3]]
    kept = stored_object(s3_url, b, sid)
    stale = answered(a, sid, STALE)
    assert a.shared.stats()["fenced"] == 1
    assert stored_object(s3_url, b, sid) == kept  # B's turns are not overwritten
    last = answered(a, sid, QUESTIONS[3])
    assert last["usage"]["session_tier"] == "store"
    assert [*texts, last["text"]] == reference.answers(picture, QUESTIONS, TOKENS)
    assert stale["text"] == reference.answers(picture, [QUESTIONS[0], STALE], TOKENS)[1]
    for inst in (a, b):
        inst.service.close()
        inst.shared.close()


def test_a_close_wins_over_any_stale_write(pair: tuple[Any, Any], s3_url: str) -> None:  # noqa: F811
    """B resumes and closes; A, holding the older copy, keeps it and writes: refused. The
    store keeps the tombstone, and A answers the conversation closed."""
    a, b = pair
    sid, _ = opened(a, 83)
    answered(a, sid, QUESTIONS[0])
    answered(b, sid, QUESTIONS[1])
    status, body = call(b, {"type": "close_session"}, sid)
    assert status == 200 and body["closed"]
    assert b.shared.flush(10)
    a.service.keeper.keep(a.service.store.peek(sid))  # a stale holder's write, after the close
    assert a.shared.flush(10)
    with pytest.raises(ClosedInStore):
        a.shared.fetch(sid).result(10)
    status, body = ask(a, sid, QUESTIONS[2])
    assert status == 400 and body["error"]["code"] == "session_closed", body
    assert a.service.store.peek(sid) is None  # the stale copy is gone


def test_an_older_object_put_back_is_written_over_or_refused(
    pair: tuple[Any, Any],  # noqa: F811
    s3_url: str,  # noqa: F811
    reference: Reference,  # noqa: F811
) -> None:
    """Someone with write access puts an older genuine object back. The holder's copy is
    newer: it answers on, and its next write replaces the old object. An instance that wrote
    a later generation refuses to resume from the old one."""
    a, b = pair
    sid, picture = opened(a, 84)
    texts = [answered(a, sid, QUESTIONS[0])["text"]]
    older = stored_object(s3_url, a, sid)
    texts.append(answered(a, sid, QUESTIONS[1])["text"])
    key = a.shared.object_key(sid)
    replaced = a.shared.stats()["replaced"]
    raw(s3_url).put_object(Bucket=BUCKET, Key=key, Body=older)  # the replay
    texts.append(answered(a, sid, QUESTIONS[2])["text"])
    assert texts == reference.answers(picture, QUESTIONS[:3], TOKENS)
    assert a.shared.stats()["replaced"] == replaced + 1
    assert stored_object(s3_url, a, sid) != older
    raw(s3_url).put_object(Bucket=BUCKET, Key=key, Body=older)  # again, then A lets it go
    a.service.store.end(a.service.store.peek(sid), "evicted")
    with pytest.raises(CorruptSnapshot, match="older"):
        a.shared.fetch(sid).result(10)
    status, body = call(a, {"type": "close_session"}, sid)  # the user's close still wins
    assert status == 200 and body["closed"], body
    assert a.shared.flush(10)
    with pytest.raises(ClosedInStore):
        b.shared.fetch(sid).result(10)


def test_the_store_fences_writes_by_generation(s3_url: str) -> None:  # noqa: F811
    """At the store's level: a stale holder's write is refused and its copy reported moved;
    a newer one's goes in; an object damaged under a holder is written over."""
    here, there, sid = moved_on(s3_url, "gens")
    assert here.checks.check(sid).result(10) is False  # another instance wrote since
    here.save(sid, lambda: b"two, from a stale copy", 2)
    assert here.flush(10)
    assert here.stats()["fenced"] == 1 and here.stats()["failures"] == 0
    assert there.fetch(sid).result(10) == b"two"
    assert there.checks.check(sid).result(10) is True
    raw(s3_url).put_object(Bucket=BUCKET, Key=there.object_key(sid), Body=b"torn")
    assert there.checks.check(sid).result(10) is True  # damaged: the holder's copy stands
    there.save(sid, lambda: b"three", 3)
    assert there.flush(10)
    assert here.fetch(sid).result(10) == b"three" and there.stats()["replaced"] == 1
    here.close()
    there.close()


def test_a_stale_holder_further_along_never_overwrites_a_newer_copy(s3_url: str) -> None:  # noqa: F811
    """A holds generation 1; B resumes it and writes 2; A answered two turns whose writes
    never reached the store (an outage), so A's next write is generation 3: still stale, as
    A never saw 2. Refused; A's copy stays marked moved until A reads the session again."""
    here, there, sid = moved_on(s3_url, "ahead")
    here.save(sid, lambda: b"three, from a stale copy", 3)
    assert here.flush(10)
    assert here.stats()["fenced"] == 1
    assert there.fetch(sid).result(10) == b"two"
    for _ in range(2):  # asked twice (a busy session is dropped only later): still moved
        assert here.fenced.moved(sid) and here.checks.check(sid).result(10) is False
    assert here.fetch(sid).result(10) == b"two"  # read again: current from here on
    assert not here.fenced.moved(sid) and here.checks.check(sid).result(10) is True
    here.close()
    there.close()


class Slow:
    """A store whose look-ups hang until released (an outage that times out, not refuses)."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.release = threading.Event()
        self.lookups = 0

    def etag(self, key: str) -> str | None:
        self.lookups += 1
        self.release.wait(30)
        return self.real.etag(key)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


def test_a_slow_store_holds_a_turn_up_2_s_at_most_then_turns_go_unchecked(
    tiny_checkpoint: Path,
    tmp_path: Path,
    s3_url: str,  # noqa: F811
) -> None:
    a = instance(tiny_checkpoint, tmp_path, s3_url, "slow")
    sid, _ = opened(a, 85)
    assert a.shared.flush(10)  # stored: from now on each turn checks the store first
    slow = Slow(a.shared.fenced.objects)
    a.shared.fenced.objects = slow
    try:
        started = time.monotonic()
        answered(a, sid, QUESTIONS[0])  # its check hangs: answered from the held copy
        waited = time.monotonic() - started
        assert slow.lookups == 1 and 2.0 <= waited < 10, (slow.lookups, waited)
        answered(a, sid, QUESTIONS[1])  # checks are paused a while: no look-up, no wait
        assert slow.lookups == 1
    finally:
        slow.release.set()
        a.service.close()
        a.shared.close()
