"""Sessions outlive containers: two containers of one image behind the local SageMaker runtime,
their shared session store on moto's S3 server (each container reaches it on its own loopback,
relayed: no network), an unmodified boto3 `invoke_endpoint` with `SessionId` under the kit's
`SessionClient`. One container is killed mid-answer (`docker kill`); a fresh one starts and the
other is stopped (`docker stop`: it drains and flushes; an update). Every conversation goes on,
and each answer is the engine's own pipeline's over the whole conversation (transformers'
`generate`, or vLLM's offline `generate` run from .venv-vllm), so no finished turn was lost.

The model is a random-weight `tiny-vllm` checkpoint (both engines run it): its sampled answers
run long, so the kill lands mid-answer (the trained `shapes` model ends its answers in a few
tokens, faster than `docker kill` arrives)."""

from __future__ import annotations

import contextlib
import random
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import boto3
import pytest
from containers import IMAGES, Container, docker
from helpers import data_uri, only_tombstones, store_secret_arn, stored_sessions, wait_for
from oracles import pipeline_answers
from relay import Relay, expose

from llava.client import SessionClient
from llava.core.errors import KitError
from llava.fronts.local_runtime.server import LocalRuntime
from llava.fronts.ray.package import write_package
from llava.tools.archive import build_archive
from llava.tools.tiny import build_checkpoint
from llava.tools.tiny.scenes import draw_scene

