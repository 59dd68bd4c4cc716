"""Reach containers on `--network none` without a bridge: sockets made inside a container's
network namespace (setns(2) on a thread of their own), relayed to and from loopback here.

`publish(pid, 8080)` is `docker run -p` without Docker's network: a loopback port here whose
connections reach the container's 8080. `expose(pid, 9000, ("127.0.0.1", moto))` is the other
way: the container's own 127.0.0.1:9000 reaches a server of the test's."""

from __future__ import annotations

import contextlib
import ctypes
import os
import socket
import threading
from collections.abc import Callable

_libc = ctypes.CDLL(None, use_errno=True)
_CLONE_NEWNET = 0x40000000


def network_of(pid: int) -> int:
    """Open process `pid`'s network namespace: the descriptor keeps that namespace, not
    whatever later takes the pid (a dead container's namespace refuses connections)."""
    return os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)


def socket_in(namespace: int) -> socket.socket:
    """Return a TCP socket created inside a network namespace (a `network_of` descriptor)."""
    made: list[socket.socket] = []
    failed: list[BaseException] = []

    def make() -> None:  # setns moves only this thread, which then ends
        try:
            if _libc.setns(namespace, _CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"setns: {os.strerror(err)}")
            made.append(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
        except BaseException as error:
            failed.append(error)

    thread = threading.Thread(target=make)
    thread.start()
    thread.join()
    if failed:
        raise failed[0]
    return made[0]


def _pipe(source: socket.socket, sink: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while chunk := source.recv(1 << 16):
            sink.sendall(chunk)
    with contextlib.suppress(OSError):
        sink.shutdown(socket.SHUT_WR)


class Relay:
    """Accept on `listener`; pipe each connection both ways to a socket from `connect()`."""

    def __init__(
        self, listener: socket.socket, connect: Callable[[], socket.socket], namespace: int
    ) -> None:
        self.listener = listener
        self.connect = connect
        self.namespace = namespace
        self.port: int = listener.getsockname()[1]
        self._open: set[socket.socket] = set()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                near, _ = self.listener.accept()
            except OSError:
                return  # closed
            try:
                far = self.connect()
            except OSError:
                near.close()  # nothing listens there (yet): the client sees the connection end
                continue
            self._open.update((near, far))
            for a, b in ((near, far), (far, near)):
                threading.Thread(target=_pipe, args=(a, b), daemon=True).start()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        for sock in list(self._open):
            with contextlib.suppress(OSError):
                sock.close()
        with contextlib.suppress(OSError):
            os.close(self.namespace)


def publish(pid: int, port: int) -> Relay:
    """A loopback port here whose connections reach `port` on the container's loopback."""
    namespace = network_of(pid)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)

    def connect() -> socket.socket:
        sock = socket_in(namespace)
        try:
            sock.connect(("127.0.0.1", port))
        except OSError:
            sock.close()
            raise
        return sock

    return Relay(listener, connect, namespace)


def expose(pid: int, port: int, target: tuple[str, int]) -> Relay:
    """The container's 127.0.0.1:`port` reaches `target` here."""
    namespace = network_of(pid)
    listener = socket_in(namespace)
    listener.bind(("127.0.0.1", port))
    listener.listen(64)
    return Relay(listener, lambda: socket.create_connection(target, timeout=10), namespace)
