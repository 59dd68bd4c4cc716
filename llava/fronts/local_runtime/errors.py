"""The local runtime's own refusals (the router's and the gateway's, not a container's)."""

from __future__ import annotations

from typing import Any


class Refusal(Exception):
    """An error the runtime itself answers with (the router's, not the container's)."""

    def __init__(self, status: int, error_type: str, message: str, **fields: Any) -> None:
        super().__init__(message)
        self.status, self.error_type, self.message, self.fields = (
            status,
            error_type,
            message,
            fields,
        )
