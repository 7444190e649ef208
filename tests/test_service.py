"""A launcher's service (tf_adasum/launch/service.py): it reads at most a handshake's bytes from a peer that
has not proved the job's key, ends a silent one after HANDSHAKE_SECONDS, and holds at most
`max_connections` at once, closing the rest before reading anything."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from tests.support.services import flooded
from tf_adasum.launch import service
from tf_adasum.launch.secret import Channel, new_secret
from tf_adasum.launch.service import Service, ask


class Echo(Service):
    """Answers each request with itself, after `hold` seconds."""

    def __init__(self, max_connections: int, hold: float = 0.0) -> None:
        self.hold = hold
        super().__init__("127.0.0.1", new_secret(), max_connections, "test-echo")

    def handle(self, channel: Channel) -> bool:
        request, _ = channel.receive()
        time.sleep(self.hold)
        channel.send(request)
        return False


def _silent(address: str) -> socket.socket:
    host, _, port = address.rpartition(":")
    return socket.create_connection((host, int(port)), timeout=30)


def _closed_within(connection: socket.socket, seconds: float) -> bool:
    """Whether the service closes `connection` within `seconds` (after its greeting, if any)."""
    connection.settimeout(seconds)
    try:
        while connection.recv(4096):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        pass
    return True


def test_a_silent_peer_is_closed_after_the_handshakes_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """200 half-sent requests held 200 threads of the old notice service, for ever."""
    monkeypatch.setattr(service, "HANDSHAKE_SECONDS", 0.5)
    echo = Echo(max_connections=8)
    try:
        silent = _silent(echo.address)
        assert _closed_within(silent, 5)
        assert ask(echo.address, echo.key, {"n": 1}, timeout=10) == ({"n": 1}, b"")
    finally:
        echo.close()


def test_connections_past_the_cap_are_closed_before_anything_is_read() -> None:
    echo = Echo(max_connections=4, hold=2.0)
    try:
        held = [threading.Thread(target=ask, args=(echo.address, echo.key, {"n": n}, 30)) for n in range(4)]
        for thread in held:
            thread.start()
        time.sleep(0.5)  # four requests held: the cap
        past = _silent(echo.address)
        assert _closed_within(past, 1), "a fifth connection is closed at once, not served"
        for thread in held:
            thread.join(30)
        # Slots free again once answered: the service goes on.
        assert ask(echo.address, echo.key, {"n": 5}, timeout=10) == ({"n": 5}, b"")
    finally:
        echo.close()


def test_a_stranger_is_read_no_further_than_the_handshake() -> None:
    echo = Echo(max_connections=8)
    try:
        assert flooded(echo.address) < 16 << 20
    finally:
        echo.close()
