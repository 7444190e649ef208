"""A stranger at a launcher's service, for the tests: what a flood of bytes without the key gets in."""

from __future__ import annotations

import socket


def flooded(address: str) -> int:
    """How much of a 64 MiB hello the service takes from a stranger that cannot prove the key (the
    pool's old hello was a length-prefixed message of up to 4 GiB, read whole before its secret was
    checked: 400 MiB took the launcher from 24 to 424 MiB)."""
    host, _, port = address.rpartition(":")
    sent = 0
    with socket.create_connection((host, int(port)), timeout=10) as stranger:
        chunk = b"\xff" * (1 << 20)
        try:
            # At once, the greeting unread: a wrong proof, or a length of 4 GiB where a hello led.
            stranger.sendall(b"\xff\xff\xff\xff" + bytes(44))
            while sent < 64 << 20:
                stranger.sendall(chunk)
                sent += len(chunk)
        except OSError:  # reset: the service closed the connection, the rest unread
            pass
    return sent
