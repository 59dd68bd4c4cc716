"""Response: one whole answer as a transport saw it (status, headers, body bytes)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from llava.api.headers import header


@dataclass
class Response:
    """One whole answer as the transport saw it: status, headers and body bytes.

    `raw` is the transport's own object (an `httpx.Response`, boto3's response dict, or the
    botocore exception a SageMaker `ModelError` came in).
    """

    status: int
    headers: Mapping[str, str]
    body: bytes
    raw: Any = field(default=None, repr=False)

    def header(self, name: str) -> str | None:
        """Look a header up case-insensitively."""
        return header(self.headers, name)
