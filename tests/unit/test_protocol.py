"""The wire protocol: request parsing and validation, header lookup, response encodings."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llava.api.dispatch import parse_request
from llava.api.headers import (
    NEW_SESSION,
    SESSION_HEADER,
    expires_header,
    header,
    iso_utc,
    stream_line,
)
from llava.api.openai import ListModels
from llava.api.session_api import CloseSession, Generate, OpenSession, Query
from llava.core.errors import InvalidRequest, KitError, PayloadTooLarge
from llava.core.ids import SESSION_ID_RE, is_valid_session_id
from llava.core.params import MAX_BODY_BYTES, GenerationParams, Limits

SID = "abc-123"
IMAGE = "https://example.com/cat.png"


def sid_headers(sid: str = SID) -> dict[str, str]:
    return {SESSION_HEADER: sid}


def query(**fields: Any) -> dict[str, Any]:
    return {"type": "query", "prompt": "What is this?", **fields}


def rejected(body: Any, headers: dict[str, Any] | None = None, limits: Limits = Limits()) -> Any:
    """Parse a request that must fail; check the error's wire shape and return it."""
    with pytest.raises(InvalidRequest) as info:
        parse_request(body, headers or {}, limits)
    error = info.value
    rendered = error.to_body()
    assert set(rendered) == {"error"}
    assert set(rendered["error"]) == {"code", "message", "field"}
    assert rendered["error"]["code"] == error.code
    assert rendered["error"]["field"] == error.field
    assert isinstance(rendered["error"]["message"], str) and rendered["error"]["message"]
    json.dumps(rendered)  # serializable as a response body
    return error


def assert_field(body: Any, field: str, headers: dict[str, Any] | None = None) -> InvalidRequest:
    error = rejected(body, headers)
    assert error.status == 400
    assert error.code == "invalid_request"
    assert error.field == field
    return error


# -- the three request types ---------------------------------------------------------------


def test_open_session_parses_image_and_system_prompt() -> None:
    request = parse_request(
        {"type": "open_session", "image": IMAGE, "system_prompt": "Be brief."}, {}
    )
    assert request == OpenSession(image=IMAGE, system_prompt="Be brief.")


def test_open_session_without_system_prompt_has_none() -> None:
    assert parse_request({"type": "open_session", "image": IMAGE}, {}).system_prompt is None


def test_query_parses_all_fields() -> None:
    body = query(max_new_tokens=7, temperature=0.5, top_p=0.9, seed=3, stream=True, history=False)
    request = parse_request(body, sid_headers())
    assert request == Query(
        session_id=SID,
        prompt="What is this?",
        params=GenerationParams(max_new_tokens=7, temperature=0.5, top_p=0.9, seed=3),
        stream=True,
        history=False,
    )


def test_query_defaults_come_from_limits() -> None:
    limits = Limits(default_max_new_tokens=33)
    request = parse_request(query(), sid_headers(), limits)
    assert request.params == GenerationParams(max_new_tokens=33, temperature=0.0, top_p=1.0)
    assert request.params.greedy
    assert request.stream is False
    assert request.history is True


def test_query_integer_temperature_becomes_float() -> None:
    request = parse_request(query(temperature=1), sid_headers())
    assert request.params.temperature == 1.0
    assert isinstance(request.params.temperature, float)
    assert not request.params.greedy


def test_query_null_seed_means_no_seed() -> None:
    assert parse_request(query(seed=None), sid_headers()).params.seed is None


def test_close_session_parses() -> None:
    assert parse_request({"type": "close_session"}, sid_headers()) == CloseSession(SID)


def test_missing_type_is_rejected_naming_type() -> None:
    assert_field({"prompt": "hi"}, "type")


@pytest.mark.parametrize("kind", ["delete", "", "QUERY", 3, {"query": 1}, ["query"]])
def test_unknown_type_is_rejected_naming_type(kind: Any) -> None:
    assert_field({"type": kind}, "type")


# -- headers and session ids ---------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [SESSION_HEADER, SESSION_HEADER.lower(), SESSION_HEADER.upper(), "x-AMZN-sagemaker-SESSION-id"],
)
def test_session_header_lookup_is_case_insensitive(name: str) -> None:
    assert parse_request({"type": "close_session"}, {name: SID}).session_id == SID


