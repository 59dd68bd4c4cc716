"""The local SageMaker runtime in front of two real TorchServes (and of a Ray Serve front with two
replicas, in `make test`'s Ray pass), driven by an unmodified boto3
`sagemaker-runtime` client: sticky sessions, streaming as event-stream frames, the router's
and the container's errors in the shapes botocore parses, and the session client on top."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import boto3
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError
from engine_under_test import least_reused, oracle
from helpers import data_uri, make_image

from llava.client import EndpointError, SessionClient
from llava.core.errors import InvalidRequest
from llava.fronts.local_runtime.server import LocalRuntime

pytestmark = pytest.mark.integration

PROMPTS = ["What is in the picture?", "Which colors?", "Anything else?"]
TOKENS = 8


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    return oracle(tiny_checkpoint)


@pytest.fixture(scope="module")
def runtime(instances) -> Iterator[LocalRuntime]:
    with LocalRuntime([ts.url() for ts in instances], name="llava") as rt:
        yield rt


@pytest.fixture()
def smr(runtime, monkeypatch):
    """A real, unmodified boto3 client pointed at the runtime the way a user would do it."""
    monkeypatch.setenv("AWS_ENDPOINT_URL_SAGEMAKER_RUNTIME", runtime.url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    # boto3 waits 60 s for a reply, as SageMaker does; 12 sessions asking at once of two vLLM
    # engines on 2 shared CPU cores can take longer than a GPU instance would (what is tested
    # here is where each request goes and what it answers, not how fast).
    config = Config(max_pool_connections=16, retries={"total_max_attempts": 1}, read_timeout=300)
    return boto3.client("sagemaker-runtime", region_name="us-east-1", config=config)


def invoke(smr, body: dict[str, Any], session_id: str | None = None) -> dict[str, Any]:
    kwargs = {"SessionId": session_id} if session_id else {}
    out = smr.invoke_endpoint(
        EndpointName="llava",
        Body=json.dumps(body),
        ContentType="application/json",
        Accept="application/json",
        **kwargs,
    )
    out["json"] = json.loads(out["Body"].read())
    return out


def open_session(smr, seed: int) -> str:
    out = invoke(smr, {"type": "open_session", "image": data_uri(make_image(seed))}, "NEW_SESSION")
    sid, expires = out["NewSessionId"].split("; Expires=")
    assert sid == out["json"]["session_id"] and expires == out["json"]["expires_at"]
    return sid


def stream(smr, sid: str | None, body: dict[str, Any]) -> tuple[list[bytes], dict[str, Any]]:
    kwargs = {"SessionId": sid} if sid else {}
    out = smr.invoke_endpoint_with_response_stream(
        EndpointName="llava", Body=json.dumps(body), ContentType="application/json", **kwargs
    )
    parts = [event["PayloadPart"]["Bytes"] for event in out["Body"]]
    return parts, out


def test_many_sessions_stick_to_their_instance(smr, runtime, reference):
    seeds = list(range(40, 52))
    sids = {seed: open_session(smr, seed) for seed in seeds}
    pinned = {seed: runtime.routes[sid] for seed, sid in sids.items()}
    # least-loaded: every instance used
    assert sorted(pinned.values()) == sorted(i % len(runtime.instances) for i in range(12))

    def converse(seed: int) -> list[str]:
        answers = []
        for prompt in PROMPTS:
            out = invoke(
                smr, {"type": "query", "prompt": prompt, "max_new_tokens": TOKENS}, sids[seed]
            )
            assert out["json"]["session_id"] == sids[seed]
            assert runtime.routes[sids[seed]] == pinned[seed]
            answers.append(out["json"]["text"])
        return answers

    with ThreadPoolExecutor(len(seeds)) as pool:
        results = dict(zip(seeds, pool.map(converse, seeds), strict=True))
    for seed, answers in results.items():
        assert answers == reference.answers(make_image(seed), PROMPTS, TOKENS), f"session {seed}"

    for sid in sids.values():
        out = invoke(smr, {"type": "close_session"}, sid)
        assert out["ClosedSessionId"] == sid and "NewSessionId" not in out
    assert not set(sids.values()) & set(runtime.routes)


def test_streaming_yields_ndjson_in_payload_parts(smr, runtime):
    image = data_uri(make_image(60))
    sid = open_session(smr, 60)
    query = {"type": "query", "prompt": "Describe it.", "max_new_tokens": 12}
    parts, out = stream(smr, sid, {**query, "stream": True})
    assert out["ContentType"] == "application/x-ndjson"
    assert "NewSessionId" not in out and "ClosedSessionId" not in out
    assert len(parts) >= 3  # forwarded as the container's chunks came, not as one answer
    lines = [json.loads(line) for line in b"".join(parts).decode().splitlines()]
    assert all(set(line) == {"text"} for line in lines[:-1])
    assert lines[-1]["usage"]["generated_tokens"] >= 1
    streamed = "".join(line["text"] for line in lines[:-1])

    fresh = invoke(smr, {"type": "open_session", "image": image}, "NEW_SESSION")
    fresh_sid = fresh["json"]["session_id"]
    assert invoke(smr, query, fresh_sid)["json"]["text"] == streamed
    for s in (sid, fresh_sid):
        invoke(smr, {"type": "close_session"}, s)


def test_streaming_cannot_open_a_session(smr):
    with pytest.raises(ClientError) as info:
        stream(smr, "NEW_SESSION", {"type": "open_session", "image": data_uri(make_image(1))})
    assert info.value.response["Error"]["Code"] == "ValidationError"
    assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == 400


def test_a_closed_session_id_is_refused_by_the_router(smr, runtime):
    sid = open_session(smr, 61)
    assert invoke(smr, {"type": "close_session"}, sid)["ClosedSessionId"] == sid
    assert sid not in runtime.routes
    for call in (
        lambda: invoke(smr, {"type": "query", "prompt": "hi"}, sid),
        lambda: stream(smr, sid, {"type": "query", "prompt": "hi", "stream": True}),
    ):
        with pytest.raises(ClientError) as info:
            call()
        err = info.value.response
        assert err["Error"]["Code"] == "ValidationError" and sid in err["Error"]["Message"]
        assert err["ResponseMetadata"]["HTTPStatusCode"] == 400


def test_a_container_error_is_a_model_error(smr):
    sid = open_session(smr, 62)
    with pytest.raises(smr.exceptions.ModelError) as info:
        invoke(smr, {"type": "query", "prompt": ""}, sid)
    err = info.value.response
    assert err["ResponseMetadata"]["HTTPStatusCode"] == 424
    assert err["OriginalStatusCode"] == 400
    body = json.loads(err["OriginalMessage"])
    assert body["error"]["code"] == "invalid_request" and body["error"]["field"] == "prompt"
    assert err["LogStreamArn"].startswith("arn:aws:logs:us-east-1:")
    assert "Received client error (400) from primary" in err["Error"]["Message"]
    # a streaming call that fails before its first chunk is a ModelError too
    with pytest.raises(smr.exceptions.ModelError) as info:
        stream(smr, sid, {"type": "query", "prompt": "", "stream": True})
    assert info.value.response["OriginalStatusCode"] == 400
    invoke(smr, {"type": "close_session"}, sid)


def test_an_unknown_endpoint_is_a_validation_error(smr):
    with pytest.raises(ClientError) as info:
        smr.invoke_endpoint(EndpointName="nope", Body=b"{}", SessionId="NEW_SESSION")
    assert info.value.response["Error"]["Code"] == "ValidationError"
    assert "Endpoint nope of account" in info.value.response["Error"]["Message"]


def test_session_client_over_the_runtime(smr, runtime, reference, tmp_path):
    png = tmp_path / "photo.png"
    make_image(63).save(png)
    client = SessionClient.for_endpoint("llava", runtime_client=smr)
    with client.session(image=png) as s:
        assert runtime.routes[s.id] in (0, 1)
        first = s.ask(PROMPTS[0], max_new_tokens=TOKENS)
        assert first.session_id == s.id
        second = "".join(s.stream(PROMPTS[1], max_new_tokens=TOKENS))
        assert s.last_usage["generated_tokens"] >= 1
        assert [first.text, second] == reference.answers(make_image(63), PROMPTS[:2], TOKENS)
        with pytest.raises(InvalidRequest) as info:  # unwrapped from botocore's ModelError
            s.ask(" ")
        assert isinstance(info.value.__cause__, smr.exceptions.ModelError)
        alone = s.ask(PROMPTS[0], max_new_tokens=TOKENS, history=False)
        assert alone.text == first.text
    assert s.id not in runtime.routes
    with pytest.raises(EndpointError) as info:  # the router no longer knows the id
        client._call({"type": "query", "prompt": "hi"}, s.id)
    assert info.value.error_code == "ValidationError" and info.value.status == 400


# --------------------------------------------------------------------------- a fake container


class _Recorder(BaseHTTPRequestHandler):
    """Answers like the AWS sample container (session id in X-Amzn-SageMaker-Session-Id)."""

    protocol_version = "HTTP/1.1"
    seen: list[dict[str, str]] = []
    expires = ""

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        type(self).seen.append(dict(self.headers.items()))
        body = b"{}"
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        if self.headers.get("X-Amzn-SageMaker-Session-Id") == "NEW_SESSION":
            self.send_header("X-Amzn-SageMaker-Session-Id", f"abc-1; Expires={self.expires}")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.mark.parametrize("ttl_s", [3600, -5])
def test_sample_style_session_header_stripped_headers_and_expiry(ttl_s, monkeypatch):
    expires = datetime.now(timezone.utc) + timedelta(seconds=ttl_s)
    _Recorder.seen, _Recorder.expires = [], expires.strftime("%Y-%m-%dT%H:%M:%SZ")
    fake = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    threading.Thread(target=fake.serve_forever, daemon=True).start()
    try:
        with LocalRuntime([f"http://127.0.0.1:{fake.server_address[1]}"]) as rt:
            smr = boto3.client(
                "sagemaker-runtime",
                endpoint_url=rt.url,
                region_name="us-east-1",
                aws_access_key_id="test",
                aws_secret_access_key="test",
            )

            def add_custom_header(request, **_: Any) -> None:
                request.headers["ts_request_sequence_id"] = "custom"

            smr.meta.events.register("before-sign.sagemaker-runtime.*", add_custom_header)
            out = smr.invoke_endpoint(
                EndpointName="llava",
                Body=b"{}",
                ContentType="application/json",
                Accept="application/json",
                CustomAttributes="trace=1",
                SessionId="NEW_SESSION",
            )
            assert out["NewSessionId"] == f"abc-1; Expires={_Recorder.expires}"
            forwarded = {k.lower() for k in _Recorder.seen[0]}
            assert forwarded <= {
                "host",
                "content-type",
                "content-length",
                "accept",
                "accept-encoding",
                "connection",
                "user-agent",
                "x-amzn-sagemaker-session-id",
                "x-amzn-sagemaker-custom-attributes",
            }
            assert "ts_request_sequence_id" not in forwarded and "authorization" not in forwarded
            assert _Recorder.seen[0]["X-Amzn-SageMaker-Custom-Attributes"] == "trace=1"
            if ttl_s > 0:
                smr.invoke_endpoint(EndpointName="llava", Body=b"{}", SessionId="abc-1")
                assert _Recorder.seen[1]["X-Amzn-SageMaker-Session-Id"] == "abc-1"
            else:  # past its Expires, the router no longer knows the session
                with pytest.raises(ClientError) as info:
                    smr.invoke_endpoint(EndpointName="llava", Body=b"{}", SessionId="abc-1")
                assert info.value.response["Error"]["Code"] == "ValidationError"
                assert len(_Recorder.seen) == 1
    finally:
        fake.shutdown()
        fake.server_close()


def test_a_client_leaving_a_stream_early_then_closing(smr, runtime):
    client = SessionClient.for_endpoint("llava", runtime_client=smr)
    s = client.session(image=data_uri(make_image(64)))
    # A very high temperature makes an early end-of-sequence unlikely.
    deltas = s.stream("Go on.", max_new_tokens=400, temperature=2.0, seed=7)
    assert next(deltas)
    deltas.close()  # drops the connection: the runtime drops its own to the container
    s.close()  # retries while the container still counts the answer as running
    assert s.id not in runtime.routes
    with client.session(image=data_uri(make_image(65))) as again:
        assert again.ask("ok?", max_new_tokens=2).session_id == again.id


def test_the_aws_llava_samples_calls_work_unchanged(smr, reference):
    """The AWS sample's notebook code, with only the endpoint name (and an image) changed."""
    image = make_image(64)
    response = smr.invoke_endpoint(
        EndpointName="llava",
        Body=json.dumps({"type": "start_session", "path": data_uri(image)}),
        ContentType="application/json",
        SessionId="NEW_SESSION",
    )
    session_id = json.loads(response["Body"].read())["session_id"]
    assert response["NewSessionId"].startswith(session_id + "; Expires=")
    answers = []
    for prompt in PROMPTS[:2]:
        payload = {"type": "send_text_prompt", "session_id": session_id, "prompt_text": prompt}
        response = smr.invoke_endpoint(
            EndpointName="llava",
            Body=json.dumps(payload),
            ContentType="application/json",
            SessionId=session_id,
        )
        answers.append(json.loads(response["Body"].read())["response_text"])
    # the kit's default answer length: compare with the oracle at the same length
    assert answers == reference.answers(image, PROMPTS[:2], 256)
    response = smr.invoke_endpoint(
        EndpointName="llava",
        Body=json.dumps({"type": "close_session", "session_id": session_id}),
        ContentType="application/json",
        SessionId=session_id,
    )
    assert json.loads(response["Body"].read())["success"] is True
    assert response["ClosedSessionId"] == session_id


