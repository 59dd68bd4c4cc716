"""The shared session store against a real S3 API (moto's server on loopback): what it writes,
what it refuses to read, and that it never holds up or fails an answer.

The service-level tests assemble two instances exactly as a worker does (`assemble`, the tiny
checkpoint, one bucket between them): a conversation begun on one continues on the other, its
answers the model's own pipeline's over the whole conversation.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from helpers import STORE_SECRET, Reference, data_uri, make_image, serve_rows, store_secret_arn

from llava.api.headers import NEW_SESSION_HEADER, SESSION_HEADER
from llava.core.config import ServerConfig
from llava.core.ids import new_session_id
from llava.sessions.fenced import ClosedInStore, NotStored
from llava.sessions.objects import S3Objects, StoreLocation
from llava.sessions.parts import split
from llava.sessions.sealed import Sealed, seal, store_key
from llava.sessions.session import CLOSED, EVICTED, EXPIRED
from llava.sessions.shared import SharedStore
from llava.sessions.snapshots import CorruptSnapshot

BUCKET = "llava-sessions"
TOKENS = 6
PROMPTS = ["What is this?", "Which colors do you see?", "Is it big?"]


@pytest.fixture(scope="module")
def s3_url() -> Iterator[str]:
    """A real S3 API server on loopback, with dummy credentials for this process."""
    from moto.server import ThreadedMotoServer

    saved = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
    os.environ.update(
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_CONFIG_FILE=os.devnull,
        AWS_SHARED_CREDENTIALS_FILE=os.devnull,
    )
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    boto3.client("s3", endpoint_url=url).create_bucket(Bucket=BUCKET)
    try:
        yield url
    finally:
        server.stop()
        for key in [k for k in os.environ if k.startswith("AWS_")]:
            del os.environ[key]
        os.environ.update(saved)


def shared(url: str, prefix: str, **kwargs: Any) -> SharedStore:
    location = StoreLocation.parse(f"s3://{BUCKET}/{prefix}")
    return SharedStore(S3Objects.connect(BUCKET, endpoint_url=url), location, **kwargs)


def raw(url: str) -> Any:
    return boto3.client("s3", endpoint_url=url)


def keys(url: str, prefix: str) -> list[str]:
    listing = raw(url).list_objects_v2(Bucket=BUCKET, Prefix=prefix)
    return sorted(o["Key"] for o in listing.get("Contents", []))


# -- the store ---------------------------------------------------------------------------------


def test_a_saved_state_is_sealed_in_the_bucket_and_read_back(s3_url: str) -> None:
    store = shared(s3_url, "one")
    sid = new_session_id()
    store.save(sid, lambda: b"state", 1)
    assert store.flush(10)
    [key] = keys(s3_url, "one/")
    assert key == store.object_key(sid) and sid not in key  # no listing reveals an id
    body = raw(s3_url).get_object(Bucket=BUCKET, Key=key)["Body"].read()
    assert body != b"state" and body.endswith(b"state")  # sealed, not the bare payload
    assert store.fetch(sid).result(10) == b"state"
    assert store.stats()["writes"] == 1 and store.size_of(sid) == len(body)
    store.save(sid, lambda: b"state, a turn later", 2)
    assert store.flush(10)
    assert store.stats()["writes"] == 2 and store.stats()["objects"] == 1
    with pytest.raises(NotStored):
        store.fetch(new_session_id()).result(10)
    store.close()


def hold_writer(store: SharedStore, sid: str) -> threading.Event:
    """Queue `sid`'s state and hold the writer on it (the rest queue behind) until the
    returned gate is set; the state is b"first"."""
    gate, busy = threading.Event(), threading.Event()

    def slow() -> bytes:
        busy.set()
        gate.wait(10)
        return b"first"

    store.save(sid, slow, 1)
    assert busy.wait(10)
    return gate


def test_only_the_latest_state_of_a_session_waits_and_the_queue_is_bounded(s3_url: str) -> None:
    store = shared(s3_url, "queue", max_pending=2)
    a, b, c, d = (new_session_id() for _ in range(4))
    gate = hold_writer(store, a)
    store.save(b, lambda: b"b-old", 1)
    store.save(b, lambda: b"b-new", 2)  # replaces b's pending write
    assert store.stats()["pending"] == 2
    store.save(c, lambda: b"c", 1)
    store.save(d, lambda: b"d", 1)  # past max_pending: the oldest pending write (b's) goes
    assert store.stats()["dropped"] == 1
    gate.set()
    assert store.flush(10)
    assert store.fetch(a).result(10) == b"first"
    with pytest.raises(NotStored):
        store.fetch(b).result(10)
    assert [store.fetch(s).result(10) for s in (c, d)] == [b"c", b"d"]
    assert store.stats()["writes"] == 3
    store.close()


def test_pending_writes_are_bounded_by_the_bytes_they_keep_alive(s3_url: str) -> None:
    """A pending write is counted at its session's last snapshot's size."""
    store = shared(s3_url, "bytes", max_pending_bytes=1_000)
    a, b, c = (new_session_id() for _ in range(3))
    for sid in (b, c):
        store.save(sid, lambda: b"x" * 600, 1)
    assert store.flush(10) and store.size_of(b) > 600
    gate = hold_writer(store, a)
    store.save(b, lambda: b"b", 2)
    store.save(c, lambda: b"c", 2)  # some 1,300 bytes kept alive: b's write goes
    assert store.stats()["dropped"] == 1 and store.dirty() == {b}
    gate.set()
    assert store.flush(10)
    assert store.fetch(b).result(10) == b"x" * 600  # a turn behind: a lost host would lose it
    assert store.fetch(c).result(10) == b"c"
    store.close()


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "other-session", "foreign"])
def test_a_damaged_moved_or_foreign_object_is_refused(s3_url: str, damage: str) -> None:
    store = shared(s3_url, "damage")
    sid, other = new_session_id(), new_session_id()
    store.save(sid, lambda: b"x" * 100, 1)
    assert store.flush(10)
    key = store.object_key(sid)
    data = raw(s3_url).get_object(Bucket=BUCKET, Key=key)["Body"].read()
    if damage == "other-session":  # a valid object copied under another session's key
        raw(s3_url).put_object(Bucket=BUCKET, Key=store.object_key(other), Body=data)
        sid = other
    elif damage == "foreign":  # sealed by another endpoint's store (its prefix), put here
        foreign = seal(store_key(f"s3://{BUCKET}/elsewhere"), sid, Sealed(1, b"x" * 100))
        raw(s3_url).put_object(Bucket=BUCKET, Key=key, Body=foreign)
    else:
        damaged = {"flip": data[:60] + bytes([data[60] ^ 1]) + data[61:], "truncate": data[:-5]}
        raw(s3_url).put_object(Bucket=BUCKET, Key=key, Body=damaged.get(damage, b""))
    with pytest.raises(CorruptSnapshot):
        store.fetch(sid).result(10)
    store.close()


def test_a_secret_refuses_objects_sealed_without_it(s3_url: str) -> None:
    writer = shared(s3_url, "secret", secret="endpoint secret")
    sid = new_session_id()
    writer.save(sid, lambda: b"state", 1)
    assert writer.flush(10)
    assert writer.fetch(sid).result(10) == b"state"
    forger = shared(s3_url, "secret")  # knows the bucket and prefix, not the secret
    with pytest.raises(NotStored):  # nor where the session's object is
        forger.fetch(sid).result(10)
    [key] = keys(s3_url, "secret/")  # a listing shows the object, not whose it is
    forged = seal(store_key(f"s3://{BUCKET}/secret"), sid, Sealed(2, b"forged"))
    raw(s3_url).put_object(Bucket=BUCKET, Key=key, Body=forged)
    with pytest.raises(CorruptSnapshot):
        writer.fetch(sid).result(10)
    writer.close()
    forger.close()


def test_a_session_ended_by_its_user_goes_and_one_resumed_elsewhere_stays(s3_url: str) -> None:
    here, there = shared(s3_url, "ends"), shared(s3_url, "ends")
    closed, expired, moved, evicted = (new_session_id() for _ in range(4))
    for sid in (closed, expired, moved, evicted):
        here.save(sid, lambda: b"here", 1)
    assert here.flush(10)
    assert there.fetch(moved).result(10) == b"here"  # another instance resumed it ...
    there.save(moved, lambda: b"there", 2)  # ... and answered since
    assert there.flush(10)
    here.remove(closed, CLOSED)
    here.remove(expired, EXPIRED)
    here.remove(moved, EXPIRED)
    here.remove(evicted, EVICTED)
    assert here.flush(10)
    left = (closed, moved, evicted)  # a closed one leaves its tombstone
    assert keys(s3_url, "ends/") == sorted(here.object_key(s) for s in left)
    assert there.fetch(moved).result(10) == b"there"
    with pytest.raises(ClosedInStore):
        there.fetch(closed).result(10)
    here.close()
    there.close()


def test_a_session_resumed_here_that_expires_here_is_deleted(s3_url: str) -> None:
    """Resumed here and expired here without a new write: its object goes (it was left until
    a lifecycle rule, and a stale copy could be resumed); one written since elsewhere stays."""
    there, here = shared(s3_url, "resumed"), shared(s3_url, "resumed")
    idle, moved = new_session_id(), new_session_id()
    for sid in (idle, moved):
        there.save(sid, lambda: b"there", 1)
    assert there.flush(10)
    assert here.fetch(idle).result(10) == b"there" == here.fetch(moved).result(10)
    there.save(moved, lambda: b"there again", 2)  # resumed back there, and answered
    assert there.flush(10)
    here.remove(idle, EXPIRED)
    here.remove(moved, EXPIRED)
    assert here.flush(10)
    assert keys(s3_url, "resumed/") == [here.object_key(moved)]
    here.close()
    there.close()


def test_a_store_that_is_down_costs_writes_never_a_caller(s3_url: str) -> None:
    location = StoreLocation.parse(f"s3://{BUCKET}/down")
    dead = S3Objects.connect(BUCKET, endpoint_url="http://127.0.0.1:9", timeout_s=0.5)
    store = SharedStore(dead, location, retry_s=0.01)
    sid = new_session_id()
    store.save(sid, lambda: b"state", 1)  # returns at once: the writer thread does the work
    store.remove(new_session_id(), CLOSED)
    assert store.flush(60)
    stats = store.stats()
    assert stats["failures"] == 2 and stats["writes"] == 0 and stats["pending"] == 0
    with pytest.raises(Exception):  # noqa: B017 (botocore's own connection error)
        store.fetch(sid).result(30)
    store.close()


def test_a_store_location_must_be_an_s3_uri() -> None:
    assert StoreLocation.parse("s3://bucket/a/b/").under("llava").key("x") == "a/b/llava/x.snap"
    for bad in ("bucket/prefix", "s3://", "https://bucket/x", "s3://UPPER/x"):
        with pytest.raises(ValueError, match="s3://bucket/prefix"):
            StoreLocation.parse(bad)
    with pytest.raises(ValueError, match="s3://bucket/prefix"):
        ServerConfig(session_store="/tmp/sessions")
    assert "secret" not in repr(ServerConfig(session_store_secret="hunter2")).replace("_secret", "")


# -- two instances, one store -------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference(tiny_checkpoint: Path) -> Reference:
    return Reference(tiny_checkpoint)


def instance(checkpoint: Path, tmp: Path, url: str, name: str, **settings: Any) -> Any:
    from llava.fronts.assembly import assemble

    config = ServerConfig(
        device="cpu",
        image_processes=0,
        snapshot_dir=str(tmp / f"snaps-{name}"),
        session_store=f"s3://{BUCKET}/endpoint",
        session_store_endpoint=url,
        **{"session_store_secret": STORE_SECRET, **settings},
    )
    return assemble(checkpoint, config, model_name="llava", registry_dir=str(tmp / f"reg-{name}"))


def call(inst: Any, body: dict[str, Any], sid: str | None = None) -> tuple[int, Any]:
    headers = {SESSION_HEADER: sid} if sid else {}
    rid = new_session_id()
    return serve_rows(inst.service, [(rid, body, headers)])[rid]


def ask(inst: Any, sid: str, prompt: str) -> tuple[int, Any]:
    return call(inst, {"type": "query", "prompt": prompt, "max_new_tokens": TOKENS}, sid)


@pytest.fixture(scope="module")
def pair(tiny_checkpoint: Path, tmp_path_factory: Any, s3_url: str) -> Iterator[tuple[Any, Any]]:
    tmp = tmp_path_factory.mktemp("pair")
    a = instance(tiny_checkpoint, tmp, s3_url, "a")
    b = instance(tiny_checkpoint, tmp, s3_url, "b")
    yield a, b
    for inst in (a, b):
        inst.service.close()
        inst.shared.close()


def test_a_store_never_runs_without_a_secret_and_reads_its_own_from_secrets_manager(
    tiny_checkpoint: Path, tmp_path: Path, s3_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No secret: the instance refuses to start, saying how to give one. A Secrets Manager
    secret (as `deploy --session-store` makes it): read at start through the role, and every
    object sealed with it; one the role cannot read stops the start with the permission named."""
    with pytest.raises(ValueError, match="needs a secret"):
        instance(tiny_checkpoint, tmp_path, s3_url, "bare", session_store_secret="")
    with pytest.raises(ValueError, match="needs a secret"):
        instance(tiny_checkpoint, tmp_path, s3_url, "weak", session_store_secret="short")
    monkeypatch.setenv("AWS_ENDPOINT_URL_SECRETS_MANAGER", s3_url)
    with pytest.raises(ValueError, match="secretsmanager:GetSecretValue"):
        instance(
            tiny_checkpoint, tmp_path, s3_url, "none", session_store_secret="",
            session_store_secret_id="arn:aws:secretsmanager:us-east-1:123456789012:secret:gone-AbCdEf",
        )  # fmt: skip
    arn = store_secret_arn(s3_url)
    inst = instance(
        tiny_checkpoint,
        tmp_path,
        s3_url,
        "sm",
        session_store_secret="",
        session_store_secret_id=arn,
    )
    sid = call(inst, {"type": "open_session", "image": data_uri(make_image(69))})[1]["session_id"]
    assert inst.shared.flush(10)
    location = inst.shared.location
    for secret, readable in ((STORE_SECRET, True), ("", False), ("another secret here", False)):
        reader = SharedStore(
            S3Objects.connect(BUCKET, endpoint_url=s3_url), location, secret=secret
        )
        outcome = reader.fetch(sid).exception(10)
        assert (outcome is None) == readable, outcome
        reader.close()
    inst.service.close()
    inst.shared.close()