def test_header_helper_decodes_bytes_and_returns_none_when_absent() -> None:
    assert header({"content-type": b"application/json"}, "Content-Type") == "application/json"
    assert header({"Other": "x"}, SESSION_HEADER) is None


def test_session_header_value_is_stripped() -> None:
    assert parse_request({"type": "close_session"}, {SESSION_HEADER: f"  {SID} "}).session_id == SID


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {SESSION_HEADER: NEW_SESSION},
        {SESSION_HEADER.lower(): NEW_SESSION},
        {SESSION_HEADER: ""},
    ],
)
def test_new_session_header_or_none_means_open(headers: dict[str, str]) -> None:
    assert isinstance(parse_request({"type": "open_session", "image": IMAGE}, headers), OpenSession)


def test_open_with_session_header_is_rejected() -> None:
    assert_field({"type": "open_session", "image": IMAGE}, "session_id", sid_headers())


def test_open_with_body_session_id_is_rejected() -> None:
    assert_field({"type": "open_session", "image": IMAGE, "session_id": SID}, "session_id")


@pytest.mark.parametrize("body", [query(), {"type": "close_session"}])
@pytest.mark.parametrize("headers", [{}, {SESSION_HEADER: NEW_SESSION}])
def test_query_and_close_need_a_session_id(body: dict[str, Any], headers: dict[str, str]) -> None:
    error = assert_field(body, "session_id", headers)
    assert SESSION_HEADER in error.message


def test_body_session_id_alone_is_accepted() -> None:
    assert parse_request({"type": "close_session", "session_id": SID}, {}).session_id == SID


def test_body_session_id_matching_header_is_accepted() -> None:
    request = parse_request(query(session_id=SID), sid_headers())
    assert request.session_id == SID


def test_body_session_id_must_match_header() -> None:
    assert_field(query(session_id="other-id"), "session_id", sid_headers())


def test_body_session_id_must_be_a_string() -> None:
    assert_field(query(session_id=123), "session_id")


@pytest.mark.parametrize(
    "sid",
    [
        "a_b",
        "a.b",
        "-ab",
        "ab-",
        "a b",
        "a/b",
        "ä",
        "a" * 257,
        "NEW-SESSION;x",
        "abc; Expires=2030-01-01T00:00:00Z",
    ],
)
@pytest.mark.parametrize("where", ["header", "body"])
def test_malformed_session_ids_are_rejected(sid: str, where: str) -> None:
    body, headers = {"type": "close_session"}, {}
    if where == "header":
        headers = {SESSION_HEADER: sid}
    else:
        body["session_id"] = sid
    error = assert_field(body, "session_id", headers)
    assert "malformed" in error.message
    assert not is_valid_session_id(sid)


def test_empty_body_session_id_is_malformed() -> None:
    assert (
        "malformed"
        in assert_field({"type": "close_session", "session_id": ""}, "session_id").message
    )


@pytest.mark.parametrize("sid", ["a", "Z", "7", "a" * 256, "a-b", "a--b", "a-b-c", "9---Z", "A1b2"])
def test_valid_session_ids_are_accepted(sid: str) -> None:
    assert is_valid_session_id(sid)
    assert parse_request({"type": "close_session"}, {SESSION_HEADER: sid}).session_id == sid
    assert parse_request({"type": "close_session", "session_id": sid}, {}).session_id == sid


@given(st.from_regex(r"\A[a-zA-Z0-9](-*[a-zA-Z0-9])*\Z").filter(lambda s: len(s) <= 256))
@settings(max_examples=100, deadline=None)
def test_every_id_matching_the_pattern_is_accepted(sid: str) -> None:
    assert parse_request({"type": "close_session"}, {SESSION_HEADER: sid}).session_id == sid


def test_session_id_with_trailing_newline_is_rejected() -> None:
    assert not is_valid_session_id("abc\n")
    assert_field({"type": "close_session", "session_id": "abc\n"}, "session_id")


