"""The fork server of the elastic launcher's pool (tf_adasum/launch/elastic/pool.py): `python -m
tf_adasum.elastic.forkserver`, one on each host, started by the launcher, never by hand.

It imports TensorFlow, Keras and tf_adasum once, then forks a warm process for each relay
(tf_adasum/launch/relay.py) that asks, as Python's multiprocessing forkserver does: the child takes the
relay's standard streams and environment, and goes on as `python -m tf_adasum.elastic.standby` would
once its imports were done. A warm process so costs a fork (milliseconds, its memory shared with this
one until written) instead of an import (13-15 s a process when several start at once on 2 cores), so
the pool refills within a second and a growth finds its processes ready.

Importing starts no TensorFlow context and no thread of TensorFlow's that a child would miss: each child
configures the collective runtime itself, as a new process would (checked by tests/test_elastic_services.py
with a real group of forked processes). What a fork would share that a new process would not, the child
renews: numpy's global random state, and the threads tf_adasum starts at import (os.register_at_fork).

The relays reach it on an abstract Unix socket (its name in ENV_FORKSERVER, fresh at each start). A relay
must be of the same user (checked before anything is read) and prove it holds the job's key, as the
server proves it back (secret.Channel); the key itself does not cross: each child takes the server's. It
ends when the launcher closes its connection to the pool's server.
"""

from __future__ import annotations

import gc
import os
import select
import signal
import socket
import sys
import threading

import numpy as np

from tf_adasum.elastic import standby as elastic_standby
from tf_adasum.launch.elastic.pool import ENV_FORKSERVER, ENV_STANDBY
from tf_adasum.launch.protocol import ENV_POOL
from tf_adasum.launch.secret import ENV_SECRET, Channel
from tf_adasum.launch.service import HANDSHAKE_SECONDS, connect, peer_credentials

# How often the server looks for ended children, to pass each one's exit status to its relay.
REAP_SECONDS = 0.02


def _request(connection: socket.socket, secret: str) -> tuple[Channel, list[int], dict[str, str]] | None:
    """A relay's channel, streams and environment; None (and the streams closed) for anyone else. Another
    user's connection is refused before anything is read, so it cannot hold the server for the read's
    timeout; one of this user's must prove the key within HANDSHAKE_SECONDS."""
    if peer_credentials(connection)[1] != os.getuid():
        return None
    connection.settimeout(HANDSHAKE_SECONDS)
    fds: list[int] = []
    try:
        channel = Channel.accept(connection, secret)
        _, fds, _, _ = socket.recv_fds(connection, 1, 3)
        message, _ = channel.receive()
    except (OSError, ValueError):
        message = {}
    env = message.get("env")
    if len(fds) != 3 or not isinstance(env, dict):
        for fd in fds:
            os.close(fd)
        return None
    connection.settimeout(None)
    # The relay does not send the key: the child takes the server's, which is the job's.
    return channel, fds, {**{str(k): str(v) for k, v in env.items()}, ENV_SECRET: secret}


def serve() -> tuple[socket.socket, dict[str, str]] | None:
    """Forks a child for each relay that asks, until the launcher closes the connection to the pool.
    Returns in the child (its relay's connection and environment); None in the server when it ends."""
    secret = os.environ[ENV_SECRET]
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind("\0" + os.environ[ENV_FORKSERVER])
    listener.listen(64)
    pool = connect(os.environ[ENV_POOL], secret, timeout=30)
    pool.send({"standby": os.environ[ENV_STANDBY]})
    launcher = pool.connection
    launcher.settimeout(None)
    children: dict[int, Channel] = {}
    # What the imports made stays out of every fork's garbage collections, which would otherwise touch
    # (and so copy) each of its pages in every fork (as Python's documentation advises for forking).
    gc.freeze()
    while True:
        watched = [listener, launcher, *(c.connection for c in children.values())]
        ready, _, _ = select.select(watched, [], [], REAP_SECONDS)
        _reap(children)
        if launcher in ready and not launcher.recv(1):
            listener.close()
            return None
        for pid, relay in list(children.items()):
            if relay.connection in ready and not _alive(relay.connection):
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
        channel, fds, env = request
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
        children[pid] = channel
        try:
            channel.send({"pid": pid})
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


def _reap(children: dict[int, Channel]) -> None:
    """Passes each ended child's exit status (as Popen's returncode) to its relay."""
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        relay = children.pop(pid, None)
        if relay is None:
            continue
        try:
            relay.send({"returncode": os.waitstatus_to_exitcode(status)})
        except OSError:
            pass
        relay.close()


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
