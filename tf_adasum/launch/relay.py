"""A warm process of the elastic launcher's pool, as the launcher starts it: `python -m
tf_adasum.launch.relay`, never by hand. No TensorFlow here: it starts in a fraction of a second.

It asks its host's fork server (tf_adasum/elastic/forkserver.py) for a fork that has TensorFlow, Keras
and tf_adasum imported, hands it its standard streams and environment, and stands for it until it ends:
signals sent to the relay go to the fork, and the relay ends with the fork's exit status (a signal's
too), so that the launcher sees what it would see of a process of its own. Before it sends anything, it
checks that the server runs as its own user and holds the job's key: a socket name that another user
took is refused. Where no fork server of the job's answers in FORKSERVER_WAIT_SECONDS, it becomes a warm
process that imports everything itself (`python -m tf_adasum.elastic.standby`), and says so. Should the
fork server end while its fork runs, no one could pass the fork's exit status on: the relay kills the
fork and ends with LOST_FORKSERVER_EXIT_CODE, saying so, and the launcher counts the process lost.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import sys
import time

from tf_adasum.launch.elastic.pool import ENV_FORKSERVER
from tf_adasum.launch.secret import ENV_SECRET, Channel
from tf_adasum.launch.service import HANDSHAKE_SECONDS, peer_credentials

# The fork server imports TensorFlow once, 5-15 s, while the first relays wait for it.
FORKSERVER_WAIT_SECONDS = 120.0
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
LOST_FORKSERVER_EXIT_CODE = 1


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
    print(f"tf_adasum.launch.relay: {why}; this warm process imports TensorFlow itself", file=sys.stderr)
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-m", "tf_adasum.elastic.standby"])


def _fork(name: str) -> tuple[Channel, int, int]:
    """A fork of the fork server named `name`, given this process's streams and environment: the channel
    to the server, the server's pid and the fork's. Becomes a warm process of its own (never returns)
    where no fork server of this job's answers."""
    connection = _connect(name)
    if connection is None:
        _import_it_here(f"no fork server answered within {FORKSERVER_WAIT_SECONDS:.0f} s")
    assert connection is not None
    server, uid = peer_credentials(connection)
    if uid != os.getuid():  # someone else took the name: nothing goes to them
        connection.close()
        _import_it_here(
            f"the fork server's socket is held by uid {uid}, not by this job's user ({os.getuid()})"
        )
    try:
        connection.settimeout(HANDSHAKE_SECONDS)
        channel = Channel.connect(connection, os.environ.get(ENV_SECRET, ""))
        socket.send_fds(connection, [b"F"], [0, 1, 2])
        channel.send({"env": {k: v for k, v in os.environ.items() if k != ENV_SECRET}})
        answer, _ = channel.receive()
        connection.settimeout(None)
    except (OSError, ValueError) as error:
        connection.close()
        _import_it_here(f"the fork server refused or ended ({error})")
    if not isinstance(answer.get("pid"), int):
        connection.close()
        _import_it_here(f"the fork server answered {answer!r}")
    return channel, server, int(answer["pid"])


def _exit_status(channel: Channel, server: int, pid: int) -> int | None:
    """The fork's exit status, as the server passes it on (Popen's returncode); None if the server ends
    first."""
    server_ended = os.pidfd_open(server)
    try:
        while True:
            ready, _, _ = select.select([channel.connection.fileno(), server_ended], [], [])
            if (
                channel.connection.fileno() in ready
            ):  # first: the server may have sent it just before it ended
                try:
                    ended, _ = channel.receive()
                except (OSError, ValueError):
                    return None
                return int(ended["returncode"])
            if server_ended in ready:
                return None
    finally:
        os.close(server_ended)


def main() -> int:
    name = os.environ.get(ENV_FORKSERVER, "")
    if not name:
        _import_it_here("no fork server is named")
    channel, server, pid = _fork(name)

    def forward(number: int, _frame: object) -> None:
        try:
            os.kill(pid, number)
        except ProcessLookupError:
            pass

    for number in FORWARDED_SIGNALS:
        signal.signal(number, forward)
    returncode = _exit_status(channel, server, pid)
    if returncode is None:
        try:
            os.killpg(pid, signal.SIGKILL)  # the fork leads a session of its own
        except ProcessLookupError:
            pass
        print(
            f"tf_adasum.launch.relay: the fork server (pid {server}) ended while process {pid} ran; "
            f"{pid} is killed, since no one could pass on how it ends: this member of the group is lost",
            file=sys.stderr,
        )
        return LOST_FORKSERVER_EXIT_CODE
    if returncode < 0:  # ended by a signal: so does the relay, for the launcher to see
        if -returncode != signal.SIGKILL:
            signal.signal(-returncode, signal.SIG_DFL)  # Python's own ignore SIGPIPE, for one
        os.kill(os.getpid(), -returncode)
        return 128 - returncode  # a signal whose default is not to end (SIGCHLD): as a shell says it
    return returncode


if __name__ == "__main__":
    sys.exit(main())