# -- fields --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"type": "open_session", "image": IMAGE, "prompt": "x"}, "prompt"),
        ({"type": "open_session", "image": IMAGE, "zzz": 1, "aaa": 2}, "aaa"),
        (query(images=[IMAGE]), "images"),
        (query(temprature=0.5), "temprature"),
        ({"type": "close_session", "prompt": "bye"}, "prompt"),
    ],
)
def test_unknown_fields_are_rejected_naming_the_field(body: dict[str, Any], field: str) -> None:
    headers = {} if body["type"] == "open_session" else sid_headers()
    error = assert_field(body, field, headers)
    assert repr(field) in error.message


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_new_tokens", True),
        ("max_new_tokens", False),
        ("max_new_tokens", 1.0),
        ("max_new_tokens", "10"),
        ("max_new_tokens", None),
        ("max_new_tokens", 0),
        ("max_new_tokens", -1),
        ("max_new_tokens", 1025),
        ("temperature", "0.5"),
        ("temperature", True),
        ("temperature", -0.1),
        ("temperature", 2.5),
        ("temperature", None),
        ("temperature", [0.5]),
        ("top_p", 0),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_p", -1),
        ("top_p", "1"),
        ("seed", -1),
        ("seed", 1.5),
        ("seed", True),
        ("seed", "7"),
        ("seed", 2**63),
        ("stream", "yes"),
        ("stream", 1),
        ("stream", None),
        ("history", "false"),
        ("history", 0),
        ("prompt", 5),
        ("prompt", ["hi"]),
        ("prompt", None),
        ("prompt", ""),
        ("prompt", "   \n\t"),
        ("prompt", "x" * 16_001),
    ],
)
def test_bad_query_field_values_are_rejected(field: str, value: Any) -> None:
    assert_field(query(**{field: value}), field, sid_headers())


@pytest.mark.parametrize(
    ("field", "literal"),
    [
        ("temperature", "NaN"),
        ("temperature", "Infinity"),
        ("temperature", "-Infinity"),
        ("top_p", "NaN"),
        ("top_p", "Infinity"),
        ("max_new_tokens", "NaN"),
        ("max_new_tokens", "Infinity"),
        ("seed", "NaN"),
        ("max_new_tokens", "1e3"),
    ],
)
def test_non_finite_json_numbers_are_rejected(field: str, literal: str) -> None:
    body = f'{{"type": "query", "prompt": "hi", "{field}": {literal}}}'.encode()
    assert_field(body, field, sid_headers())


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_new_tokens", 1),
        ("max_new_tokens", 1024),
        ("temperature", 0),
        ("temperature", 2.0),
        ("top_p", 1e-6),
        ("top_p", 1),
        ("seed", 0),
        ("seed", 2**63 - 1),
    ],
)
def test_boundary_query_values_are_accepted(field: str, value: Any) -> None:
    assert isinstance(parse_request(query(**{field: value}), sid_headers()), Query)


def test_prompt_at_the_char_limit_is_accepted() -> None:
    limits = Limits(max_prompt_chars=10)
    assert parse_request(query(prompt="x" * 10), sid_headers(), limits).prompt == "x" * 10
    with pytest.raises(InvalidRequest) as info:
        parse_request(query(prompt="x" * 11), sid_headers(), limits)
    assert info.value.field == "prompt"


def test_max_new_tokens_limit_comes_from_limits() -> None:
    limits = Limits(max_new_tokens=8, default_max_new_tokens=4)
    assert parse_request(query(max_new_tokens=8), sid_headers(), limits).params.max_new_tokens == 8
    with pytest.raises(InvalidRequest) as info:
        parse_request(query(max_new_tokens=9), sid_headers(), limits)
    assert info.value.field == "max_new_tokens"


@pytest.mark.parametrize("value", ["", "  ", 5, {"url": IMAGE}])
def test_bad_open_image_is_rejected_naming_image(value: Any) -> None:
    assert_field({"type": "open_session", "image": value}, "image")


@pytest.mark.parametrize("image", [{}, {"image": None}])
def test_a_session_may_open_without_an_image(image: dict[str, Any]) -> None:
    request = parse_request(json.dumps({"type": "open_session", **image}).encode(), {})
    assert isinstance(request, OpenSession) and request.image is None


@pytest.mark.parametrize("value", [5, ["x"], "x" * 8_001])
def test_bad_system_prompt_is_rejected(value: Any) -> None:
    assert_field({"type": "open_session", "image": IMAGE, "system_prompt": value}, "system_prompt")


