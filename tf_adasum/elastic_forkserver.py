"""The fork server of the elastic launcher's pool (tf_adasum/elastic_pool.py): `python -m
tf_adasum.elastic_forkserver`, one on each host, started by the launcher, never by hand.

It imports TensorFlow, Keras and tf_adasum once, then forks a warm process for each relay
(tf_adasum/elastic_relay.py) that asks, as Python's multiprocessing forkserver does: the child takes the
relay's standard streams and environment, and goes on as `python -m tf_adasum.elastic_standby` would
once its imports were done. A warm process so costs a fork (milliseconds, its memory shared with this
one until written) instead of an import (13-15 s a process when several start at once on 2 cores), so
the pool refills within a second and a growth finds its processes ready.

Importing starts no TensorFlow context and no thread of TensorFlow's that a child would miss: each child
configures the collective runtime itself, as a new process would (checked by tests/test_elastic_services.py
with a real group of forked processes). What a fork would share that a new process would not, the child
renews: numpy's global random state, and the threads tf_adasum starts at import (os.register_at_fork).

The relays reach it on an abstract Unix socket (its name in ENV_FORKSERVER) and must be of the same user
and carry the job's secret. It ends when the launcher closes its connection to the pool's server.
"""

from __future__ import annotations

import gc
import os
import select
import signal
import socket
import struct
import sys
import threading

import numpy as np

from tf_adasum import elastic_standby
from tf_adasum.elastic_pool import ENV_FORKSERVER, ENV_STANDBY
from tf_adasum.elastic_protocol import ENV_POOL, ENV_SECRET, is_secret, receive_message, send_message

# How often the server looks for ended children, to pass each one's exit status to its relay.
REAP_SECONDS = 0.02


def _peer_uid(connection: socket.socket) -> int:
    pid_uid_gid = connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", pid_uid_gid)[1])


def _request(connection: socket.socket, secret: str) -> tuple[list[int], dict[str, str]] | None:
    """A relay's streams and environment; None (and the streams closed) for anyone else. Another user's
    connection is refused before anything is read, so it cannot hold the server for the read's timeout."""
    if _peer_uid(connection) != os.getuid():
        return None
    connection.settimeout(10)
    fds: list[int] = []
    try:
        _, fds, _, _ = socket.recv_fds(connection, 1, 3)
        message = receive_message(connection)
    except (OSError, ValueError):
        message = None
    env = (message or {}).get("env")
    if len(fds) != 3 or not isinstance(env, dict) or not is_secret(env.get(ENV_SECRET), secret):
        for fd in fds:
            os.close(fd)
        return None
    connection.settimeout(None)
    return fds, {str(k): str(v) for k, v in env.items()}


def serve() -> tuple[socket.socket, dict[str, str]] | None:
    """Forks a child for each relay that asks, until the launcher closes the connection to the pool.
    Returns in the child (its relay's connection and environment); None in the server when it ends."""
    secret = os.environ[ENV_SECRET]
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind("\0" + os.environ[ENV_FORKSERVER])
    listener.listen(64)
    host, _, port = os.environ[ENV_POOL].rpartition(":")
    launcher = socket.create_connection((host, int(port)), timeout=30)
    send_message(launcher, {"secret": secret, "standby": os.environ[ENV_STANDBY]})
    children: dict[int, socket.socket] = {}
    # What the imports made stays out of every fork's garbage collections, which would otherwise touch
    # (and so copy) each of its pages in every fork (as Python's documentation advises for forking).
    gc.freeze()
    while True:
        ready, _, _ = select.select([listener, launcher, *children.values()], [], [], REAP_SECONDS)
        _reap(children)
        if launcher in ready and not launcher.recv(1):
            listener.close()
            return None
        for pid, connection in list(children.items()):
            if connection in ready and not _alive(connection):
                # The relay is gone (killed by the launcher): so goes its child, even a stopped one,
                # which could not run its own watch (_end_with_the_relay).
                _kill(pid)
        if listener not in ready:
            continue
        connection, _ = listener.accept()
        request = _request(connection, secret)
        if request is None:
            connection.close()
            continue
        fds, env = request
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            listener.close()
            launcher.close()
            for other in children.values():
                other.close()
            _become_the_relays(fds, env)
            return connection, env
        for fd in fds:
            os.close(fd)
        children[pid] = connection
        try:
            send_message(connection, {"pid": pid})
        except OSError:
            pass  # the relay is gone: its child notices and ends (_end_with_the_relay)


def _alive(connection: socket.socket) -> bool:
    try:
        return bool(connection.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except BlockingIOError:
        return True
    except OSError:
        return False


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _reap(children: dict[int, socket.socket]) -> None:
    """Passes each ended child's exit status (as Popen's returncode) to its relay."""
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        connection = children.pop(pid, None)
        if connection is None:
            continue
        try:
            send_message(connection, {"returncode": os.waitstatus_to_exitcode(status)})
        except OSError:
            pass
        connection.close()


def _become_the_relays(fds: list[int], env: dict[str, str]) -> None:
    """In the child: the relay's streams, environment and a session of its own; what a new process has
    that a fork would share, renewed."""
    os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    for number in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
        signal.signal(number, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.clear()
    os.environ.update(env)
    # numpy's global state is not renewed at a fork, as Python's random module's is.
    np.random.seed()  # noqa: NPY002


def _end_with_the_relay(connection: socket.socket) -> None:
    """The child ends at once when its relay does (killed by the launcher, its agent's connection cut):
    a thread reads the relay's side of the connection, where nothing comes but its end."""

    def watch() -> None:
        try:
            while connection.recv(1):
                pass
        except OSError:
            pass
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, daemon=True, name="tf_adasum-elastic-relay").start()


def main() -> int:
    child = serve()
    if child is None:
        return 0
    connection, _ = child
    _end_with_the_relay(connection)
    return elastic_standby.main()


if __name__ == "__main__":
    sys.exit(main())
