"""The job's key and what it authenticates (tf_adasum/launch/secret.py): a channel that proves the key
both ways before anything crosses, messages that cannot be forged, altered, replayed or moved, and
sealed files."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from typing import Any

import pytest

from tf_adasum.launch.secret import MAX_MESSAGE_BYTES, AuthenticationError, Channel, new_secret, seal, unseal


class Pair:
    """A client's channel to a service thread, which runs `service(channel)` once it accepted; what the
    service returned or raised is in `results` once join() returns."""

    def __init__(
        self, client_key: str, service_key: str, service: Callable[[Channel], Any] = lambda channel: None
    ) -> None:
        a, b = socket.socketpair()
        a.settimeout(10)
        b.settimeout(10)
        self.results: list[Any] = []

        def serve() -> None:
            try:
                self.results.append(service(Channel.accept(b, service_key)))
            except Exception as error:
                self.results.append(error)
            finally:
                b.close()  # as a service does

        self.thread = threading.Thread(target=serve)
        self.thread.start()
        self.client = Channel.connect(a, client_key)

    def join(self) -> list[Any]:
        self.thread.join(10)
        return self.results


def test_both_sides_prove_the_key_then_exchange_messages_with_a_blob() -> None:
    key = new_secret()
    received: list[Any] = []

    def service(channel: Channel) -> None:
        received.append(channel.receive(max_blob=16))
        channel.send({"ok": 1}, b"x")

    pair = Pair(key, key, service)
    pair.client.send({"ask": "state"}, b"abc")
    assert pair.client.receive(max_blob=1) == ({"ok": 1}, b"x")
    assert pair.join() == [None] and received == [({"ask": "state"}, b"abc")]


def test_a_client_without_the_key_is_refused_having_sent_only_its_proof() -> None:
    with pytest.raises(AuthenticationError, match="it holds another key"):
        Pair(new_secret(), new_secret())


def test_a_service_without_the_key_is_refused_before_the_client_sends_anything() -> None:
    """The server proves the key too: a client never talks to an impostor. Here the impostor accepts
    any proof and answers with one of its own, made without the key."""
    a, b = socket.socketpair()
    a.settimeout(10)
    b.settimeout(10)

    def impostor() -> None:
        b.sendall(b"tf_adasum-1\n" + bytes(16))
        b.recv(48)
        b.sendall(bytes(32))

    thread = threading.Thread(target=impostor)
    thread.start()
    with pytest.raises(AuthenticationError, match="does not hold the job's key: not this job's service"):
        Channel.connect(a, new_secret())
    thread.join(10)
    a.close()
    assert b.recv(1) == b"", "nothing after the proof"


def _recorded(channel: Channel, message: dict[str, Any]) -> bytes:
    """The bytes `channel` would send for `message` (its next message), without sending them."""
    frames: list[bytes] = []
    real = channel.connection
    channel.connection = type("Recorder", (), {"sendall": lambda self, data: frames.append(data)})()  # type: ignore[assignment]
    try:
        channel.send(message)
    finally:
        channel.connection = real
    return b"".join(frames)


def test_a_message_altered_replayed_or_too_large_is_refused() -> None:
    key = new_secret()
    seen: list[Any] = []

    def service(channel: Channel) -> None:
        for _ in range(3):
            try:
                seen.append(channel.receive(max_blob=4))
            except AuthenticationError as error:
                seen.append(str(error))
                return

    # Altered on the way: one bit of the body.
    pair = Pair(key, key, service)
    frame = _recorded(pair.client, {"n": 1})
    pair.client.connection.sendall(frame[:-1] + bytes([frame[-1] ^ 1]))
    pair.join()
    assert seen == ["a message whose authenticator does not match: altered or replayed"]

    # Replayed: the same bytes sent twice; the second is refused (its number is taken).
    seen.clear()
    pair = Pair(key, key, service)
    frame = _recorded(pair.client, {"n": 1})
    pair.client.connection.sendall(frame + frame)
    pair.join()
    assert seen == [({"n": 1}, b""), "a message whose authenticator does not match: altered or replayed"]

    # Too large: refused from its header, before its body is read.
    seen.clear()
    pair = Pair(key, key, service)
    try:
        pair.client.send({"n": 1}, b"12345")
    except BrokenPipeError:  # the service closed the connection at the header, the blob unread
        pass
    pair.join()
    assert seen == [f"a message of 8 + 5 bytes, over the {MAX_MESSAGE_BYTES} + 4 allowed here: closed"]


def test_a_message_cannot_be_moved_to_another_connection() -> None:
    """Each connection's nonces are in every authenticator: a message recorded on one and sent on
    another of the same job is refused."""
    key = new_secret()
    first = Pair(key, key, lambda channel: channel.receive())
    frame = _recorded(first.client, {"ask": "state", "path": "/x"})
    first.client.connection.sendall(frame)
    assert first.join() == [({"ask": "state", "path": "/x"}, b"")]
    second = Pair(key, key, lambda channel: channel.receive())
    second.client.connection.sendall(frame)
    (refused,) = second.join()
    assert isinstance(refused, AuthenticationError), refused


def test_a_sealed_file_opens_under_its_key_alone_and_unaltered() -> None:
    key = new_secret()
    sealed = seal(key, b"payload")
    assert unseal(key, sealed, "f") == b"payload"
    with pytest.raises(AuthenticationError, match="f was not written under this job's key"):
        unseal(new_secret(), sealed, "f")
    with pytest.raises(AuthenticationError, match="altered or replaced"):
        unseal(key, sealed[:-1] + b"P", "f")
    with pytest.raises(AuthenticationError, match="does not start as a file sealed by tf_adasum"):
        unseal(key, b"\x80\x05plain pickle", "f")
