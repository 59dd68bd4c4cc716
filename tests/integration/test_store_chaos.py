"""Chaos: conversations on two TorchServes sharing one store while instances go away at random.

Sixteen conversations at a time run through the local SageMaker runtime and `SessionClient`
(boto3) on two TorchServes whose sessions live in one store (moto's S3 server, the store's
secret in its Secrets Manager). At random moments one instance is stopped (SIGTERM: it drains
and flushes) or killed (`kill -9`, a lost host; once its last answers are in the store, the
guarantee a lost host gives) and a fresh one takes its place; a conversation that has asked all
its questions is closed and a new one opened. Every answer must be the model's own pipeline's
over the conversation the client had (no finished turn lost, none answered from a stale copy),
and every closed conversation's object a tombstone. The count of each event is printed.

`make test` runs it for LLAVA_CHAOS_S=60 seconds; `make chaos` for 600.
"""

from __future__ import annotations

import os
import random
import time
from collections import Counter
from pathlib import Path
from typing import Any

import boto3
import pytest
from conftest import start_server
from helpers import STORE_SECRET, Reference, data_uri, make_image, wait_for
from test_shared_sessions import (  # noqa: F401 (fixtures)
    BUCKET,
    CREDENTIALS,
    kill_instance,
    reference,
    s3_url,
    settings,
)

from llava.client import SessionClient
from llava.fronts.local_runtime.server import LocalRuntime
from llava.fronts.torchserve.launcher import TorchServe
from llava.sessions.objects import StoreLocation
from llava.sessions.sealed import object_name, store_key, unseal

pytestmark = pytest.mark.integration

CHAOS_S = float(os.environ.get("LLAVA_CHAOS_S", "60"))
CONVERSATIONS = 16
PROMPTS = [
    "What is this?",
    "Which colors do you see?",
    "Is it big?",
    "Where is it?",
    "What shape is it?",
    "Is there more than one?",
]
TOKENS = 6
STORE_WAIT_S = 60


class Stored:
    """Reads a session's object back as the instances sealed it: its generation, or a close."""

    def __init__(self, url: str) -> None:
        self.client = boto3.client("s3", endpoint_url=url, **CREDENTIALS)
        location = StoreLocation.parse(settings(url)["LLAVA_SESSION_STORE"]).under("llava")
        self.location = location
        self.key = store_key(location.uri, STORE_SECRET)

    def read(self, sid: str) -> Any:
        key = self.location.key(object_name(self.key, sid))
        try:
            data = self.client.get_object(Bucket=BUCKET, Key=key)["Body"].read()
        except self.client.exceptions.NoSuchKey:
            return None
        return unseal(self.key, sid, data)


def test_conversations_survive_instances_stopped_killed_and_replaced_at_random(
    model_store: Path,
    reference: Reference,  # noqa: F811
    tmp_path_factory: pytest.TempPathFactory,
    s3_url: str,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rng = random.Random(int(os.environ.get("LLAVA_CHAOS_SEED", "7")))
    env = settings(s3_url)
    stored = Stored(s3_url)
    counts: Counter[str] = Counter()

    def fresh() -> TorchServe:
        return start_server(model_store, tmp_path_factory.mktemp("chaos"), **env)

    slots = [fresh(), fresh()]
    try:
        with LocalRuntime([ts.url() for ts in slots], name="llava") as runtime:
            monkeypatch.setenv("AWS_ENDPOINT_URL_SAGEMAKER_RUNTIME", runtime.url)
            for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                               "AWS_DEFAULT_REGION": "us-east-1"}.items():  # fmt: skip
                monkeypatch.setenv(key, value)
            monkeypatch.delenv("AWS_PROFILE", raising=False)
            client = SessionClient.for_endpoint("llava")
            seed = iter(range(900, 10_000))

            def opened() -> tuple[Any, Any, list[str]]:
                picture = make_image(next(seed))
                counts["opened"] += 1
                return client.session(image=data_uri(picture)), picture, []

            live = [opened() for _ in range(CONVERSATIONS)]
            closed: list[str] = []

            def settled() -> bool:
                """Every live conversation's latest finished turn is in the store."""
                for session, _, said in live:
                    found = stored.read(session.id)
                    if found is None or found.generation < 1 + len(said):
                        return False
                return True

            deadline = time.monotonic() + CHAOS_S
            next_event = time.monotonic() + rng.uniform(5, 15)
            while time.monotonic() < deadline:
                i = rng.randrange(CONVERSATIONS)
                session, picture, said = live[i]
                said.append(session.ask(PROMPTS[len(said)], max_new_tokens=TOKENS).text)
                counts["answers"] += 1
                if len(said) == len(PROMPTS):  # done: its answers checked, closed, replaced
                    assert said == reference.answers(picture, PROMPTS, TOKENS)
                    session.close()
                    closed.append(session.id)
                    counts["closed"] += 1
                    live[i] = opened()
                if time.monotonic() < next_event:
                    continue
                k = rng.randrange(2)
                if rng.random() < 0.5:
                    slots[k].stop(drain_s=60)  # SIGTERM: drains, flushes, stops
                    counts["stopped"] += 1
                else:
                    wait_for(settled, "the last finished turns in the store", STORE_WAIT_S)
                    kill_instance(slots[k])  # a lost host
                    counts["killed"] += 1
                slots[k] = fresh()
                runtime.replace(k, slots[k].url())
                counts["replaced"] += 1
                next_event = time.monotonic() + rng.uniform(5, 15)
            for _, picture, said in live:
                assert said == reference.answers(picture, PROMPTS[: len(said)], TOKENS)
            wait_for(
                lambda: all((o := stored.read(sid)) is not None and o.closed for sid in closed),
                "every closed conversation's tombstone",
                STORE_WAIT_S,
            )
    finally:
        for ts in slots:
            ts.stop()
    print(
        f"\nchaos for {CHAOS_S:.0f} s: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
    )
    assert counts["stopped"] + counts["killed"] >= 1 and counts["closed"] >= 1
