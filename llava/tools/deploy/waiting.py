"""Polling SageMaker: wait for a status to settle, or for a resource to be gone."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from llava.tools.deploy.aws import is_missing
from llava.tools.deploy.errors import DeployError, DeploymentFailedError
from llava.tools.deploy.progress import Progress, format_elapsed


def wait_status(
    describe: Callable[[], dict[str, Any]],
    *,
    what: str,
    status_key: str,
    failed: tuple[str, ...],
    poll_s: float,
    timeout_s: float,
    progress: Progress,
    sleep: Callable[[float], None],
    clock: Callable[[], float],
    hint: str = "",
    busy: tuple[str, ...] = ("Creating", "Updating", "SystemUpdating", "RollingBack"),
) -> dict[str, Any]:
    """Poll until the status leaves `busy`; raise on a failed status or at the deadline."""
    start = clock()
    while True:
        desc = describe()
        status = desc.get(status_key, "?")
        elapsed = clock() - start
        progress(f"{what}: {status} ({format_elapsed(elapsed)} elapsed)")
        if status in failed:
            reason = desc.get("FailureReason") or "SageMaker gave no FailureReason"
            raise DeploymentFailedError(f"{what} is {status}: {reason}{hint}", reason)
        if status not in busy:
            return desc
        if elapsed >= timeout_s:
            raise DeployError(
                f"{what} is still {status} after {format_elapsed(elapsed)}; nothing was deleted"
                + hint
            )
        sleep(poll_s)


def wait_gone(
    describe: Callable[[], Any],
    *,
    what: str,
    poll_s: float,
    timeout_s: float,
    progress: Progress,
    sleep: Callable[[float], None],
    clock: Callable[[], float],
) -> None:
    start = clock()
    while True:
        try:
            desc = describe()
        except Exception as exc:
            if is_missing(exc):
                progress(f"{what}: deleted ({format_elapsed(clock() - start)})")
                return
            raise
        elapsed = clock() - start
        status = desc.get("EndpointStatus") or desc.get("InferenceComponentStatus") or "?"
        progress(f"{what}: {status} ({format_elapsed(elapsed)} elapsed)")
        if elapsed >= timeout_s:
            raise DeployError(f"{what} is still {status} after {format_elapsed(elapsed)}")
        sleep(poll_s)
