"""A service of the launcher's: a TCP server on one address that answers only holders of the job's key
(secret.Channel), each connection in a thread of its own, at most `max_connections` at once, every read
bounded by a timeout; and the client's side, one request and its answer. No TensorFlow here."""

from __future__ import annotations

import socket
import struct
import threading
from typing import Any

from tf_adasum.launch.secret import AuthenticationError, Channel

# How long a peer may take to prove the key, and then to send its request.
HANDSHAKE_SECONDS = 5.0


class Service:
    """Listens on `address` (port 0: any free one); a subclass answers each authenticated connection in
    handle(). A connection beyond `max_connections` at once is closed before anything is read from it."""

    def __init__(self, address: str, key: str, max_connections: int, name: str) -> None:
        self.key = key
        self.listener = socket.create_server((address, 0))
        self.address = f"{address}:{self.listener.getsockname()[1]}"
        self._slots = threading.BoundedSemaphore(max_connections)
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name=name).start()

    def handle(self, channel: Channel) -> bool:
        """Answers one authenticated connection; returns whether the subclass keeps it (then it is the
        subclass's to close, and no longer counts among the service's connections)."""
        raise NotImplementedError

    def _accept(self) -> None:
        while not self._closed:
            try:
                connection, _ = self.listener.accept()
            except OSError:
                return
            if not self._slots.acquire(blocking=False):
                connection.close()
                continue
            threading.Thread(target=self._serve, args=(connection,), daemon=True).start()

    def _serve(self, connection: socket.socket) -> None:
        kept = False
        try:
            connection.settimeout(HANDSHAKE_SECONDS)
            channel = Channel.accept(connection, self.key)
            kept = self.handle(channel)
        except (OSError, ValueError):  # AuthenticationError among them: a stranger, closed
            pass
        finally:
            self._slots.release()
            if not kept:
                connection.close()

    def close(self) -> None:
        self._closed = True
        self.listener.close()


def connect(address: str, key: str, timeout: float) -> Channel:
    """An authenticated channel to the service at `address` (host:port); `timeout` bounds every read.

    Raises:
        AuthenticationError: what answers there does not hold the job's key.
        OSError: nothing answers, or not in time.
    """
    host, _, port = address.rpartition(":")
    connection = socket.create_connection((host, int(port)), timeout=timeout)
    try:
        return Channel.connect(connection, key)
    except BaseException:
        connection.close()
        raise


def ask(
    address: str, key: str, request: dict[str, Any], timeout: float, max_blob: int = 0
) -> tuple[dict[str, Any], bytes]:
    """Sends `request` to the service at `address` and returns its answer and blob.

    Raises:
        AuthenticationError: the service is not this job's, or its answer was altered.
        OSError: it did not answer within `timeout` seconds a read.
    """
    channel = connect(address, key, timeout)
    try:
        channel.send(request)
        return channel.receive(max_blob)
    finally:
        channel.close()


def peer_credentials(connection: socket.socket) -> tuple[int, int]:
    """The (pid, uid) of the process at the other end of a Unix socket, as the kernel saw it connect."""
    pid_uid_gid = connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _ = struct.unpack("3i", pid_uid_gid)
    return pid, uid


__all__ = ["AuthenticationError", "Channel", "Service", "ask", "connect", "peer_credentials"]
