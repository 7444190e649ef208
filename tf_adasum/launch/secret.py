"""The job's key, and what it authenticates: the launcher's messages with its processes, both ways, and
the commit files that a next group unpickles (Horovod's runner/common/util/secret.py and network.py).

The key is a random token made once per job. It reaches each process in its environment (ENV_SECRET),
never on a command line, and never crosses a socket: a connection proves on both sides that it holds
the key (HMAC-SHA256 over two fresh nonces, before any message), then every message carries an HMAC
over the connection's nonces, its direction and its number, so that none can be forged, replayed or
moved to another connection. A service reads at most the handshake's few bytes from a peer that has
not yet proved the key. A commit file carries an HMAC of its bytes, checked before anything unpickles
them. No TensorFlow here.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import socket
import struct
from typing import Any

ENV_SECRET = "TF_ADASUM_ELASTIC_SECRET"  # the job's key, in the environment of every process of the job

_DIGEST = hashlib.sha256
_MAC_BYTES = 32
_NONCE_BYTES = 16
# Sent first by the server: a peer that speaks something else (a port scanner, another version) fails at
# once instead of waiting out the timeout.
_GREETING = b"tf_adasum-1\n"
_FRAME = struct.Struct("!IQ")  # a message's JSON length, then its blob's length
# What an authenticated peer may send in one message's JSON (an environment, an assignment): the blob, a
# commit, has its own bound, set per connection.
MAX_MESSAGE_BYTES = 4 << 20

_SEALED = b"tf_adasum sealed 1\n"


class AuthenticationError(ConnectionError):
    """A peer, or a file, that could not show it came from a holder of the job's key."""


class PeerClosed(ConnectionError):
    """The peer closed the connection before a whole message."""


def new_secret() -> str:
    """A new job key: 256 random bits, as hex."""
    return secrets.token_hex(32)


def _mac(key: str, *parts: bytes) -> bytes:
    digest = hmac.new(key.encode(), digestmod=_DIGEST)
    for part in parts:
        digest.update(part)
    return digest.digest()


def seal(key: str, payload: bytes) -> bytes:
    """`payload` with its authenticator under `key`: what unseal() takes back."""
    return _SEALED + _mac(key, b"sealed", payload) + payload


def unseal(key: str, data: bytes, what: str) -> bytes:
    """The payload of seal()'s `data`, once its authenticator under `key` checks.

    Raises:
        AuthenticationError: `data` was not sealed under `key` (another job's, altered, or never sealed),
            naming `what`; nothing of it is to be trusted.
    """
    if not data.startswith(_SEALED):
        raise AuthenticationError(
            f"{what} does not start as a file sealed by tf_adasum does: refused, not unpickled (expected "
            f"{_SEALED!r} and an authenticator, got {data[: len(_SEALED)]!r})"
        )
    mac, payload = data[len(_SEALED) : len(_SEALED) + _MAC_BYTES], data[len(_SEALED) + _MAC_BYTES :]
    if not hmac.compare_digest(mac, _mac(key, b"sealed", payload)):
        raise AuthenticationError(
            f"{what} was not written under this job's key (its authenticator does not match): it was "
            "altered or replaced, or it is another job's; refused, not unpickled"
        )
    return payload


