"""The deploy exceptions: what a failed deployment step raises."""

from __future__ import annotations


class DeployError(RuntimeError):
    """A deployment step could not be done; the message says what to change."""


class EndpointExistsError(DeployError):
    """The endpoint already exists and `update` was not asked for."""


class DeploymentFailedError(DeployError):
    """SageMaker reported a failure; `reason` is its FailureReason."""

    def __init__(self, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason
