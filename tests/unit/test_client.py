"""The session client over a recording fake transport, a stubbed boto3 client, and the
event-stream encoder against botocore's own decoder. No server."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from typing import Any

import boto3
import pytest
from botocore.eventstream import EventStream, EventStreamBuffer
from botocore.exceptions import ClientError, EventStreamError
from botocore.response import StreamingBody
from botocore.stub import Stubber

from llava.api.headers import CLOSED_SESSION_HEADER, NEW_SESSION, NEW_SESSION_HEADER
from llava.client import (
    MAX_INLINE_IMAGE_BYTES,
    Answer,
    EndpointError,
    ErrorResponse,
    Response,
    SageMakerTransport,
    SessionClient,
    TransportError,
    image_ref,
    ndjson_lines,
)
from llava.core.errors import (
    Cancelled,
    CapacityExceeded,
    Draining,
    ImageTooLarge,
    InvalidRequest,
    KitError,
    SessionBusy,
    SessionClosed,
    SessionExpired,
    SessionNotFound,
)
from llava.fronts.local_runtime.eventstream import encode_event, exception_event, payload_part

SID = "0123456789abcdef0123456789abcdef01234567"
EXPIRES = "2031-01-02T03:04:05Z"
USAGE = {"prefill_tokens": 5, "cached_tokens": 40, "generated_tokens": 3, "finish_reason": "length"}


def ok(obj: dict[str, Any], **headers: str) -> Response:
    return Response(200, {"Content-Type": "application/json", **headers}, json.dumps(obj).encode())


def err(status: int, code: str, message: str = "no", **extra: Any) -> Response:
    body = {"error": {"code": code, "message": message, **extra}}
    return Response(status, {"Content-Type": "application/json"}, json.dumps(body).encode())


OPENED = ok(
    {"session_id": SID, "expires_at": EXPIRES},
    **{NEW_SESSION_HEADER: f"{SID}; Expires={EXPIRES}"},
)
CLOSED = ok({"session_id": SID, "closed": True}, **{CLOSED_SESSION_HEADER: SID})


class RecordingTransport:
    """Answers from a script; records every call as (kind, decoded body, session id)."""

    def __init__(self, *script: Any) -> None:
        self.script = list(script)
        self.calls: list[tuple[str, dict[str, Any], str | None]] = []

    def _next(self, kind: str, body: bytes, session_id: str | None) -> Any:
        self.calls.append((kind, json.loads(body), session_id))
        return self.script.pop(0)

    def invoke(self, body: bytes, session_id: str | None) -> Response:
        answer = self._next("invoke", body, session_id)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def invoke_stream(self, body: bytes, session_id: str | None) -> Iterator[bytes]:
        answer = self._next("stream", body, session_id)
        if isinstance(answer, BaseException):
            raise answer
        yield from answer

    def close(self) -> None:
        pass


def test_open_ask_close_send_exact_bodies_and_session_ids():
    answer = ok({"session_id": SID, "text": "a cat", "usage": USAGE})
    t = RecordingTransport(OPENED, answer, answer, CLOSED)
    client = SessionClient(t)
    with client.session(image="https://example.com/cat.png", system_prompt="Be brief.") as s:
        assert s.id == SID and s.expires_at == EXPIRES
        got = s.ask("What is it?", max_new_tokens=8)
        assert got == Answer(text="a cat", usage=USAGE, session_id=SID)
        assert got.finish_reason == "length" and s.last_usage == USAGE
        s.ask("Again", history=False, temperature=0.5, top_p=0.9, seed=3)
    assert t.calls == [
        (
            "invoke",
            {
                "type": "open_session",
                "image": "https://example.com/cat.png",
                "system_prompt": "Be brief.",
            },
            NEW_SESSION,
        ),
        ("invoke", {"type": "query", "prompt": "What is it?", "max_new_tokens": 8}, SID),
        (
            "invoke",
            {
                "type": "query",
                "prompt": "Again",
                "temperature": 0.5,
                "top_p": 0.9,
                "seed": 3,
                "history": False,
            },
            SID,
        ),
        ("invoke", {"type": "close_session"}, SID),
    ]
    assert s.closed


def test_session_id_from_the_body_when_no_header_came_back():
    t = RecordingTransport(ok({"session_id": SID, "expires_at": EXPIRES}), CLOSED)
    with SessionClient(t).session(image="s3://bucket/key.png") as s:
        assert s.id == SID
    assert t.calls[-1] == ("invoke", {"type": "close_session"}, SID)


def test_close_is_idempotent_and_a_closed_session_refuses_use():
    t = RecordingTransport(OPENED, CLOSED)
    with SessionClient(t).session(image="data:image/png;base64,AAAA") as s:
        s.close()
        s.close()
    assert [c[1]["type"] for c in t.calls] == ["open_session", "close_session"]
    with pytest.raises(SessionClosed, match="closed: open a new one"):
        s.ask("still there?")
    with pytest.raises(SessionClosed):
        s.stream("still there?")
    assert len(t.calls) == 2  # nothing was sent


def test_an_error_leaving_the_block_is_not_hidden_by_a_failing_close():
    t = RecordingTransport(OPENED, TransportError("connection refused"))
    with pytest.raises(ValueError, match="boom"), SessionClient(t).session(image="https://x/y.png"):
        raise ValueError("boom")
    assert [c[1]["type"] for c in t.calls] == ["open_session", "close_session"]


def test_close_retries_while_the_session_is_busy_and_ignores_a_gone_session():
    t = RecordingTransport(OPENED, err(409, "session_busy"), CLOSED)
    SessionClient(t).session(image="https://x/y.png").close()
    assert [c[1]["type"] for c in t.calls] == ["open_session", "close_session", "close_session"]
    t = RecordingTransport(OPENED, err(400, "session_expired"))
    SessionClient(t).session(image="https://x/y.png").close()  # gone anyway: no error
    unknown = EndpointError("ValidationError: not found", error_code="ValidationError", status=400)
    t = RecordingTransport(OPENED, unknown)
    SessionClient(t).session(image="https://x/y.png").close()  # the router forgot it: gone
    refused = EndpointError("ServiceUnavailable", error_code="ServiceUnavailable", status=503)
    t = RecordingTransport(OPENED, refused)
    with pytest.raises(EndpointError):
        SessionClient(t).session(image="https://x/y.png").close()


def test_a_session_the_router_forgot_is_resumed_from_the_store_and_asked_again():
    forgot = EndpointError(
        "ValidationError: Session id x is not found, closed or expired.",
        error_code="ValidationError",
        status=400,
    )
    answer = ok({"session_id": SID, "text": "a cat", "usage": USAGE})
    t = RecordingTransport(OPENED, forgot, OPENED, answer, CLOSED)
    with SessionClient(t).session(image="https://x/y.png") as s:
        assert s.ask("What is it?").text == "a cat"
    assert [(c[1]["type"], c[1].get("resume"), c[2]) for c in t.calls] == [
        ("open_session", None, NEW_SESSION),
        ("query", None, SID),
        ("open_session", SID, NEW_SESSION),  # the explicit resume, pinned where it lands
        ("query", None, SID),
        ("close_session", None, SID),
    ]
    t = RecordingTransport(OPENED, err(400, "session_lost"), OPENED, answer, CLOSED)
    with SessionClient(t).session(image="https://x/y.png") as s:
        assert s.ask("What is it?").text == "a cat"  # lost where it was, kept in the store
    assert t.calls[2][1] == {"type": "open_session", "resume": SID}
    other = EndpointError("ValidationError: bad body", error_code="ValidationError", status=400)
    t = RecordingTransport(OPENED, other, CLOSED)
    with SessionClient(t).session(image="https://x/y.png") as s, pytest.raises(EndpointError):
        s.ask("What is it?")  # not about the session: no resume
    assert [c[1]["type"] for c in t.calls] == ["open_session", "query", "close_session"]
    t = RecordingTransport(OPENED, forgot, err(400, "session_not_found"), CLOSED)
    with SessionClient(t).session(image="https://x/y.png") as s, pytest.raises(EndpointError):
        s.ask("What is it?")  # not in the store either: the router's own error stands


@pytest.mark.parametrize(
    ("response", "cls", "status"),
    [
        (err(400, "session_expired"), SessionExpired, 400),
        (err(400, "session_not_found"), SessionNotFound, 400),
        (err(400, "session_closed"), SessionClosed, 400),
        (err(409, "session_busy"), SessionBusy, 409),
        (err(400, "invalid_request", field="prompt"), InvalidRequest, 400),
        (err(499, "cancelled"), Cancelled, 499),
        (Response(503, {}, b'{"code": 503, "type": "ServiceUnavailableException"}'), KitError, 503),
        (Response(502, {}, b"<html>bad gateway</html>"), KitError, 502),
    ],
)
def test_error_bodies_become_typed_errors_that_keep_the_response(response, cls, status):
    t = RecordingTransport(OPENED, response, CLOSED)
    with SessionClient(t).session(image="https://x/y.png") as s, pytest.raises(cls) as info:
        s.ask("hi")
    assert type(info.value) is cls and info.value.status == status
    assert info.value.response is response
    gone = cls in (SessionExpired, SessionNotFound, SessionClosed)
    assert len(t.calls) == (2 if gone else 3)  # a session the server lost is not closed again


def test_capacity_exceeded_carries_retry_after():
    t = RecordingTransport(err(429, "capacity_exceeded", retry_after_s=7))
    with pytest.raises(CapacityExceeded) as info:
        SessionClient(t).session(image="https://x/y.png")
    assert info.value.retry_after_s == 7 and info.value.status == 429
    body = b'{"error": {"code": "capacity_exceeded", "message": "full"}}'
    t = RecordingTransport(Response(429, {"retry-after": "9"}, body))
    with pytest.raises(CapacityExceeded) as info:
        SessionClient(t).session(image="https://x/y.png")
    assert info.value.retry_after_s == 9


STREAM_LINES = [
    {"text": "A "},
    {"text": "red "},
    {"text": "cat, é"},
    {"usage": USAGE, "finish_reason": "length"},
]
STREAM_BYTES = b"".join((json.dumps(o, ensure_ascii=False) + "\n").encode() for o in STREAM_LINES)


def splits(data: bytes, *cuts: int) -> list[bytes]:
    edges = [0, *cuts, len(data)]
    return [data[a:b] for a, b in zip(edges, edges[1:], strict=False)]


def test_ndjson_lines_reassemble_lines_split_anywhere():
    for cut in range(1, len(STREAM_BYTES)):
        assert list(ndjson_lines(splits(STREAM_BYTES, cut))) == STREAM_LINES, cut
    one_byte = [STREAM_BYTES[i : i + 1] for i in range(len(STREAM_BYTES))]
    assert list(ndjson_lines(one_byte)) == STREAM_LINES
    assert list(ndjson_lines([STREAM_BYTES.rstrip(b"\n")])) == STREAM_LINES  # no final newline


def test_stream_yields_deltas_and_sets_last_usage():
    # parts split mid-line (and mid UTF-8 character) and hold several lines each
    parts = splits(STREAM_BYTES, 3, 30, len(STREAM_BYTES) - 4)
    t = RecordingTransport(OPENED, parts, CLOSED)
    with SessionClient(t).session(image="https://x/y.png") as s:
        deltas = list(s.stream("Colors?", max_new_tokens=4))
        assert deltas == ["A ", "red ", "cat, é"]
        assert s.last_usage == USAGE
    assert t.calls[1] == (
        "stream",
        {"type": "query", "prompt": "Colors?", "max_new_tokens": 4, "stream": True},
        SID,
    )


def test_stream_error_line_raises_the_typed_error():
    lines = b'{"text":"A"}\n{"error":{"code":"session_expired","message":"gone"}}\n'
    t = RecordingTransport(OPENED, [lines[:5], lines[5:]])
    s = SessionClient(t).session(image="https://x/y.png")
    got = []
    with pytest.raises(SessionExpired, match="gone"):
        for delta in s.stream("hi"):
            got.append(delta)
    assert got == ["A"] and s.closed


def test_a_whole_answer_that_failed_after_its_head_raises_the_typed_error():
    """TorchServe sends a large whole answer's head with its first token: a later failure comes
    as its error body under 200 (docs/api.md), and is an error all the same."""
    failed = ok({"error": {"code": "draining", "message": "this instance is stopping"}})
    broken = ok({"error": {"code": "internal_error", "message": "see the worker log"}})
    s = SessionClient(RecordingTransport(OPENED, failed, broken)).session(image="https://x/y.png")
    with pytest.raises(Draining, match="stopping"):
        s.ask("hi")
    with pytest.raises(KitError, match="worker log") as caught:
        s.ask("hi")
    assert caught.value.status == 500


def test_stream_error_status_before_the_stream_and_a_truncated_stream():
    t = RecordingTransport(OPENED, ErrorResponse(err(409, "session_busy")), [b'{"text":"A"}\n'])
    s = SessionClient(t).session(image="https://x/y.png")
    with pytest.raises(SessionBusy):
        list(s.stream("hi"))
    assert not s.closed
    with pytest.raises(TransportError, match="before its final usage line"):
        list(s.stream("hi"))


def test_image_ref_reads_local_files_and_refuses_big_ones(tmp_path):
    png = tmp_path / "a.png"
    png.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 10)
    assert image_ref(png).startswith("data:image/png;base64,iVBORw0KGgo")
    assert image_ref(str(png)) == image_ref(png)
    assert image_ref(b"\xff\xd8\xff\xe0").startswith("data:image/jpeg;base64,")
    for ref in ("https://x/y.png", "s3://b/k.png", "data:image/png;base64,AAAA"):
        assert image_ref(ref) == ref
    with pytest.raises(FileNotFoundError):
        image_ref(tmp_path / "missing.jpg")
    big = tmp_path / "big.png"
    with open(big, "wb") as f:
        f.truncate(MAX_INLINE_IMAGE_BYTES + 1)
    with pytest.raises(ImageTooLarge, match="https:// URL or an s3:// URI"):
        image_ref(big)
    assert MAX_INLINE_IMAGE_BYTES > 4_500_000 and MAX_INLINE_IMAGE_BYTES * 4 / 3 < 6 * 2**20


# --------------------------------------------------------------------------- boto3 (stubbed)


@pytest.fixture()
def smr():
    client = boto3.client(
        "sagemaker-runtime",
        region_name="us-east-1",
        aws_access_key_id="test",
        aws_secret_access_key="test",
    )
    with Stubber(client) as stub:
        yield client, stub
        stub.assert_no_pending_responses()


def body(obj: dict[str, Any]) -> StreamingBody:
    data = json.dumps(obj).encode()
    return StreamingBody(io.BytesIO(data), len(data))


def test_sagemaker_transport_sends_new_session_then_the_id(smr):
    client, stub = smr
    stub.add_response(
        "invoke_endpoint",
        {
            "Body": body({"session_id": SID, "expires_at": EXPIRES}),
            "ContentType": "application/json",
            "NewSessionId": f"{SID}; Expires={EXPIRES}",
        },
        {
            "EndpointName": "llava",
            "Body": b'{"type":"open_session","image":"https://x/y.png"}',
            "ContentType": "application/json",
            "Accept": "application/json",
            "SessionId": "NEW_SESSION",
        },
    )
    stub.add_response(
        "invoke_endpoint",
        {"Body": body({"session_id": SID, "text": "hi", "usage": USAGE})},
        {
            "EndpointName": "llava",
            "Body": b'{"type":"query","prompt":"What?"}',
            "ContentType": "application/json",
            "Accept": "application/json",
            "SessionId": SID,
        },
    )
    stub.add_response(
        "invoke_endpoint",
        {"Body": body({"session_id": SID, "closed": True}), "ClosedSessionId": SID},
        {
            "EndpointName": "llava",
            "Body": b'{"type":"close_session"}',
            "ContentType": "application/json",
            "Accept": "application/json",
            "SessionId": SID,
        },
    )
    with SessionClient.for_endpoint("llava", runtime_client=client).session("https://x/y.png") as s:
        assert s.id == SID and s.expires_at == EXPIRES
        assert s.ask("What?").text == "hi"


def test_model_error_is_unwrapped_into_the_containers_typed_error(smr):
    client, stub = smr
    container = {"error": {"code": "invalid_request", "message": '"prompt" is empty'}}
    stub.add_client_error(
        "invoke_endpoint",
        service_error_code="ModelError",
        http_status_code=424,
        service_message="Received client error (400) from primary with message ...",
        modeled_fields={
            "OriginalStatusCode": 400,
            "OriginalMessage": json.dumps({**container, "error": {**container["error"]}}),
            "LogStreamArn": "arn:aws:logs:us-east-1:000000000000:log-group:x",
        },
    )
    transport = SageMakerTransport("llava", client)
    with pytest.raises(InvalidRequest, match="is empty") as info:
        SessionClient(transport)._call({"type": "query", "prompt": " "}, SID)
    assert info.value.status == 400
    assert isinstance(info.value.__cause__, client.exceptions.ModelError)
    assert info.value.response.status == 400
    assert info.value.response.raw is info.value.__cause__


@pytest.mark.parametrize(
    ("code", "status"),
    [("ValidationError", 400), ("ModelNotReadyException", 429), ("ServiceUnavailable", 503)],
)
def test_other_botocore_errors_become_endpoint_errors(smr, code, status):
    client, stub = smr
    stub.add_client_error(
        "invoke_endpoint", service_error_code=code, http_status_code=status, service_message="x"
    )
    with pytest.raises(EndpointError) as info:
        SessionClient.for_endpoint("llava", runtime_client=client).session("https://x/y.png")
    e = info.value
    assert e.error_code == code and e.status == status and isinstance(e, TransportError)
    assert isinstance(e.original, ClientError) and e.__cause__ is e.original
    assert e.response.status == status


class _Raw:
    """What botocore reads an event stream from: `.stream()` yields raw byte chunks."""

    def __init__(self, data: bytes, cuts: list[int]) -> None:
        self.chunks = splits(data, *cuts)

    def stream(self) -> Iterator[bytes]:
        yield from self.chunks

    def close(self) -> None:
        pass


def _event_stream(client: Any, data: bytes, cuts: list[int]) -> EventStream:
    """botocore's own EventStream over `data`, parsed with sagemaker-runtime's model."""
    op = client.meta.service_model.operation_model("InvokeEndpointWithResponseStream")
    shape = op.output_shape.members["Body"]
    from botocore.parsers import create_parser

    parser = create_parser("rest-json")
    return EventStream(_Raw(data, cuts), shape, parser._event_stream_parser, op.name)


def test_encoder_round_trips_through_botocores_decoder():
    headers = {":event-type": "PayloadPart", ":x-bytes": b"\x00\x01", "flag": True, "n": -5}
    msg = encode_event(headers, b"payload")
    buf = EventStreamBuffer()
    for i in range(len(msg)):  # fed a byte at a time
        buf.add_data(msg[i : i + 1])
    (decoded,) = list(buf)
    assert decoded.headers == headers and decoded.payload == b"payload"
    (decoded,) = _decode(payload_part(b'{"text":"x"}\n'))
    assert decoded.headers == {
        ":event-type": "PayloadPart",
        ":content-type": "application/octet-stream",
        ":message-type": "event",
    }


def _decode(data: bytes) -> list[Any]:
    buf = EventStreamBuffer()
    buf.add_data(data)
    return list(buf)


def test_payload_parts_parse_as_botocore_events_and_feed_the_client(smr):
    client, _ = smr
    parts = splits(STREAM_BYTES, 3, 30, len(STREAM_BYTES) - 4)
    frames = b"".join(payload_part(p) for p in parts)
    events = list(_event_stream(client, frames, [7, 50, 51]))
    assert events == [{"PayloadPart": {"Bytes": p}} for p in parts]

    class Runtime:
        def invoke_endpoint_with_response_stream(self, **kwargs: Any) -> dict[str, Any]:
            self.kwargs = kwargs
            return {"Body": _event_stream(client, frames, [len(frames) // 2])}

    runtime = Runtime()
    transport = SageMakerTransport("llava", runtime)
    s = SessionClient(transport)
    lines = list(s._stream({"type": "query", "prompt": "x", "stream": True}, SID))
    assert lines == STREAM_LINES
    assert runtime.kwargs["SessionId"] == SID
    assert runtime.kwargs["Accept"] == "application/x-ndjson"


def test_an_exception_event_raises_in_botocore_and_maps_to_endpoint_error(smr):
    client, _ = smr
    frames = payload_part(b'{"text":"A"}\n') + exception_event(
        "ModelStreamError", "stream broke", ErrorCode="StreamBroken"
    )
    with pytest.raises(EventStreamError) as info:
        list(_event_stream(client, frames, [5]))
    assert info.value.response["Error"] == {"Code": "ModelStreamError", "Message": "stream broke"}

    class Runtime:
        def invoke_endpoint_with_response_stream(self, **kwargs: Any) -> dict[str, Any]:
            return {"Body": _event_stream(client, frames, [])}

    chunks = SageMakerTransport("llava", Runtime()).invoke_stream(b"{}", SID)
    assert next(chunks) == b'{"text":"A"}\n'
    with pytest.raises(EndpointError) as info:
        next(chunks)
    assert info.value.error_code == "ModelStreamError"
