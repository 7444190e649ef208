"""The elastic launcher's pool of warm processes: on each host, processes that have imported TensorFlow,
Keras and tf_adasum (python -m tf_adasum.elastic.standby) and wait for a place in a group.

A membership change ends the group and starts the next one (restart-based, as torchrun's), but every
member of the next group comes from the pool: it runs the job's script from the top, as a new process
would, without paying for Python's and TensorFlow's start (13-15 s a process when 8 start at once on
2 cores). The launcher keeps `per_host` waiting on each host, starting new ones as it takes some, and
when a host has none ready it starts a process cold and says so.

A waiting process connects back to the pool's server (the launcher's address; each side proves it holds
the job's key before anything else crosses, secret.Channel), and gets its assignment there: its
environment (TF_CONFIG, its rank's state files; not the key, which it has), its arguments and its
directory. Its stdout and stderr are the launcher's pipes from the start. No TensorFlow here.

Each host has one fork server (tf_adasum/elastic/forkserver.py) that imports TensorFlow once; the
launcher starts each warm process as a relay (tf_adasum/launch/relay.py) that gets a fork of it. So a
host pays one import, not one per process, and a process taken from the pool is replaced within a
second.
"""

from __future__ import annotations

import collections
import itertools
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import IO

from tf_adasum.launch.hosts import start
from tf_adasum.launch.protocol import ENV_POOL
from tf_adasum.launch.secret import ENV_SECRET, Channel
from tf_adasum.launch.service import Service

ENV_STANDBY = "TF_ADASUM_ELASTIC_STANDBY"  # a waiting process's id, which it says when it connects
# The abstract Unix socket where the host's fork server listens: a fresh unguessable name at each start of
# one, so that no other user can bind it first, and a relay checks the server's user before it sends.
ENV_FORKSERVER = "TF_ADASUM_ELASTIC_FORKSERVER"
STANDBY_COMMAND = [sys.executable, "-m", "tf_adasum.launch.relay"]
FORKSERVER_COMMAND = [sys.executable, "-m", "tf_adasum.elastic.forkserver"]


@dataclass
class Standby:
    id: str
    host: str
    process: subprocess.Popen[bytes]
    started: float = field(default_factory=time.monotonic)
    channel: Channel | None = None  # set when it has imported everything and connected

    @property
    def ready(self) -> bool:
        return self.channel is not None and self.process.poll() is None


