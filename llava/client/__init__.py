"""The session client: open a session on one image, ask about it, close it.

Policy lives in `SessionClient` and `Session` (request bodies, session ids, line buffering of
streamed answers, error mapping); bytes move through a `Transport` behind one seam:
`HttpTransport` talks to TorchServe (or any `/invocations` URL) with httpx, `SageMakerTransport`
to a SageMaker endpoint through boto3's `sagemaker-runtime` client.

    from llava.client import SessionClient

    client = SessionClient.for_url("http://127.0.0.1:8080/predictions/llava")
    # or: SessionClient.for_endpoint("llava")   (boto3; AWS_ENDPOINT_URL_SAGEMAKER_RUNTIME works)
    with client.session(image="examples/sample.png") as s:
        answer = s.ask("What is in the picture?", max_new_tokens=64)
        print(answer.text, answer.usage["generated_tokens"])
        for delta in s.stream("And the colors?"):
            print(delta, end="", flush=True)
        print(s.last_usage)
    # leaving the block closed the session

Errors are the kit's own (`llava.core.errors`): a container's JSON error body becomes the same typed
error on every transport (`SessionExpired`, `SessionBusy`, `CapacityExceeded` with
`retry_after_s`, ...), SageMaker's `ModelError` wrapper included. Failures of the way there are
`TransportError` (no usable answer: connection refused, timeout, unreadable stream) and its
subclass `EndpointError` (the endpoint itself refused: SageMaker's `ValidationError`,
`ModelNotReadyException`, `ServiceUnavailable`, an unknown session id at the router).
Every error raised here carries `err.response` (a `Response`, or None when nothing came back).

    KitError (llava.core.errors)
    └── TransportError (502 transport_error)       .original: the underlying exception
        └── EndpointError (endpoint_error)         .error_code: e.g. "ValidationError"
"""

from __future__ import annotations

from llava.client.errors import EndpointError, ErrorResponse, TransportError, error_for
from llava.client.inline import MAX_INLINE_IMAGE_BYTES, image_ref
from llava.client.lines import ndjson_lines
from llava.client.response import Response
from llava.client.session import Answer, Session, SessionClient
from llava.client.transports import HttpTransport, SageMakerTransport, Transport

__all__ = [
    "MAX_INLINE_IMAGE_BYTES",
    "Answer",
    "EndpointError",
    "ErrorResponse",
    "HttpTransport",
    "Response",
    "SageMakerTransport",
    "Session",
    "SessionClient",
    "Transport",
    "TransportError",
    "error_for",
    "image_ref",
    "ndjson_lines",
]
