"""Conversations outlive their instance: two real TorchServes behind the local SageMaker runtime,
one S3 API server (moto's, on loopback) as their shared session store, an unmodified boto3
client through the kit's `SessionClient`.

Conversations run on both instances; one instance is stopped gracefully (its worker drains and
flushes, as on SIGTERM in the image), a new one takes its place (an update), then the other is
killed with `kill -9` (a lost host). Every conversation goes on through the runtime, which routes
a lost session to an instance that is still there; each answer is the model's own pipeline's
over the whole conversation, so no finished turn was lost. Closing the sessions empties the
store.

On Ray Serve (`make test-ray`, two `ray start` nodes with a replica each): a node is taken out,
then the replica left is killed; the sessions resume on what remains, answers unchanged.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import boto3
import httpx
import pytest
from conftest import start_server, two_node_front
from engine_under_test import oracle
from helpers import (
    Reference,
    ask,
    data_uri,
    make_image,
    only_tombstones,
    open_session,
    store_secret_arn,
    stored_sessions,
    wait_for,
)

from llava.client import SessionClient
from llava.fronts.local_runtime.server import LocalRuntime
from llava.fronts.torchserve.launcher import TorchServe
from llava.fronts.torchserve.stopping import descendants

pytestmark = pytest.mark.integration

BUCKET = "endpoint-sessions"
PROMPTS = ["What is this?", "Which colors do you see?", "Is it big?", "Where is it?"]
TOKENS = 6


@pytest.fixture(scope="module")
def reference(tiny_checkpoint: Path) -> Reference:
    return oracle(tiny_checkpoint)


@pytest.fixture(scope="module")
def s3_url() -> Iterator[str]:
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    boto3.client("s3", endpoint_url=url, **CREDENTIALS).create_bucket(Bucket=BUCKET)
    try:
        yield url
    finally:
        server.stop()


CREDENTIALS = {
    "aws_access_key_id": "testing",
    "aws_secret_access_key": "testing",
    "region_name": "us-east-1",
}


def settings(s3_url: str) -> dict[str, str]:
    """Each instance's environment: the shared store, its secret in Secrets Manager (as deploy
    sets it), and dummy credentials for moto (which serves both APIs)."""
    return {
        "LLAVA_SESSION_STORE": f"s3://{BUCKET}/llava-endpoint",
        "LLAVA_SESSION_STORE_ENDPOINT": s3_url,
        "LLAVA_SESSION_STORE_SECRET_ID": store_secret_arn(s3_url),
        "AWS_ENDPOINT_URL_SECRETS_MANAGER": s3_url,
        "LLAVA_DRAIN_GRACE_S": "20",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }


def s3_client(s3_url: str) -> Any:
    return boto3.client("s3", endpoint_url=s3_url, **CREDENTIALS)


def stored(s3_url: str, sids: Iterable[str] | None = None) -> dict[str, str]:
    """Session id -> ETag of each of `sids` in the store; with none, every object's key."""
    client = s3_client(s3_url)
    if sids is None:
        listing = client.list_objects_v2(Bucket=BUCKET).get("Contents", [])
        return {o["Key"]: o["ETag"] for o in listing}
    return stored_sessions(client, BUCKET, settings(s3_url)["LLAVA_SESSION_STORE"], sids)


def kill_instance(ts: TorchServe) -> None:
    """`kill -9` a whole instance: its frontend and every process below it."""
    pid = ts.frontend_pid()
    assert pid is not None
    for child, _ in descendants(pid):
        os.kill(child, signal.SIGKILL)
    os.kill(pid, signal.SIGKILL)


STORE_WAIT_S = 30  # how long the store may take to show what the instances wrote


