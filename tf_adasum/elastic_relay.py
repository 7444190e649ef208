"""A warm process of the elastic launcher's pool, as the launcher starts it: `python -m
tf_adasum.elastic_relay`, never by hand. No TensorFlow here: it starts in a fraction of a second.

It asks its host's fork server (tf_adasum/elastic_forkserver.py) for a fork that has TensorFlow, Keras
and tf_adasum imported, hands it its standard streams and environment, and stands for it until it ends:
signals sent to the relay go to the fork, and the relay ends with the fork's exit status (a signal's
too), so that the launcher sees what it would see of a process of its own. Where the fork server does
not answer in FORKSERVER_WAIT_SECONDS, it becomes a warm process that imports everything itself
(`python -m tf_adasum.elastic_standby`), and says so.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time

from tf_adasum.elastic_pool import ENV_FORKSERVER
from tf_adasum.elastic_protocol import receive_message, send_message

# The fork server imports TensorFlow once, 5-15 s, while the first relays wait for it.
FORKSERVER_WAIT_SECONDS = 120.0
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def _connect(name: str) -> socket.socket | None:
    deadline = time.monotonic() + FORKSERVER_WAIT_SECONDS
    while True:
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            connection.connect("\0" + name)
            return connection
        except OSError:
            connection.close()
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)


def _import_it_here(why: str) -> None:
    print(f"tf_adasum.elastic_relay: {why}; this warm process imports TensorFlow itself", file=sys.stderr)
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-m", "tf_adasum.elastic_standby"])


def main() -> int:
    name = os.environ.get(ENV_FORKSERVER, "")
    if not name:
        _import_it_here("no fork server is named")
    connection = _connect(name)
    if connection is None:
        _import_it_here(f"no fork server answered within {FORKSERVER_WAIT_SECONDS:.0f} s")
    assert connection is not None
    try:
        socket.send_fds(connection, [b"F"], [0, 1, 2])
        send_message(connection, {"env": dict(os.environ)})
        answer = receive_message(connection)
    except OSError:
        answer = None
    if answer is None or "pid" not in answer:
        connection.close()
        _import_it_here("the fork server refused or ended")
    assert answer is not None
    pid = int(answer["pid"])

    def forward(number: int, _frame: object) -> None:
        try:
            os.kill(pid, number)
        except ProcessLookupError:
            pass

    for number in FORWARDED_SIGNALS:
        signal.signal(number, forward)
    try:
        ended = receive_message(connection)
    except OSError:
        ended = None
    if ended is None:
        print(f"tf_adasum.elastic_relay: lost the fork server before process {pid} ended", file=sys.stderr)
        return 1
    returncode = int(ended["returncode"])
    if returncode < 0:  # ended by a signal: so does the relay, for the launcher to see
        if -returncode != signal.SIGKILL:
            signal.signal(-returncode, signal.SIG_DFL)  # Python's own ignore SIGPIPE, for one
        os.kill(os.getpid(), -returncode)
        return 128 - returncode  # a signal whose default is not to end (SIGCHLD): as a shell says it
    return returncode


if __name__ == "__main__":
    sys.exit(main())
