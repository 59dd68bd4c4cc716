"""Resolve image hosts to vetted-able IP addresses within the fetch deadline."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import httpcore

from llava.core.errors import ImageFetchError, KitError
from llava.images.policy import parse_ip
from llava.images.refs import INLINE_HINT

Resolver = Callable[[str, int], list[str]]


def system_resolver(host: str, port: int) -> list[str]:
    """Resolve a host to its TCP addresses with the system resolver, in preference order."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def resolve_host(resolver: Resolver, host: str, port: int, deadline: float) -> list[str]:
    """Resolve `host` within the deadline; an IP literal resolves to itself."""
    if parse_ip(host) is not None:
        return [host.strip("[]")]
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["addresses"] = list(resolver(host, port))
        except BaseException as exc:  # handed to the waiting thread, which re-raises it
            box["error"] = exc

    # getaddrinfo cannot be interrupted and may take far longer than our deadline, so it
    # runs in a daemon thread that we simply stop waiting for.
    worker = threading.Thread(target=run, name="image-dns", daemon=True)
    worker.start()
    worker.join(max(0.0, deadline - time.monotonic()))
    if worker.is_alive():
        raise httpcore.ConnectTimeout(f"resolving {host} did not finish before the deadline")
    error = box.get("error")
    if isinstance(error, KitError):
        raise error
    if isinstance(error, OSError):
        raise ImageFetchError(
            f"could not resolve image host {host!r}; check the URL or {INLINE_HINT}"
        ) from None
    if error is not None:
        raise error
    addresses = [str(a) for a in box.get("addresses") or []]
    if not addresses:
        raise ImageFetchError(
            f"image host {host!r} has no addresses; check the URL or {INLINE_HINT}"
        )
    if any(parse_ip(a) is None for a in addresses):
        # Connecting to a name would let the OS resolve it again, behind our back.
        raise ImageFetchError(f"resolving image host {host!r} gave something not an IP address")
    return addresses