def test_aws_request_type_bodies_open_and_close(smr):
    """AWS's containers' convention: requestType NEW_SESSION / CLOSE, same headers and answers."""
    image = data_uri(make_image(65))
    out = invoke(smr, {"requestType": "NEW_SESSION", "image": image}, "NEW_SESSION")
    sid = out["json"]["session_id"]
    assert out["NewSessionId"].startswith(sid + "; Expires=")
    assert invoke(smr, {"type": "query", "prompt": "Hi?", "max_new_tokens": 3}, sid)["json"]["text"]
    closed = invoke(smr, {"requestType": "CLOSE"}, sid)
    assert closed["ClosedSessionId"] == sid and closed["json"]["closed"] is True


def test_chat_completions_with_sticky_sessions_over_boto3(smr, runtime, reference):
    """An OpenAI-style chat re-sent whole each turn, with SageMaker's session ids."""
    image = make_image(120)
    url = data_uri(image)
    prompts = ["What is this?", "Describe the colors.", "Is it big?"]
    past: list[tuple[str, str]] = []
    sid, cached, asked = "NEW_SESSION", [], []
    for prompt in prompts:
        msgs: list[dict[str, Any]] = []
        for i, (question, answer) in enumerate([*past, (prompt, None)]):
            image_part = {"type": "image_url", "image_url": {"url": url}}
            content: Any = [image_part, {"type": "text", "text": question}] if i == 0 else question
            msgs.append({"role": "user", "content": content})
            if answer is not None:
                msgs.append({"role": "assistant", "content": answer})
        out = invoke(
            smr, {"model": "llava", "messages": msgs, "max_tokens": 8, "temperature": 0}, sid
        )
        if sid == "NEW_SESSION":
            sid = out["NewSessionId"].split(";")[0]
        completion = out["json"]
        assert completion["object"] == "chat.completion"
        cached.append(completion["usage"]["prompt_tokens_details"]["cached_tokens"])
        asked.append(completion["usage"]["prompt_tokens"])
        past.append((prompt, completion["choices"][0]["message"]["content"]))
    assert [a for _, a in past] == reference.answers(image, prompts, 8)
    for turn in (1, 2):  # each turn reuses what the one before was asked
        assert cached[turn] >= least_reused(asked[turn - 1]), (cached, asked)
