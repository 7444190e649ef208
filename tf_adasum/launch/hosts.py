"""Where and how a launcher starts processes: free ports, horovodrun's host list, the command that starts
a process on another host. Shared by `python -m tf_adasum.run` and its elastic mode; no TensorFlow."""

from __future__ import annotations

import json
import os
import random
import re
import shlex
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# How long the others may take to notice a failed process and end with their own error.
GRACE_SECONDS = 10.0
LOCAL_HOSTS = ("localhost", "127.0.0.1")
DEFAULT_AGENT = "ssh -o BatchMode=yes"
# Not forwarded to other hosts: what belongs to this shell or this host.
_NOT_FORWARDED = ("HOSTNAME", "PWD", "OLDPWD", "SHLVL", "_", "TERM", "DISPLAY", "LS_COLORS", "MAIL")
_NOT_FORWARDED_PREFIXES = ("SSH_", "XDG_", "BASH_FUNC_")


# What a host name or address may hold: it becomes an argument of the agent (ssh), so nothing that a shell
# or ssh reads as more than a name, and no leading "-", which ssh reads as an option.
_HOST_NAME = re.compile(r"[A-Za-z0-9_.:][A-Za-z0-9_.:-]*")
HOST_NAME_RULE = "letters, digits, '.', '-', '_' and ':', not starting with '-'"


def is_host_name(host: str) -> bool:
    return _HOST_NAME.fullmatch(host) is not None


class StartError(RuntimeError):
    """A process could not be started; those started before it were ended."""


def exit_status(returncode: int) -> int:
    """A process's exit status as the launcher's own: a signal's as a shell gives it (128 + its number),
    so that a job killed by a signal never exits 0 or with a code that looks like a script's own."""
    return 128 - returncode if returncode < 0 else returncode


def end_all(processes: list[subprocess.Popen[bytes]]) -> None:
    """Kills every process still running (its whole session), and waits for each."""
    for process in processes:
        if process.poll() is None:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for process in processes:
        process.wait()


def tf_config(workers: list[str], rank: int) -> str:
    """The TF_CONFIG of rank `rank` of the TF engine's cluster `workers` (host:port each, in rank order)."""
    return json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": rank}})


# Where free_ports draws from: above the well-known and registered ports most services take, below the
# kernel's ephemeral range (read from /proc where there is one).
_LOWEST_PORT = 15000
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def ephemeral_floor() -> int:
    """The lowest port the kernel hands out by itself (to a bind to port 0, or an outgoing connection)."""
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """n distinct ports free on `host` now, drawn at random below the kernel's ephemeral range.

    A port is free only until someone binds it, and a rank binds its port seconds later, once TensorFlow
    is imported. Every port the kernel hands out by itself (any process's bind to port 0, the own end
    of every outgoing connection: an MPI job's, a browser's) comes from the ephemeral range, so a port
    drawn from it can be gone by then, and the rank ends with "Could not start gRPC server". Below that
    range only another process choosing a port number itself can take it in between (portpicker draws
    the same way). Where that range leaves no room, the kernel's own choice is taken.
    """
    rng = random.SystemRandom()
    chosen: list[int] = []
    low, high = _LOWEST_PORT, ephemeral_floor()
    for _ in range(100 * n if high - low > 100 * n else 0):
        if len(chosen) == n:
            break
        port = rng.randrange(low, high)
        if port not in chosen and _bindable(host, port):
            chosen.append(port)
    while len(chosen) < n:
        with socket.socket() as probe:
            probe.bind((host, 0))
            port = probe.getsockname()[1]
        if port not in chosen:
            chosen.append(port)
    return chosen


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def parse_hosts(hosts: str, np: int) -> list[str]:
    """Each rank's host from horovodrun's `-H host:slots,host:slots` (slots default 1), filled in order.

    Raises:
        ValueError: a malformed entry, or fewer slots than np.
    """
    placed: list[str] = []
    for entry in hosts.split(","):
        host, _, slots = entry.strip().rpartition(":") if ":" in entry else (entry.strip(), "", "1")
        if not is_host_name(host) or not slots.isdigit() or int(slots) < 1:
            raise ValueError(
                f"-H {hosts!r}: expected host:slots entries such as 10.0.0.1:2 (a host name is "
                f"{HOST_NAME_RULE}), got {entry!r}"
            )
        placed += [host] * int(slots)
    if len(placed) < np:
        raise ValueError(f"-H {hosts!r} has {len(placed)} slots for -np {np}")
    return placed[:np]


# Run on the other host by the agent's shell: reads the process's environment as one JSON line from stdin
# (never from the command line, which that host's process list shows to every user), then becomes the
# command, in this directory.
_BOOTSTRAP = (
    "import json,os,sys;e=json.loads(sys.stdin.readline());os.chdir(e.pop('TF_ADASUM_CWD'));"
    "os.execve(sys.argv[1],sys.argv[1:],e)"
)


def remote_command(agent: str, host: str, command: list[str]) -> list[str]:
    """`command` run on `host` through the agent (as ssh runs it: one string for the remote shell), with
    its environment read from stdin: remote_environment() gives the line to write there."""
    line = f"exec {shlex.quote(sys.executable)} -c {shlex.quote(_BOOTSTRAP)} {shlex.join(command)}"
    return [*shlex.split(agent), host, line]


def remote_environment(env: Mapping[str, str]) -> bytes:
    """The line remote_command's process reads its environment from: `env` less what belongs to this
    shell or this host, and this directory."""
    forwarded = {
        k: v for k, v in env.items() if k not in _NOT_FORWARDED and not k.startswith(_NOT_FORWARDED_PREFIXES)
    }
    forwarded["TF_ADASUM_CWD"] = os.getcwd()
    return (json.dumps(forwarded) + "\n").encode()


def start(
    host: str, command: list[str], env: dict[str, str], agent: str, **popen: Any
) -> subprocess.Popen[bytes]:
    """Starts `command` on `host` with `env`: here directly, elsewhere through the agent, the environment
    passed on stdin (remote_command). Its stdout and stderr are pipes; it gets its own session."""
    popen = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "start_new_session": True, **popen}
    if host in LOCAL_HOSTS:
        return subprocess.Popen(command, env=env, **popen)
    process = subprocess.Popen(remote_command(agent, host, command), env=env, stdin=subprocess.PIPE, **popen)
    assert process.stdin is not None
    process.stdin.write(remote_environment(env))
    process.stdin.close()
    process.stdin = None  # written and closed: communicate() must not flush it
    return process