BUCKET = "endpoint-sessions"
STORE = f"s3://{BUCKET}/llava-endpoint"  # where the containers keep their sessions
STORE_PORT = 9000  # where each container finds the store on its own loopback
PROMPTS = ["What is in this picture?", "Which colours?", "And where?"]
TOKENS = 12
CREDENTIALS = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing"}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    """The checkpoint, and its model data for each front (an S3 prefix's layout)."""
    root = tmp_path_factory.mktemp("durable-model")
    checkpoint = build_checkpoint(root / "tiny-vllm", profile="tiny-vllm")
    data = {
        "torchserve": Path(build_archive(checkpoint, root / "torchserve", name="model")),
        "ray": write_package(checkpoint, root / "ray"),
    }
    return checkpoint, data


@pytest.fixture(scope="module")
def s3_port(moto_port: int) -> int:
    boto3.client(
        "s3", endpoint_url=f"http://127.0.0.1:{moto_port}", region_name="us-east-1", **CREDENTIALS
    ).create_bucket(Bucket=BUCKET)
    return moto_port


# the model name each image's front serves under, which names its sessions' folder in the store
MODEL_NAMES = {"torchserve": "model", "ray": "llava"}


def stored(s3_port: int, sids: Iterable[str] | None = None, model: str = "") -> dict[str, str]:
    """Session id -> ETag of each of `sids` (of `model`) in the store; with none, every
    object's key."""
    client = s3_client(s3_port)
    if sids is None:
        listing = client.list_objects_v2(Bucket=BUCKET).get("Contents", [])
        return {o["Key"]: o["ETag"] for o in listing}
    return stored_sessions(client, BUCKET, STORE, sids, model)


def s3_client(s3_port: int) -> Any:
    return boto3.client(
        "s3", endpoint_url=f"http://127.0.0.1:{s3_port}", region_name="us-east-1", **CREDENTIALS
    )


STORE_WAIT_S = 60  # how long the store may take to show what the containers wrote


class Instance:
    """A container with the shared store's settings, reaching moto through its loopback."""

    def __init__(self, tag: str, model: Path, name: str, engine: str, s3_port: int) -> None:
        env = {
            "LLAVA_SESSION_STORE": STORE,
            "LLAVA_SESSION_STORE_ENDPOINT": f"http://127.0.0.1:{STORE_PORT}",
            # the store's secret in Secrets Manager, as deploy sets it (moto serves it too)
            "LLAVA_SESSION_STORE_SECRET_ID": store_secret_arn(f"http://127.0.0.1:{s3_port}"),
            "AWS_ENDPOINT_URL_SECRETS_MANAGER": f"http://127.0.0.1:{STORE_PORT}",
            "LLAVA_DRAIN_GRACE_S": "20",
            # moto's dummy keys stand in for the instance role SageMaker lends a container
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
        }
        self.container = Container(tag, model, name, engine, env).start()
        pid = int(docker("inspect", "-f", "{{.State.Pid}}", name).strip())
        self.store: Relay = expose(pid, STORE_PORT, ("127.0.0.1", s3_port))
        self.container.wait_healthy()

    def remove(self) -> None:
        self.store.close()
        self.container.remove()


def _long_stream(
    session: Any,
    seed: int,
    answering: threading.Event,
    over: threading.Event,
    failed: list[BaseException],
) -> None:
    """A long sampled side answer (history=False: finished or not, the conversation is left as
    it was), read until the connection breaks (`answering`: a chunk came). Each stream its own
    seed: sampled answers end where they draw the end token, so one seed for all could end
    every one of them early, before the kill."""
    try:
        for _ in session.stream(
            "Tell me more.", max_new_tokens=900, temperature=2.0, seed=seed, history=False
        ):
            answering.set()
    except Exception as error:  # the container is killed under it
        failed.append(error)
    finally:
        over.set()


@pytest.mark.parametrize(("front", "engine"), IMAGES, ids=[f"{f}-{e}" for f, e in IMAGES])
def test_conversations_survive_a_killed_and_a_replaced_container(
    front: str,
    engine: str,
    images: Any,
    model: tuple[Path, dict[str, Path]],
    s3_port: int,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tag = images(front, engine)
    checkpoint, data = model
    name = f"llava-durable-{front}-{engine}"
    instances: list[Instance] = []
    try:
        instances += [Instance(tag, data[front], f"{name}-{i}", engine, s3_port) for i in (0, 1)]
        pictures = []
        for i in range(4):
            picture = draw_scene(random.Random(900 + i), count=2).draw()
            pictures.append(tmp_path / f"scene-{i}.png")
            picture.save(pictures[-1])
        with LocalRuntime([i.container.url for i in instances], name="llava") as runtime:
            monkeypatch.setenv("AWS_ENDPOINT_URL_SAGEMAKER_RUNTIME", runtime.url)
            for key, value in {**CREDENTIALS, "region_name": "us-east-1"}.items():
                env = {"region_name": "AWS_DEFAULT_REGION"}.get(key, key.upper())
                monkeypatch.setenv(env, value)
            monkeypatch.delenv("AWS_PROFILE", raising=False)
            client = SessionClient.for_endpoint("llava")
            from PIL import Image

            sessions = [client.session(image=data_uri(Image.open(p))) for p in pictures]
            said: list[list[str]] = [[] for _ in sessions]

            def turn(n: int) -> None:
                ids = [s.id for s in sessions]
                before = stored(s3_port, ids, MODEL_NAMES[front])
                for mine, session in zip(said, sessions, strict=True):
                    mine.append(session.ask(PROMPTS[n], max_new_tokens=TOKENS).text)
                wait_for(
                    lambda: all(
                        stored(s3_port, ids, MODEL_NAMES[front]).get(i) != before.get(i)
                        for i in ids
                    ),
                    f"turn {n} in the store",
                    STORE_WAIT_S,
                )

            turn(0)
            assert sorted(set(runtime.routes.values())) == [0, 1]  # both instances hold some
            # docker kill, mid-answer: long answers stream on every session of instance 1 (and
            # on spare ones there); the kill comes once one is streaming, and cuts some
            spares = [client.session(image=data_uri(Image.open(pictures[0]))) for _ in range(4)]
            victims = [s for s in sessions + spares if runtime.routes[s.id] == 1]
            answering, failed = threading.Event(), []
            overs = [threading.Event() for _ in victims]
            streamers = [
                threading.Thread(target=_long_stream, args=(victim, 3 + i, answering, over, failed))
                for i, (victim, over) in enumerate(zip(victims, overs, strict=True))
            ]
            for streamer in streamers:
                streamer.start()
            assert answering.wait(120), failed
            docker("kill", instances[1].container.name)
            for streamer in streamers:
                streamer.join(120)
            assert failed, "every answer finished before the kill: nothing was cut"
            turn(1)  # the killed container's conversations resume on the other
            assert {runtime.routes[s.id] for s in sessions} == {0}
            # an update: a fresh container in the killed one's place, the other drains and stops
            instances.append(Instance(tag, data[front], f"{name}-2", engine, s3_port))
            runtime.replace(1, instances[-1].container.url)
            code, seconds = instances[0].container.stop(30)
            assert code == 0 and seconds < 30, instances[0].container.logs()
            turn(2)
            assert {runtime.routes[s.id] for s in sessions} == {1}
            for session in sessions:
                session.close()
            for spare in spares:  # one the kill took before its open was stored is gone
                with contextlib.suppress(KitError):
                    spare.close()
            closed = [s.id for s in sessions + spares]
            wait_for(
                lambda: only_tombstones(
                    s3_client(s3_port), BUCKET, STORE, closed, MODEL_NAMES[front]
                ),
                "the closed sessions' tombstones, and nothing else",
                STORE_WAIT_S,
            )
        assert said == pipeline_answers(engine, checkpoint, pictures, PROMPTS, TOKENS)
    finally:
        for instance in instances:
            instance.remove()