def test_empty_system_prompt_is_allowed() -> None:
    assert (
        parse_request(
            {"type": "open_session", "image": IMAGE, "system_prompt": ""}, {}
        ).system_prompt
        == ""
    )


# -- bodies --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "encode", [lambda s: s, str.encode, lambda s: bytearray(s.encode()), json.loads]
)
def test_str_bytes_bytearray_and_dict_bodies_parse_alike(encode: Any) -> None:
    text = json.dumps(query(prompt="Qué es?"), ensure_ascii=False)
    request = parse_request(encode(text), sid_headers())
    assert request.prompt == "Qué es?"


def test_body_over_the_byte_limit_is_413() -> None:
    limits = Limits(max_body_bytes=100)
    body = json.dumps(query(prompt="x" * 200)).encode()
    error = rejected(body, sid_headers(), limits)
    assert isinstance(error, PayloadTooLarge)
    assert (error.status, error.code, error.field) == (413, "payload_too_large", "body")
    assert "100" in error.message


def test_body_exactly_at_the_byte_limit_is_accepted() -> None:
    body = json.dumps(query(prompt="x")).encode()
    limits = Limits(max_body_bytes=len(body))
    assert isinstance(parse_request(body, sid_headers(), limits), Query)
    assert isinstance(
        rejected(body + b" ", sid_headers(), Limits(max_body_bytes=len(body))), PayloadTooLarge
    )


def test_default_byte_limit_is_six_mib() -> None:
    body = b'{"type": "open_session", "image": "' + b"A" * MAX_BODY_BYTES + b'"}'
    error = rejected(body)
    assert error.status == 413
    assert MAX_BODY_BYTES == 6 * 1024 * 1024


@pytest.mark.parametrize(
    "body",
    [
        b"{not json",
        b'{"type": "query",}',
        "{'type': 'query'}",
        b"\xff\xfe\xfa",
        b'{"type": "\xff"}',
    ],
)
def test_invalid_json_is_rejected_naming_body(body: Any) -> None:
    assert "JSON" in assert_field(body, "body").message


@pytest.mark.parametrize(
    "body", [b"[]", b'[{"type": "query"}]', b"3", b'"query"', b"null", b"true"]
)
def test_non_object_json_is_rejected_naming_body(body: bytes) -> None:
    assert_field(body, "body")


@pytest.mark.parametrize("body", [None, b"", "", 42, 4.2, ["query"], object()])
def test_empty_or_non_json_bodies_are_rejected_naming_body(body: Any) -> None:
    assert_field(body, "body", {"Content-Type": "application/json"})


@pytest.mark.parametrize("body", [None, b"", ""])
def test_a_request_with_no_body_and_no_content_type_lists_the_model(body: Any) -> None:
    """What a GET (`/v1/models`) reaches the handler as: TorchServe passes no method or path."""
    assert parse_request(body, {}) == ListModels()


def test_deeply_nested_json_is_a_client_error() -> None:
    assert_field(b"[" * 100_000, "body")


@pytest.mark.parametrize("digits", [4301, 100_000])
def test_integers_over_pythons_digit_limit_are_a_client_error(digits: int) -> None:
    """json.loads raises a plain ValueError for them (not JSONDecodeError): once a 500."""
    body = b'{"type": "query", "prompt": "x", "max_new_tokens": 1' + b"0" * digits + b"}"
    assert_field(body, "body", sid_headers())


def test_a_decoded_body_over_the_declared_limit_is_413() -> None:
    """TorchServe decodes JSON bodies up to its own, higher limit: Content-Length tells."""
    limits = Limits(max_body_bytes=100)
    headers = {**sid_headers(), "content-length": "101"}
    error = rejected(query(), headers, limits)
    assert (error.status, error.field) == (413, "body")
    assert isinstance(parse_request(query(), {**headers, "content-length": "100"}, limits), Query)
    assert isinstance(parse_request(query(), {**sid_headers(), "Content-Length": "x"}), Query)


