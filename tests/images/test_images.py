"""Both images (TorchServe and Ray Serve fronts), on both engines (the transformers reference and
vLLM's CPU build of the locked release), built from the repo's Dockerfiles on the stand-in base and
run exactly as SageMaker runs them: `docker run IMAGE serve`, the model data read-only at
/opt/ml/model, no network but the container's own, no AWS variables. Held to SageMaker's
container contract: /ping, /invocations with the session headers, streaming, the 6 MiB body
limit, SIGTERM, and the image's own CLI. (`make test-images`; docs/sagemaker.md.)"""

from __future__ import annotations

import base64
import io
import json
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from containers import IMAGES, Container, docker
from PIL import Image, PngImagePlugin

from llava.api.headers import CLOSED_SESSION_HEADER, NEW_SESSION, NEW_SESSION_HEADER
from llava.api.headers import SESSION_HEADER as SID
from llava.core.paths import SAMPLE_IMAGE
from llava.tools.quickstart import FOLLOW_UP, QUESTION
from llava.tools.tiny.scenes import SAMPLE, colour_answer

MiB = 1024 * 1024
PICTURE = "data:image/png;base64," + base64.b64encode(SAMPLE_IMAGE.read_bytes()).decode()
ANSWERS = (colour_answer(SAMPLE, "circle"), colour_answer(SAMPLE, "square"))
BIDI_LABEL = "com.amazonaws.sagemaker.capabilities.bidirectional-streaming"
TTL_S = 4  # the second container's sessions expire quickly, to see an expired id refused


@dataclass
class Served:
    front: str
    engine: str
    tag: str
    container: Container
    startup: list[tuple[float, Any]] = field(default_factory=list)  # (s, /ping status) until 200
    first_answer: dict[str, Any] = field(default_factory=dict)

    @property
    def invocations(self) -> str:
        return self.container.url + "/invocations"


def _call(
    client: httpx.Client, url: str, body: dict[str, Any], sid: str | None = None
) -> httpx.Response:
    headers = {"Content-Type": "application/json"}
    if sid is not None:
        headers[SID] = sid
    return client.post(url, content=json.dumps(body), headers=headers)


def _watch_start(served: Served) -> None:
    """Poll /ping from the container's start; at its first 200, open a session and ask at once."""
    started = time.monotonic()
    container = served.container
    with httpx.Client(timeout=120) as client:
        while True:
            assert time.monotonic() - started < 600, f"never healthy:\n{container.logs()}"
            if not container.state()["Running"]:
                raise AssertionError(f"{container.name} exited:\n{container.logs()}")
            try:
                status: Any = client.get(container.url + "/ping", timeout=2).status_code
            except httpx.HTTPError as error:
                status = type(error).__name__
            served.startup.append((time.monotonic() - started, status))
            if status == 200:
                break
            time.sleep(0.2)  # a poll interval, not a synchronisation
        asked = time.monotonic()
        opened = _call(client, served.invocations, {"type": "open_session", "image": PICTURE})
        assert opened.status_code == 200, opened.text
        sid = opened.json()["session_id"]
        answer = _call(client, served.invocations, {"type": "query", "prompt": QUESTION}, sid)
        served.first_answer = {
            "status": answer.status_code,
            "text": answer.json().get("text"),
            "seconds": time.monotonic() - asked,
        }
        _call(client, served.invocations, {"type": "close_session"}, sid)


@pytest.fixture(scope="module", params=IMAGES, ids=[f"{f}-{e}" for f, e in IMAGES])
def served(
    request: pytest.FixtureRequest, images: Any, model_data: dict[tuple[str, str], Path]
) -> Iterator[Served]:
    """One image's container, started as SageMaker starts it, on the S3-prefix layout."""
    front, engine = request.param
    tag = images(front, engine)
    container = Container(tag, model_data[front, "prefix"], f"llava-test-{front}-{engine}", engine)
    served = Served(front, engine, tag, container.start())
    try:
        _watch_start(served)
        yield served
    finally:
        container.remove()


def test_ping_is_healthy_only_once_a_question_can_be_answered(served: Served) -> None:
    before = [status for _, status in served.startup[:-1]]
    assert 503 in before, served.startup  # it said so while the model loaded
    assert served.first_answer["status"] == 200 and served.first_answer["text"] == ANSWERS[0]
    # A /ping that said 200 while the model loaded would leave this question queued behind the
    # load (7 s for the transformers engine here, 40 s and more for vLLM's).
    assert served.first_answer["seconds"] < 5, served.startup


