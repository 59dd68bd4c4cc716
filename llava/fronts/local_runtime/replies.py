"""What the local runtime itself answers, in the shapes SageMaker's runtime uses: its own
refusals, a container's error as a `ModelError`, and the headers every reply carries."""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler

from llava.fronts.local_runtime.errors import Refusal

_CORAL = "http://internal.amazon.com/coral/com.amazon.sagemaker/"


@dataclass(frozen=True)
class Replies:
    """Replies on behalf of one endpoint (its name, region and account appear in errors)."""

    name: str
    region: str
    account: str

    def unreachable(self, exc: Exception) -> Refusal:
        """A container that does not answer in time: a ModelError without an
        OriginalStatusCode (SageMaker words it "server error (0)")."""
        message = (
            'Received server error (0) from primary with message "Your invocation timed out '
            f'while waiting for a response from container primary." ({type(exc).__name__})'
        )
        return Refusal(424, "ModelError", message, LogStreamArn=self.log_stream_arn())

    def log_stream_arn(self) -> str:
        return (
            f"arn:aws:logs:{self.region}:{self.account}:log-group:/aws/sagemaker/Endpoints/"
            f"{self.name}"
        )

    def model_error(self, h: BaseHTTPRequestHandler, status: int, content: bytes) -> None:
        """A container's 4xx or 5xx, as InvokeEndpoint reports it (424 ModelError)."""
        text = content.decode("utf-8", "replace")
        kind = "client" if status < 500 else "server"
        message = (
            f'Received {kind} error ({status}) from primary with message "{text}". See '
            f"https://{self.region}.console.aws.amazon.com/cloudwatch/home?region={self.region}"
            f"#logEventViewer:group=/aws/sagemaker/Endpoints/{self.name} in account "
            f"{self.account} for more information."
        )
        refusal = Refusal(
            424,
            "ModelError",
            message,
            OriginalStatusCode=status,
            OriginalMessage=text,
            LogStreamArn=self.log_stream_arn(),
        )
        self.refuse(h, refusal)

    def refuse(self, h: BaseHTTPRequestHandler, refusal: Refusal, openai: bool = False) -> None:
        """An error in the shape botocore's rest-json parser reads (code in x-amzn-ErrorType);
        on the OpenAI path, in the shape OpenAI clients read (`error.message`)."""
        fields: dict[str, object] = {"Message": refusal.message, **refusal.fields}
        if openai:
            fields = {"error": {"message": refusal.message, "type": refusal.error_type}}
        body = json.dumps(fields).encode()
        headers = {
            "Content-Type": "application/json",
            "x-amzn-ErrorType": f"{refusal.error_type}:{_CORAL}",
        }
        send(h, refusal.status, headers, body)


def common_headers(h: BaseHTTPRequestHandler) -> None:
    h.send_header("x-amzn-RequestId", str(uuid.uuid4()))
    h.send_header("x-Amzn-Invoked-Production-Variant", "AllTraffic")


def send(h: BaseHTTPRequestHandler, status: int, headers: Mapping[str, str], body: bytes) -> None:
    """A whole reply; a client that went away closes the connection, nothing more."""
    try:
        h.send_response(status)
        common_headers(h)
        for key, value in headers.items():
            h.send_header(key, value)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)
        h.wfile.flush()
    except (BrokenPipeError, ConnectionResetError):
        h.close_connection = True