@pytest.mark.parametrize("content_type", ["application/json", "Application/JSON; charset=utf-8"])
def test_a_json_string_body_is_not_decoded_twice(content_type: str) -> None:
    """TorchServe hands a decoded JSON string over as str: it is not an object."""
    text = json.dumps(query())
    assert_field(text, "body", {**sid_headers(), "Content-Type": content_type})
    # The same text sent as text/plain (TorchServe decodes it to str) is a JSON object.
    assert isinstance(parse_request(text, {**sid_headers(), "Content-Type": "text/plain"}), Query)


# -- property: nothing but a KitError ever escapes -----------------------------------------

FIELDS = [
    "type",
    "session_id",
    "image",
    "system_prompt",
    "prompt",
    "max_new_tokens",
    "temperature",
    "top_p",
    "seed",
    "stream",
    "history",
]
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
    | st.sampled_from(
        ["open_session", "query", "close_session", "generate", SID, NEW_SESSION, IMAGE]
    ),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3)
    ),
    max_leaves=8,
)
bodies = st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=8), json_values, max_size=8)
header_maps = st.dictionaries(
    st.sampled_from([SESSION_HEADER, SESSION_HEADER.lower(), "Content-Type", "x"]),
    st.sampled_from([SID, NEW_SESSION, "", "a_b", "x" * 300]) | st.text(max_size=10),
    max_size=3,
)


def parses_or_kit_error(body: Any, headers: dict[str, Any]) -> None:
    try:
        request = parse_request(body, headers)
    except KitError as exc:
        assert 400 <= exc.status < 500
        json.dumps(exc.to_body())
    else:
        assert isinstance(request, (OpenSession, Query, CloseSession, Generate, ListModels))


@given(bodies, header_maps)
@settings(max_examples=300, deadline=None)
def test_arbitrary_dict_bodies_raise_only_kit_errors(
    body: dict[str, Any], headers: dict[str, Any]
) -> None:
    parses_or_kit_error(body, headers)


@given(bodies, header_maps)
@settings(max_examples=150, deadline=None)
def test_arbitrary_json_bodies_raise_only_kit_errors(
    body: dict[str, Any], headers: dict[str, Any]
) -> None:
    parses_or_kit_error(json.dumps(body).encode(), headers)


@given(st.binary(max_size=200) | st.text(max_size=200), header_maps)
@settings(max_examples=200, deadline=None)
def test_arbitrary_bytes_raise_only_kit_errors(body: Any, headers: dict[str, Any]) -> None:
    parses_or_kit_error(body, headers)


# Valid bodies of every type, then one field replaced, added or dropped: reaches the checks
# behind the first one, which random dictionaries rarely get past.
VALID = {
    "open_session": {"type": "open_session", "image": IMAGE, "system_prompt": "Be brief."},
    "query": {
        "type": "query",
        "prompt": "What?",
        "max_new_tokens": 8,
        "temperature": 0.5,
        "top_p": 0.9,
        "seed": 1,
        "stream": False,
        "history": True,
    },
    "close_session": {"type": "close_session"},
    "generate": {
        "type": "generate",
        "image": IMAGE,
        "prompt": "What?",
        "history": [["q", "a"]],
        "max_new_tokens": 8,
    },
}
edge_values = json_values | st.sampled_from(
    [
        "",
        " \n\t",
        "x" * 16_001,
        2**63,
        -(2**63),
        10**400,
        1e308,
        -0.0,
        float("nan"),
        float("inf"),
        [["q", "a", "extra"]],
        [["q", 1]],
        [["q", "a"]] * 65,
    ]
)


@st.composite
def mutated_bodies(draw: Any) -> dict[str, Any]:
    body = dict(VALID[draw(st.sampled_from(sorted(VALID)))])
    for _ in range(draw(st.integers(1, 3))):
        action = draw(st.sampled_from(["replace", "add", "drop"]))
        if action == "drop" and body:
            body.pop(draw(st.sampled_from(sorted(body))))
        else:
            name = draw(st.sampled_from(FIELDS) | st.text(max_size=6))
            body[name] = draw(edge_values)
    return body


@given(mutated_bodies(), header_maps)
@settings(max_examples=400, deadline=None)
def test_mutated_valid_bodies_raise_only_kit_errors(
    body: dict[str, Any], headers: dict[str, Any]
) -> None:
    parses_or_kit_error(body, headers)
    parses_or_kit_error(json.dumps(body).encode(), headers)