class Pool(Service):
    """Warm processes on each host, `per_host` of them, started with `env` through `agent` (hosts.start)."""

    def __init__(
        self,
        address: str,
        secret: str,
        per_host: int,
        agent: str,
        env: Mapping[str, str],
        say: Callable[[str], None],
    ) -> None:
        self.secret = secret
        self.per_host = per_host
        self.agent = agent
        self.env = dict(env)
        self.say = say
        self.lock = threading.Lock()
        self.waiting: list[Standby] = []
        self.ids = itertools.count()
        self.forkservers: dict[str, Standby] = {}
        self.forkserver_names: dict[str, str] = {}
        self.forkserver_tails: dict[str, collections.deque[str]] = {}
        # A hello at a time from each process being started, and room for strangers' attempts.
        super().__init__(address, secret, max(64, 4 * per_host), "tf_adasum-elastic-pool")

    def handle(self, channel: Channel) -> bool:
        """A waiting process's hello, once it proved the key: its id. One the pool did not start is shut
        out."""
        message, _ = channel.receive()
        with self.lock:
            known = [*self.waiting, *self.forkservers.values()]
            standby = next((s for s in known if s.id == message.get("standby") and s.channel is None), None)
            if standby is None:
                return False
            channel.connection.settimeout(None)
            standby.channel = channel
            return True

    def fill(self, slots: Mapping[str, int], besides: Mapping[str, int] | None = None) -> None:
        """Starts processes so that each host of `slots` has min(per_host, its slots) waiting, and
        `besides[host]` more (the members of a group about to take their places)."""
        with self.lock:
            for host, count in slots.items():
                have = sum(1 for s in self.waiting if s.host == host)
                want = min(self.per_host, count) + (besides or {}).get(host, 0)
                if want > have:
                    self._start_forkserver(host)
                for _ in range(want - have):
                    env = self._environment(host)
                    process = start(host, STANDBY_COMMAND, env, self.agent)
                    self.waiting.append(Standby(env[ENV_STANDBY], host, process))

    def _environment(self, host: str) -> dict[str, str]:
        return {
            **self.env,
            ENV_POOL: self.address,
            ENV_SECRET: self.secret,
            ENV_STANDBY: f"s{next(self.ids)}",
            ENV_FORKSERVER: self.forkserver_names.get(host, ""),
        }

    def _start_forkserver(self, host: str) -> None:
        """Starts `host`'s fork server unless it runs (under self.lock). Its stderr's last lines are kept
        for the message should it end."""
        running = self.forkservers.get(host)
        if running is not None and running.process.poll() is None:
            return
        self.forkserver_names[host] = f"tf_adasum-{secrets.token_hex(16)}"
        env = self._environment(host)
        process = start(host, FORKSERVER_COMMAND, env, self.agent, stdout=subprocess.DEVNULL)
        self.forkservers[host] = Standby(env[ENV_STANDBY], host, process)
        tail = self.forkserver_tails[host] = collections.deque(maxlen=5)

        def drain(stream: IO[bytes]) -> None:
            for line in stream:
                tail.append(line.decode(errors="replace").rstrip())

        assert process.stderr is not None
        threading.Thread(target=drain, args=(process.stderr,), daemon=True).start()

    def ready_for(self, need: Mapping[str, int]) -> bool:
        """Whether each host of `need` has that many ready processes; if not, starts what is missing."""
        if all(self.ready_on(host) >= count for host, count in need.items()):
            return True
        self.fill(dict.fromkeys(need, 0), besides=need)  # the refill's processes count among these
        return False

    def ready_on(self, host: str) -> int:
        with self.lock:
            return sum(1 for s in self.waiting if s.host == host and s.ready)

    def take(self, host: str) -> Standby | None:
        """A ready process on `host`, out of the pool; None where none is ready."""
        with self.lock:
            for standby in self.waiting:
                if standby.host == host and standby.ready:
                    self.waiting.remove(standby)
                    return standby
        return None

    def take_when_ready(self, host: str, until: float) -> Standby | None:
        """A ready process on `host`, out of the pool, waiting (until `until`, time.monotonic) for one
        still importing; None where the host has none alive, or none got ready in time."""
        while True:
            standby = self.take(host)
            if standby is not None:
                return standby
            self.reap()
            with self.lock:
                alive = any(s.host == host for s in self.waiting)
            if not alive or time.monotonic() > until:
                return None
            time.sleep(0.02)

    def assign(self, standby: Standby, env: Mapping[str, str], command: list[str]) -> subprocess.Popen[bytes]:
        """Gives `standby` its place: it runs `command` (python script ... or python -m module ...) with
        `env`, in this directory. Returns its process."""
        assert standby.channel is not None
        place = {k: v for k, v in env.items() if k != ENV_SECRET}  # it holds the key already
        standby.channel.send({"env": place, "argv": command[1:], "cwd": os.getcwd()})
        standby.channel.close()
        return standby.process

    def reap(self) -> None:
        """Forgets waiting processes that died (saying so); fill() replaces them."""
        with self.lock:
            dead = [s for s in self.waiting if s.process.poll() is not None]
            for standby in dead:
                self.waiting.remove(standby)
            ended = [s for s in self.forkservers.values() if s.process.poll() is not None]
            orphans = []
            for server in ended:
                del self.forkservers[server.host]
                # Its forks would end with their exit status lost: they go too, and fill() replaces them.
                orphans += [s for s in self.waiting if s.host == server.host]
            for standby in orphans:
                self.waiting.remove(standby)
        for standby in orphans:  # outside the lock, which take() needs: each waits for its process
            _end(standby)
        for server in ended:
            last = [line for line in self.forkserver_tails.pop(server.host, []) if line.strip()]
            self.say(
                f"the fork server on {server.host} ended (exit code {server.process.returncode}"
                + (f": {last[-1]}" if last else "")
                + "); another one starts when the pool refills there"
            )
        for standby in dead:
            self.say(
                f"a warm process on {standby.host} ({standby.id}) ended while it waited "
                f"(exit code {standby.process.returncode}); another one starts"
            )

    def close(self) -> None:
        """Ends every waiting process and the server."""
        super().close()
        with self.lock:
            waiting, self.waiting = self.waiting, []
            forkservers, self.forkservers = list(self.forkservers.values()), {}
        for standby in [*waiting, *forkservers]:
            _end(standby)


def _end(standby: Standby) -> None:
    if standby.channel is not None:
        standby.channel.close()  # it exits on its own when told nothing
    if standby.process.poll() is None:
        try:
            os.killpg(standby.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    standby.process.wait()