def test_conversations_survive_scale_in_an_update_and_a_lost_instance(
    model_store, tmp_path_factory, s3_url, reference, monkeypatch
) -> None:
    env = settings(s3_url)
    start = [
        start_server(model_store, tmp_path_factory.mktemp(f"shared-{i}"), **env) for i in (0, 1)
    ]
    servers: list[TorchServe] = list(start)
    try:
        with LocalRuntime([ts.url() for ts in start], name="llava") as runtime:
            monkeypatch.setenv("AWS_ENDPOINT_URL_SAGEMAKER_RUNTIME", runtime.url)
            monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
            monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
            monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
            monkeypatch.delenv("AWS_PROFILE", raising=False)
            client = SessionClient.for_endpoint("llava")
            pictures = [make_image(700 + i) for i in range(4)]
            sessions = [client.session(image=data_uri(p)) for p in pictures]
            said: list[list[str]] = [[] for _ in sessions]

            def turn(n: int) -> None:
                for i, s in enumerate(sessions):
                    if n == 2 and i == 0:  # one of them streams its answer
                        said[i].append("".join(s.stream(PROMPTS[n], max_new_tokens=TOKENS)))
                    else:
                        said[i].append(s.ask(PROMPTS[n], max_new_tokens=TOKENS).text)

            turn(0)
            assert sorted(set(runtime.routes.values())) == [0, 1]  # both instances hold some
            # Scale-in: instance 0 drains (its worker flushes every session) and stops.
            start[0].stop(drain_s=60)
            assert "drained in" in start[0].logs()
            turn(1)  # instance 0's conversations resume on instance 1
            assert set(runtime.routes.values()) == {1}
            # An update: a new instance takes the stopped one's place.
            servers.append(start_server(model_store, tmp_path_factory.mktemp("shared-new"), **env))
            runtime.replace(0, servers[-1].url())
            # A lost host: instance 1 is killed once its last answers are in the store.
            ids = [s.id for s in sessions]
            before = stored(s3_url, ids)
            turn(2)
            wait_for(
                lambda: all(stored(s3_url, ids).get(i) != before.get(i) for i in ids),
                "the last finished turns in the store",
                STORE_WAIT_S,
            )
            kill_instance(start[1])
            turn(3)  # every conversation goes on, on the new instance
            assert set(runtime.routes.values()) == {0}
            for picture, answers in zip(pictures, said, strict=True):
                assert answers == reference.answers(picture, PROMPTS, TOKENS)
            # An explicit resume names a stored session: it is pinned where it lands.
            resumed = client.resume(sessions[1].id)
            assert resumed.id == sessions[1].id
            for s in sessions:
                s.close()
            wait_for(
                lambda: only_tombstones(
                    s3_client(s3_url), BUCKET, settings(s3_url)["LLAVA_SESSION_STORE"], ids
                ),
                "the closed sessions' tombstones, and nothing else",
                STORE_WAIT_S,
            )
    finally:
        for ts in servers:
            ts.stop()


def test_ray_sessions_resume_on_the_rest_when_a_node_and_a_replica_go(
    tiny_checkpoint, tmp_path, s3_url, reference, monkeypatch
) -> None:
    """Two nodes with a replica each: one node is taken out (its replica's sessions resume on
    the other replica), then that replica is killed (Ray starts another, which resumes them
    all); every answer is the pipeline's over the whole conversation."""
    for key, value in settings(s3_url).items():  # every node's processes read them
        monkeypatch.setenv(key, value)
    pictures = [make_image(800 + i) for i in range(4)]
    with (
        two_node_front(tiny_checkpoint, tmp_path) as (cluster, front),
        httpx.Client(timeout=300) as client,
    ):
        url = front.url("/invocations")
        sids = [open_session(client, url, data_uri(p)) for p in pictures]
        said: list[list[str]] = [[] for _ in sids]

        def turn(n: int) -> list[dict[str, Any]]:
            answers = [ask(client, url, sid, PROMPTS[n], max_new_tokens=TOKENS) for sid in sids]
            for mine, answer in zip(said, answers, strict=True):
                mine.append(answer["text"])
            return answers

        wait_for(
            lambda: set(sids) <= set(stored(s3_url, sids)), "the opens in the store", STORE_WAIT_S
        )

        def stored_turn(n: int) -> list[dict[str, Any]]:
            """Ask turn n, then wait until every session's new state is in the store."""
            before = stored(s3_url, sids)
            answers = turn(n)
            wait_for(
                lambda: all(stored(s3_url, sids).get(s) != before[s] for s in sids),
                f"turn {n} in the store",
                STORE_WAIT_S,
            )
            return answers

        first = stored_turn(0)
        assert len({a["usage"]["node"] for a in first}) == 2, first  # on both nodes
        cluster.stop_node(1)  # a node drained or lost: its replica goes with it
        second = stored_turn(1)
        assert len({a["usage"]["node"] for a in second}) == 1  # all on the head now
        assert "store" in {a["usage"]["session_tier"] for a in second}
        [pid] = cluster.replica_pids()
        os.kill(pid, signal.SIGKILL)  # and that replica: Ray starts another
        turn(2)
    for picture, answers in zip(pictures, said, strict=True):
        assert answers == reference.answers(picture, PROMPTS[:3], TOKENS)