def test_sessions_with_sagemaker_s_headers(served: Served) -> None:
    url = served.invocations
    with httpx.Client(timeout=120) as client:
        opened = _call(client, url, {"type": "open_session", "image": PICTURE}, NEW_SESSION)
        assert opened.status_code == 200, opened.text
        sid, expires = opened.headers[NEW_SESSION_HEADER].split("; Expires=")
        assert sid == opened.json()["session_id"] and expires.endswith("Z")
        first = _call(client, url, {"type": "query", "prompt": QUESTION}, sid)
        second = _call(client, url, {"type": "query", "prompt": FOLLOW_UP}, sid)
        assert (first.json()["text"], second.json()["text"]) == ANSWERS
        closed = _call(client, url, {"type": "close_session"}, sid)
        assert closed.status_code == 200 and closed.headers[CLOSED_SESSION_HEADER] == sid
        for stale in (sid, uuid.uuid4().hex):  # closed, and never opened
            refused = _call(client, url, {"type": "query", "prompt": QUESTION}, stale)
            assert 400 <= refused.status_code < 500, refused.text
            assert refused.json()["error"]["message"]


def test_a_streamed_answer_arrives_in_lines_that_make_the_whole(served: Served) -> None:
    url = served.invocations
    with httpx.Client(timeout=120) as client:
        sid = _call(client, url, {"type": "open_session", "image": PICTURE}).json()["session_id"]
        body = {"type": "query", "prompt": QUESTION, "stream": True}
        headers = {"Content-Type": "application/json", SID: sid}
        with client.stream("POST", url, content=json.dumps(body), headers=headers) as response:
            assert response.status_code == 200
            lines = [json.loads(line) for line in response.iter_lines() if line]
        _call(client, url, {"type": "close_session"}, sid)
    assert len(lines) > 1
    assert "".join(line.get("text", "") for line in lines) == ANSWERS[0]
    assert lines[-1]["finish_reason"] == "stop"


@dataclass
class Streamed:
    lines: list[dict[str, Any]] = field(default_factory=list)
    last_at: float = 0.0  # time.monotonic() of the last line
    refused: str = ""  # a request the stopping server did not take: its connection's error


def _stream_until(url: str, sid: str, stop: threading.Event, kept: list[Streamed]) -> None:
    """Stream answers back to back until `stop` or a refusal, keeping each one's lines."""
    body = {"type": "query", "prompt": QUESTION, "temperature": 2.0, "seed": 1, "stream": True}
    body["max_new_tokens"] = 900
    headers = {"Content-Type": "application/json", SID: sid}
    with httpx.Client(timeout=300) as client:
        while not stop.is_set():
            out = Streamed()
            kept.append(out)
            try:
                with client.stream("POST", url, content=json.dumps(body), headers=headers) as r:
                    for line in r.iter_lines():
                        if line:
                            out.lines.append(json.loads(line))
                            out.last_at = time.monotonic()
            except httpx.HTTPError as error:  # the instance is stopping: no new request taken
                out.refused = repr(error)
            if out.refused or not out.lines or "error" in out.lines[-1]:
                return


@dataclass
class Load:
    """Questions asked back to back by several clients until `stop`."""

    stop: threading.Event = field(default_factory=threading.Event)
    answered: int = 0
    in_flight: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def keep_asking(self, url: str, sid: str) -> None:
        body = {"type": "query", "prompt": QUESTION, "temperature": 2.0, "max_new_tokens": 900}
        with httpx.Client(timeout=300) as client:
            while not self.stop.is_set():
                with self.lock:
                    self.in_flight += 1
                ok = _call(client, url, body, sid).status_code == 200
                with self.lock:
                    self.in_flight -= 1
                    self.answered += ok