@given(
    st.sampled_from(['{"type": "query", "prompt": "x", "seed": %s}', "[%s]", "%s"]),
    st.sampled_from(["NaN", "-Infinity", "1" + "0" * 5000, "1e99999", "[" * 5000, '"\\ud800"']),
)
@settings(max_examples=60, deadline=None)
def test_hostile_json_literals_raise_only_kit_errors(template: str, literal: str) -> None:
    parses_or_kit_error((template % literal).encode(), sid_headers())


# -- response encodings --------------------------------------------------------------------

ISO_Z = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z$")


def test_iso_utc_formats_utc_seconds_with_z() -> None:
    assert iso_utc(0) == "1970-01-01T00:00:00Z"
    assert iso_utc(1_700_000_000.9) == "2023-11-14T22:13:20Z"
    assert ISO_Z.match(iso_utc(4_102_444_800))


def test_expires_header_is_id_then_expires() -> None:
    value = expires_header("abc-1", 1_700_000_000)
    assert value == "abc-1; Expires=2023-11-14T22:13:20Z"
    sid, expires = value.split("; Expires=")
    assert SESSION_ID_RE.match(sid)
    assert ISO_Z.match(expires)


@pytest.mark.parametrize(
    "obj",
    [
        {"text": "hi"},
        {"text": "line1\nline2\r\n"},
        {"text": "ümlaut ✓"},
        {"usage": {"n": 1}, "finish_reason": None},
    ],
)
def test_stream_line_is_one_json_line(obj: dict[str, Any]) -> None:
    line = stream_line(obj)
    assert isinstance(line, bytes)
    assert line.endswith(b"\n")
    assert line.count(b"\n") == 1
    assert json.loads(line) == obj
    assert b": " not in line and b", " not in line  # compact separators


def test_stream_line_keeps_non_ascii_as_utf8() -> None:
    assert stream_line({"text": "é"}) == '{"text":"é"}\n'.encode()


def test_request_type_new_session_opens_with_the_kits_image_field() -> None:
    request = parse_request(json.dumps({"requestType": "NEW_SESSION", "image": "https://x/y"}), {})
    assert request == OpenSession(image="https://x/y")


def test_request_type_close_closes_the_header_session() -> None:
    request = parse_request(json.dumps({"requestType": "CLOSE"}), sid_headers())
    assert request == CloseSession(session_id=SID)


@pytest.mark.parametrize("kind", ["OPEN", "new_session", 3, None])
def test_unknown_request_type_names_the_field(kind: Any) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_request(json.dumps({"requestType": kind}), {})
    assert info.value.field == "requestType"


def test_type_and_request_type_together_are_refused() -> None:
    body = {"type": "close_session", "requestType": "CLOSE"}
    with pytest.raises(InvalidRequest, match="not both"):
        parse_request(json.dumps(body), sid_headers())


def test_the_samples_start_session_opens_from_its_path() -> None:
    request = parse_request(json.dumps({"type": "start_session", "path": "s3://b/k.png"}), {})
    assert request == OpenSession(image="s3://b/k.png")


def test_the_samples_prompt_asks_and_wants_response_text() -> None:
    body = {"type": "send_text_prompt", "session_id": SID, "prompt_text": "What is it?"}
    request = parse_request(json.dumps(body), sid_headers())
    assert isinstance(request, Query)
    assert (request.prompt, request.session_id, request.sample_reply) == ("What is it?", SID, True)
    own = parse_request(json.dumps({"type": "query", "prompt": "What is it?"}), sid_headers())
    assert isinstance(own, Query) and not own.sample_reply


def test_the_samples_bodies_name_their_own_fields_in_errors() -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_request(json.dumps({"type": "send_text_prompt", "session_id": SID}), sid_headers())
    assert info.value.field == "prompt_text"
    with pytest.raises(InvalidRequest, match='takes "path"'):
        parse_request(json.dumps({"type": "start_session", "image": "s3://b/k"}), {})


def test_a_query_may_carry_an_image_to_add_to_the_conversation() -> None:
    request = parse_request(query(image=IMAGE), sid_headers())
    assert isinstance(request, Query) and request.image == IMAGE
    assert parse_request(query(), sid_headers()).image is None
    assert rejected(query(image=["a"]), sid_headers()).field == "image"