def _receive_exactly(connection: socket.socket, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = connection.recv(min(left, 1 << 20))
        if not chunk:
            raise PeerClosed(f"the peer closed the connection with {left} of {size} bytes unread")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


class Channel:
    """Messages over a connected socket between two holders of the job's key: a JSON object and an
    optional blob of bytes each, authenticated and in order. Built by accept() (the service's side) or
    connect() (the client's), which first prove the key both ways; the socket's timeout bounds every
    read and write."""

    def __init__(self, connection: socket.socket, key: str, session: bytes, client: bool) -> None:
        self.connection = connection
        self._key = key
        self._session = session
        self._sent = 0
        self._received = 0
        self._out, self._in = (b"c", b"s") if client else (b"s", b"c")

    @classmethod
    def accept(cls, connection: socket.socket, key: str) -> Channel:
        """The service's side of a new connection. Reads at most the client's nonce and proof.

        Raises:
            AuthenticationError: the client does not hold the key.
            OSError: the client closed the connection, or did not answer within the socket's timeout.
        """
        ours = secrets.token_bytes(_NONCE_BYTES)
        connection.sendall(_GREETING + ours)
        answer = _receive_exactly(connection, _NONCE_BYTES + _MAC_BYTES)
        theirs, proof = answer[:_NONCE_BYTES], answer[_NONCE_BYTES:]
        if not hmac.compare_digest(proof, _mac(key, b"client", ours, theirs)):
            raise AuthenticationError("a client that does not hold the job's key: closed, nothing read")
        connection.sendall(_mac(key, b"service", theirs, ours))
        return cls(connection, key, ours + theirs, client=False)

    @classmethod
    def connect(cls, connection: socket.socket, key: str) -> Channel:
        """The client's side of a connection to a service. Reads at most the service's greeting, nonce
        and proof.

        Raises:
            AuthenticationError: what answers is not a service of this job (it does not hold the key).
            OSError: the service closed the connection, or did not answer within the socket's timeout.
        """
        greeting = _receive_exactly(connection, len(_GREETING) + _NONCE_BYTES)
        if not greeting.startswith(_GREETING):
            raise AuthenticationError(
                f"what answers is not a tf_adasum service (expected {_GREETING!r}, got "
                f"{greeting[: len(_GREETING)]!r})"
            )
        theirs, ours = greeting[len(_GREETING) :], secrets.token_bytes(_NONCE_BYTES)
        connection.sendall(ours + _mac(key, b"client", theirs, ours))
        try:
            proof = _receive_exactly(connection, _MAC_BYTES)
        except PeerClosed:
            raise AuthenticationError(
                "the service closed the connection at this side's proof of the key: it holds another key "
                "(not this job's service, or this process not of its job)"
            ) from None
        if not hmac.compare_digest(proof, _mac(key, b"service", ours, theirs)):
            raise AuthenticationError(
                "what answers does not hold the job's key: not this job's service; nothing was sent"
            )
        return cls(connection, key, theirs + ours, client=True)

    def send(self, message: dict[str, Any], blob: bytes = b"") -> None:
        head = json.dumps(message).encode()
        frame = _FRAME.pack(len(head), len(blob))
        mac = _mac(
            self._key, b"message", self._session, self._out, struct.pack("!Q", self._sent), frame, head, blob
        )
        self._sent += 1
        self.connection.sendall(frame + mac + head)
        if blob:
            self.connection.sendall(blob)

    def receive(self, max_blob: int = 0) -> tuple[dict[str, Any], bytes]:
        """The next message and its blob (at most `max_blob` bytes).

        Raises:
            AuthenticationError: the message was altered, replayed or forged, or is larger than allowed.
            OSError: the peer closed the connection, or sent nothing within the socket's timeout.
        """
        frame = _receive_exactly(self.connection, _FRAME.size)
        head_size, blob_size = _FRAME.unpack(frame)
        if head_size > MAX_MESSAGE_BYTES or blob_size > max_blob:
            raise AuthenticationError(
                f"a message of {head_size} + {blob_size} bytes, over the {MAX_MESSAGE_BYTES} + {max_blob} "
                "allowed here: closed"
            )
        mac = _receive_exactly(self.connection, _MAC_BYTES)
        head = _receive_exactly(self.connection, head_size)
        blob = _receive_exactly(self.connection, blob_size) if blob_size else b""
        expected = _mac(
            self._key,
            b"message",
            self._session,
            self._in,
            struct.pack("!Q", self._received),
            frame,
            head,
            blob,
        )
        if not hmac.compare_digest(mac, expected):
            raise AuthenticationError("a message whose authenticator does not match: altered or replayed")
        self._received += 1
        message = json.loads(head)
        if not isinstance(message, dict):
            raise AuthenticationError(f"expected a JSON object, got {type(message).__name__}")
        return message, blob

    def close(self) -> None:
        self.connection.close()