def test_ping_answers_within_2_s_while_invocations_are_busy(served: Served) -> None:
    url = served.invocations
    with httpx.Client(timeout=120) as client:
        sids = [
            _call(client, url, {"type": "open_session", "image": PICTURE}).json()["session_id"]
            for _ in range(8)
        ]
        load = Load()
        workers = [
            threading.Thread(target=load.keep_asking, args=(url, sid), daemon=True) for sid in sids
        ]
        for worker in workers:
            worker.start()
        pings = []  # (status, seconds, questions in flight when sent and when answered)
        try:
            deadline = time.monotonic() + 120
            while load.answered < 8:  # the load is on
                assert time.monotonic() < deadline, "the questions were not answered"
                time.sleep(0.05)
            for _ in range(10):
                sent, busy_before = time.monotonic(), load.in_flight
                status = client.get(served.container.url + "/ping", timeout=5).status_code
                pings.append((status, time.monotonic() - sent, min(busy_before, load.in_flight)))
        finally:
            load.stop.set()
            for worker in workers:
                worker.join(300)
        for sid in sids:
            _call(client, url, {"type": "close_session"}, sid)
    assert all(status == 200 and seconds < 2 and busy for status, seconds, busy in pings), pings


def _picture_of_size(body_bytes: int) -> dict[str, Any]:
    """An open_session body of exactly `body_bytes`: a PNG padded with a text chunk."""
    base = {"type": "open_session", "image": ""}
    room = body_bytes - len(json.dumps(base)) - len("data:image/png;base64,")
    raw = room * 3 // 4
    pad = 0
    for _ in range(3):  # the chunk's length and the base64 rounding settle in a step or two
        info = PngImagePlugin.PngInfo()
        info.add_text("padding", "x" * pad)
        out = io.BytesIO()
        Image.open(SAMPLE_IMAGE).save(out, format="PNG", pnginfo=info)
        pad += raw - len(out.getvalue())
    info = PngImagePlugin.PngInfo()
    info.add_text("padding", "x" * pad)
    out = io.BytesIO()
    Image.open(SAMPLE_IMAGE).save(out, format="PNG", pnginfo=info)
    base["image"] = "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()
    return base


def test_a_6_mib_body_is_taken_and_a_larger_one_refused_cleanly(served: Served) -> None:
    url = served.invocations
    fits = _picture_of_size(6 * MiB - 64)
    assert 6 * MiB - 100 < len(json.dumps(fits)) <= 6 * MiB
    with httpx.Client(timeout=120) as client:
        taken = _call(client, url, fits)
        assert taken.status_code == 200, taken.text[:300]
        sid = taken.json()["session_id"]
        assert (
            _call(client, url, {"type": "query", "prompt": QUESTION}, sid).json()["text"]
            == (ANSWERS[0])
        )
        _call(client, url, {"type": "close_session"}, sid)
        refused = _call(client, url, _picture_of_size(6 * MiB + 4096))
        assert refused.status_code == 413, refused.text[:300]
        assert str(6 * MiB) in refused.json()["error"]["message"]  # names the limit
        assert client.get(served.container.url + "/ping").status_code == 200  # still serving


def test_the_image_s_cli_works_in_the_image(served: Served) -> None:
    run = docker("exec", served.container.name, "python", "-m", "llava", "--help")
    assert "serve-ray" in run and "archive" in run
    command = "serve-ray" if served.front == "ray" else "archive"
    assert "--model" in docker(
        "exec", served.container.name, "python", "-m", "llava", command, "-h"
    )


def test_sagemaker_s_openai_path_reaches_the_container(served: Served) -> None:
    """The openai SDK on an endpoint's OpenAI-compatible path (bearer token, whole and streamed
    answers) through the local runtime, which hands the chat to the container's /invocations."""
    from helpers import sagemaker_token

    from llava.fronts.local_runtime.server import LocalRuntime

    chat = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": PICTURE}},
                {"type": "text", "text": QUESTION},
            ],
        }
    ]
    with LocalRuntime([served.container.url], credentials={"test": "test"}) as runtime:
        client = openai.OpenAI(
            base_url=f"{runtime.url}/endpoints/llava/openai/v1",
            api_key=sagemaker_token("test", "test", "us-east-1"),
            max_retries=0,
            timeout=120,
        )
        whole = client.chat.completions.create(model="", messages=chat, temperature=0)  # type: ignore[arg-type]
        chunks = client.chat.completions.create(
            model="",
            messages=chat,
            temperature=0,
            stream=True,  # type: ignore[arg-type]
        )
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert whole.choices[0].message.content == streamed == ANSWERS[0]