def test_a_conversation_begun_on_one_instance_goes_on_on_another(pair, reference, s3_url) -> None:
    a, b = pair
    picture = make_image(41)
    status, opened = call(a, {"type": "open_session", "image": data_uri(picture)})
    assert status == 200
    sid = opened["session_id"]
    answers = [ask(a, sid, p)[1]["text"] for p in PROMPTS[:2]]
    assert a.shared.flush(10)
    status, reply = ask(b, sid, PROMPTS[2])  # b never held it: it resumes from the store
    assert status == 200, reply
    assert reply["usage"]["session_tier"] == "store"
    expected = reference.answers(picture, PROMPTS, TOKENS)
    assert [*answers, reply["text"]] == expected
    status, again = ask(b, sid, "And now?")
    assert status == 200 and again["usage"]["session_tier"] != "store"  # held from now on
    status, closed = call(b, {"type": "close_session"}, sid)
    assert status == 200 and closed["closed"]
    assert b.shared.flush(10)
    with pytest.raises(ClosedInStore):  # its tombstone: no stale copy can bring it back
        a.shared.fetch(sid).result(10)


def test_a_resume_is_rebuilt_on_a_reader_thread_never_the_step_loop(
    pair: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = pair
    sid = call(a, {"type": "open_session", "image": data_uri(make_image(43))})[1]["session_id"]
    assert a.shared.flush(10)
    engine, threads = b.service.engine, []
    rebuild = engine.resume

    def recording(data: bytes) -> Any:
        threads.append(threading.current_thread().name)
        return rebuild(data)

    monkeypatch.setattr(engine, "resume", recording)
    status, reply = ask(b, sid, PROMPTS[0])
    assert status == 200 and reply["usage"]["session_tier"] == "store"
    assert len(threads) == 1 and threads[0].startswith("llava-store-read")


def test_a_client_can_resume_explicitly_and_is_pinned_to_the_new_instance(pair, reference):
    a, b = pair
    picture = make_image(42)
    sid = call(a, {"type": "open_session", "image": data_uri(picture)})[1]["session_id"]
    first = ask(a, sid, PROMPTS[0])[1]["text"]
    assert a.shared.flush(10)
    rid = new_session_id()
    rows = [(rid, {"type": "open_session", "resume": sid}, {SESSION_HEADER: "NEW_SESSION"})]
    status, body = serve_rows(b.service, rows)[rid]
    assert status == 200 and body["session_id"] == sid
    status, reply = ask(b, sid, PROMPTS[1])
    assert status == 200
    assert [first, reply["text"]] == reference.answers(picture, PROMPTS[:2], TOKENS)
    # AWS's dialect resumes too; a held session answers at once, with the new-session header
    from llava.server.service import Incoming

    batch = [Incoming("r", b'{"requestType": "NEW_SESSION", "resume": "%s"}' % sid.encode(), {})]
    [reply_] = b.service.step(batch)
    assert reply_ is not None and reply_.status == 200
    assert reply_.headers[NEW_SESSION_HEADER].startswith(sid + "; Expires=")


def test_a_damaged_or_expired_stored_state_costs_its_own_session_only(pair, s3_url) -> None:
    a, b = pair
    sids = [
        call(a, {"type": "open_session", "image": data_uri(make_image(50 + i))})[1]
        for i in range(3)
    ]
    damaged, expired, fine = (s["session_id"] for s in sids)
    assert a.shared.flush(10)
    key = a.shared.object_key(damaged)
    data = raw(s3_url).get_object(Bucket=BUCKET, Key=key)["Body"].read()
    raw(s3_url).put_object(Bucket=BUCKET, Key=key, Body=data[:-100])
    status, body = ask(b, damaged, "Hello?")
    assert status == 400 and body["error"]["code"] == "session_lost"
    # an expired conversation: its stored expiry is in the past
    session = a.service.store.peek(expired)
    a.service.store.ttl_s = 0.001
    a.service.keeper.keep(session)
    a.service.store.ttl_s = 1200.0
    assert a.shared.flush(10)
    status, body = ask(b, expired, "Hello?")
    assert status == 400 and body["error"]["code"] == "session_expired"
    assert b.shared.flush(10)
    assert b.shared.fetch(expired).exception(10) is not None  # deleted
    status, body = ask(b, fine, "What is this?")
    assert status == 200 and body["usage"]["session_tier"] == "store"


def test_a_stored_state_of_another_model_costs_its_own_session_only(pair, s3_url) -> None:
    """Sealed for this store and this session, but taken with another checkpoint (an update
    that changed the model): refused by the engine's fingerprint check."""
    from test_snapshots import with_meta

    a, b = pair
    sid = call(a, {"type": "open_session", "image": data_uri(make_image(55))})[1]["session_id"]
    assert a.shared.flush(10)
    key = store_key(f"s3://{BUCKET}/endpoint/llava", STORE_SECRET)
    payload = a.shared.fetch(sid).result(10)
    other = with_meta(payload, lambda meta: meta.update(model="another-checkpoint"))
    raw(s3_url).put_object(
        Bucket=BUCKET,
        Key=a.shared.object_key(sid),
        Body=seal(key, sid, Sealed(1, split(other).skeleton)),
    )
    status, body = ask(b, sid, "Hello?")
    assert status == 400 and body["error"]["code"] == "session_lost"
    assert "different model" in body["error"]["message"]


def test_with_no_store_nothing_leaves_the_instance(tiny_checkpoint, tmp_path, s3_url) -> None:
    from llava.fronts.assembly import assemble

    before = keys(s3_url, "")
    config = ServerConfig(device="cpu", image_processes=0, snapshot_dir=str(tmp_path / "s"))
    inst = assemble(tiny_checkpoint, config, model_name="llava", registry_dir=str(tmp_path))
    assert inst.shared is None
    sid = call(inst, {"type": "open_session", "image": data_uri(make_image(60))})[1]["session_id"]
    assert ask(inst, sid, "What is this?")[0] == 200
    inst.service.close()
    assert keys(s3_url, "") == before


def test_a_draining_instance_takes_no_new_session_and_flushes_every_held_one(
    tiny_checkpoint, tmp_path, s3_url
) -> None:
    inst = instance(tiny_checkpoint, tmp_path, s3_url, "drain", session_store_max_pending=256)
    sid = call(inst, {"type": "open_session", "image": data_uri(make_image(61))})[1]["session_id"]
    inst.service.draining = True
    status, body = call(inst, {"type": "open_session", "image": data_uri(make_image(62))})
    assert status == 503 and body["error"]["code"] == "draining"
    status, body = ask(inst, sid, "What is this?")  # a held conversation is still served
    assert status == 200
    outcome = inst.drain(grace_s=5)
    assert outcome["flushed"] and outcome["cut"] == 0
    assert inst.shared.stats()["pending"] == 0
    assert inst.shared.object_key(sid) in keys(s3_url, "endpoint/")
    status, body = ask(inst, sid, "And now?")  # past the drain nothing is admitted
    assert status == 503 and body["error"]["code"] == "draining"
    from llava.fronts.gauges import Gauges

    readings = {(r.name, r.dimension): r.value for r in Gauges(inst).changed()}
    assert readings[("LlavaStoreWrites", ("Outcome", "written"))] == 2  # the open, the answer
    assert readings[("LlavaSnapshots", ("Store", "shared"))] == 1
    assert readings[("LlavaStorePending", ("Store", "shared"))] == 0
    inst.service.close()
    inst.shared.close()


def test_a_restarted_worker_leaves_to_the_store_what_it_holds(
    tiny_checkpoint, tmp_path, s3_url, reference
) -> None:
    """The store's copy may be newer than this disk's (another instance may have answered since):
    a new worker resumes such a session from the store, not from its local snapshot."""
    picture = make_image(63)
    first = instance(tiny_checkpoint, tmp_path, s3_url, "restart")
    sid = call(first, {"type": "open_session", "image": data_uri(picture)})[1]["session_id"]
    answer = ask(first, sid, PROMPTS[0])[1]["text"]
    assert first.shared.flush(10) and first.snapshots is not None
    first.snapshots.flush()
    first.service.close()
    first.shared.close()  # the worker dies; its registry and snapshots stay on the disk
    second = instance(tiny_checkpoint, tmp_path, s3_url, "restart")
    assert second.service.store.peek(sid) is None  # not restored from the disk at start-up
    status, reply = ask(second, sid, PROMPTS[1])
    assert status == 200 and reply["usage"]["session_tier"] == "store"
    assert [answer, reply["text"]] == reference.answers(picture, PROMPTS[:2], TOKENS)
    second.service.close()
    second.shared.close()


def test_deletions_are_never_dropped_and_a_read_waits_for_this_instances_own_write(
    s3_url: str,
) -> None:
    store = shared(s3_url, "order", max_pending=1)
    gate, busy = threading.Event(), threading.Event()
    closed, newer = new_session_id(), new_session_id()
    for sid, state in ((closed, b"old"), (newer, b"v1")):
        store.save(sid, lambda state=state: state, 1)
        assert store.flush(10)
    assert store.fetch(closed).result(10) == b"old"

    def held() -> bytes:
        busy.set()
        gate.wait(10)
        return b"v2"

    store.save(newer, held, 2)  # the writer is held on newer's second state
    assert busy.wait(10)
    store.remove(closed, CLOSED)
    store.save(new_session_id(), lambda: b"x", 1)  # over max_pending: a write goes, not the delete
    reading = store.fetch(newer)  # this instance's own write of it is still in progress
    assert not reading.done()
    gate.set()
    assert reading.result(10) == b"v2"  # not the older object in the bucket
    assert store.flush(10)
    with pytest.raises(ClosedInStore):
        store.fetch(closed).result(10)
    assert store.stats()["dropped"] == 1
    store.close()


def test_a_session_closing_here_is_not_resumed_and_a_full_instance_resumes_nothing(
    pair, tiny_checkpoint, tmp_path, s3_url
) -> None:
    a, _ = pair
    sid = call(a, {"type": "open_session", "image": data_uri(make_image(64))})[1]["session_id"]
    session = a.service.store.begin_turn(sid)  # an answer is running ...
    a.service.store.close(sid)  # ... when the client closes: it ends with the answer
    status, body = ask(a, sid, "Hello?")
    assert status == 400 and body["error"]["code"] == "session_closed"
    a.service.store.end_turn(session)
    assert a.shared.flush(10)
    full = instance(tiny_checkpoint, tmp_path, s3_url, "full", max_sessions=1)
    other = call(a, {"type": "open_session", "image": data_uri(make_image(65))})[1]["session_id"]
    mine = call(full, {"type": "open_session", "image": data_uri(make_image(66))})[1]
    assert a.shared.flush(10) and mine["session_id"]
    status, body = ask(full, other, "Hello?")
    assert status == 429 and body["error"]["code"] == "capacity_exceeded"
    full.service.close()
    full.shared.close()


def test_a_stopping_instance_refuses_a_held_session_only_once_its_state_is_stored(pair) -> None:
    from llava.server.service import Incoming

    a, _ = pair
    sid = call(a, {"type": "open_session", "image": data_uri(make_image(67))})[1]["session_id"]
    assert a.shared.flush(10)
    gate, busy = threading.Event(), threading.Event()

    def latest() -> bytes:
        busy.set()
        gate.wait(10)
        return b"the latest state"

    a.shared.save(sid, latest, 2)  # its last turn's write has not landed yet
    assert busy.wait(10)
    a.service.stopping = True
    try:
        body = b'{"type": "query", "prompt": "Hello?"}'
        batch = [Incoming("q", body, {SESSION_HEADER: sid})]
        assert a.service.step(batch) == [
            None
        ]  # held back: refused now, it would move a turn behind
        gate.set()
        for _ in range(400):
            [reply] = a.service.step([Incoming("q", None, {SESSION_HEADER: sid})])
            if reply is not None:
                break
        assert reply is not None and reply.status == 503
        assert a.shared.fetch(sid).result(10) == b"the latest state"  # stored before the refusal
    finally:
        a.service.stopping = False


def test_a_drain_saves_again_what_the_store_never_got(tiny_checkpoint, tmp_path, s3_url) -> None:
    """A write given up during a store outage (the turn kept on local disk only) is written by
    the drain once the store is back, so scale-in after an outage still loses nothing."""
    inst = instance(tiny_checkpoint, tmp_path, s3_url, "outage")
    sid = call(inst, {"type": "open_session", "image": data_uri(make_image(68))})[1]["session_id"]
    assert inst.shared.flush(10)
    before = inst.shared.fetch(sid).result(10)
    real = inst.shared.fenced.objects

    class Down:
        def __getattr__(self, name: str) -> Any:
            def fail(*args: Any, **kwargs: Any) -> Any:
                raise ConnectionError("the store is down")

            return fail

    inst.shared.fenced.objects, inst.shared.retry_s = Down(), 0.001
    assert ask(inst, sid, "What is this?")[0] == 200  # answered all the same
    assert inst.shared.flush(10)
    assert inst.shared.dirty() == {sid} and inst.shared.stats()["failures"] == 1
    inst.shared.fenced.objects = real  # the store is back; nothing else writes this session
    assert inst.drain(grace_s=5)["flushed"]
    assert inst.shared.dirty() == set()
    assert inst.shared.fetch(sid).result(10) != before  # the answered turn is in the store
    inst.service.close()
    inst.shared.close()


def test_an_unknown_session_id_evicts_no_chat(tiny_checkpoint, tmp_path, s3_url) -> None:
    """A full instance holding a header-less chat: a request naming an id the store does not
    know is session_not_found, and the chat keeps its cache (it was evicted before the store
    was read)."""
    full = instance(tiny_checkpoint, tmp_path, s3_url, "one-chat", max_sessions=1)
    try:
        picture = {"type": "image_url", "image_url": {"url": data_uri(make_image(70))}}
        text = {"type": "text", "text": "What is this?"}
        body = {"model": "llava", "max_tokens": TOKENS}
        messages = [{"role": "user", "content": [picture, text]}]
        status, _ = call(full, {**body, "messages": messages})
        assert status == 200 and len(full.service.store) == 1
        status, reply = ask(full, new_session_id(), "Hello?")
        assert status == 400 and reply["error"]["code"] == "session_not_found"
        assert len(full.service.store) == 1  # the chat is still held
    finally:
        full.service.close()
        full.shared.close()


def test_a_chat_back_after_its_ttl_fetches_its_pictures_once(
    tiny_checkpoint, tmp_path, s3_url, monkeypatch
) -> None:
    """A header-less chat whose kept session expired: its next turn loads and prepares its
    pictures once (they were skipped as held, then loaded again when nothing held them)."""
    inst = instance(tiny_checkpoint, tmp_path, s3_url, "ttl-chat")
    try:
        picture = {"type": "image_url", "image_url": {"url": data_uri(make_image(71))}}
        first = [{"role": "user", "content": [picture, {"type": "text", "text": "What is it?"}]}]
        body = {"model": "llava", "max_tokens": TOKENS}
        status, reply = call(inst, {**body, "messages": first})
        assert status == 200 and len(inst.service.store) == 1
        store = inst.service.store
        monkeypatch.setattr(store, "ttl_s", 1e-6)
        assert len(store.reap()) == 1
        monkeypatch.setattr(store, "ttl_s", 1200.0)
        loads: list[int] = []
        images = inst.service.chats.images
        submit_all = images.submit_all
        monkeypatch.setattr(
            images, "submit_all", lambda *a, **k: loads.append(1) or submit_all(*a, **k)
        )
        answer = reply["choices"][0]["message"]["content"]
        again = [*first, {"role": "assistant", "content": answer}]
        again.append({"role": "user", "content": "And its colour?"})
        status, _ = call(inst, {**body, "messages": again})
        assert status == 200 and len(loads) == 1
    finally:
        inst.service.close()
        inst.shared.close()