def test_sagemaker_s_websocket_where_the_label_says(served: Served) -> None:
    """An image labelled for bidirectional streaming holds a session over its WebSocket (the
    kit's client, whole and streamed answers); TorchServe serves none, so its image has no
    label and SageMaker sends it no WebSocket."""
    from llava.client import SessionClient

    labels = json.loads(docker("inspect", "-f", "{{json .Config.Labels}}", served.tag))
    if served.front == "torchserve":
        assert BIDI_LABEL not in labels, labels
        return
    assert labels[BIDI_LABEL] == "true", labels
    client = SessionClient.connect(served.container.url)
    with client, client.session(image=PICTURE) as session:
        first = session.ask(QUESTION).text
        second = "".join(session.stream(FOLLOW_UP))
    assert (first, second) == ANSWERS


def test_no_aws_credentials_or_sdk_variables_reach_the_container(served: Served) -> None:
    env = docker("exec", served.container.name, "env").splitlines()
    leaked = [line.split("=")[0] for line in env if line.startswith(("AWS_", "SAGEMAKER_"))]
    assert leaked == []
    assert "ReadOnly" in docker(
        "inspect",
        "-f",
        "{{range .Mounts}}{{if not .RW}}ReadOnly{{end}}{{end}}",
        served.container.name,
    )


def test_a_model_tar_gz_serves_expires_sessions_and_drains_on_docker_stop(
    served: Served, model_data: dict[tuple[str, str], Path], request: pytest.FixtureRequest
) -> None:
    """A second container on the model.tar.gz layout, sessions living TTL_S: an expired id is
    refused; `docker stop -t 30` mid-answer lets the answer finish and exits 0 in the grace."""
    container = Container(
        served.tag,
        model_data[served.front, "tar.gz"],
        f"llava-test-{served.front}-{served.engine}-tgz",
        served.engine,
        {"LLAVA_SESSION_TTL_S": str(TTL_S)},
    ).start()
    try:
        container.wait_healthy()
        url = container.url + "/invocations"
        with httpx.Client(timeout=120) as client:
            opened = _call(client, url, {"type": "open_session", "image": PICTURE})
            sid = opened.json()["session_id"]
            assert (
                _call(client, url, {"type": "query", "prompt": QUESTION}, sid).json()["text"]
                == ANSWERS[0]
            )
            time.sleep(TTL_S + 1.5)  # the session's time to live: what is tested, not a sync
            expired = _call(client, url, {"type": "query", "prompt": FOLLOW_UP}, sid)
            assert 400 <= expired.status_code < 500, expired.text
        if (served.front, served.engine) == ("ray", "vllm"):  # the layout and expiry hold above
            request.applymarker(
                pytest.mark.xfail(
                    reason="1 run in 3 here cut 4 streamed answers at SIGTERM on Ray with vLLM, "
                    "before the ingress's drain waited for requests still on their way from "
                    "Ray's proxy (SETTLE_S); passed since: kept until more runs confirm",
                    strict=False,
                )
            )
        with httpx.Client(timeout=120) as client:
            sids = [
                _call(client, url, {"type": "open_session", "image": PICTURE}).json()["session_id"]
                for _ in range(8)
            ]
        stop, kept = threading.Event(), []
        threads = [
            threading.Thread(target=_stream_until, args=(url, sid, stop, kept)) for sid in sids
        ]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 120
        while sum(bool(out.lines) for out in kept) < 8:  # answers are streaming back to back
            assert time.monotonic() < deadline, "no answers came"
            time.sleep(0.05)
        stop.set()  # no new requests from here, as SageMaker's router stops sending them
        stopping = time.monotonic()
        code, seconds = container.stop(30)
        for thread in threads:
            thread.join(60)
        assert code == 0, container.logs()
        assert seconds < 30
        begun = [out for out in kept if any("text" in line for line in out.lines)]
        cut = [out.lines[-1] for out in begun if not out.lines[-1].get("finish_reason")]
        assert cut == [], container.logs()  # an answer begun finishes, however the stop came
        assert max(out.last_at for out in begun) > stopping, "no answer was in flight"
        for out in kept:  # one not begun was refused: a 503 `draining`, or no connection
            if out not in begun:
                assert out.refused or out.lines[-1]["error"]["code"] == "draining", out
    finally:
        container.remove()


def test_docker_stop_exits_0_within_the_grace(served: Served) -> None:
    code, seconds = served.container.stop(30)
    assert code == 0, served.container.logs()
    assert seconds < 30
