"""Where and how a launcher starts processes: free ports, horovodrun's host list, the command that starts
a process on another host. Shared by `python -m tf_adasum.run` and its elastic mode; no TensorFlow."""

from __future__ import annotations

import os
import shlex
import socket

# How long the others may take to notice a failed process and end with their own error.
GRACE_SECONDS = 10.0
LOCAL_HOSTS = ("localhost", "127.0.0.1")
DEFAULT_AGENT = "ssh -o BatchMode=yes"
# Not forwarded to other hosts: what belongs to this shell or this host.
_NOT_FORWARDED = ("HOSTNAME", "PWD", "OLDPWD", "SHLVL", "_", "TERM", "DISPLAY", "LS_COLORS", "MAIL")
_NOT_FORWARDED_PREFIXES = ("SSH_", "XDG_", "BASH_FUNC_")


def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def parse_hosts(hosts: str, np: int) -> list[str]:
    """Each rank's host from horovodrun's `-H host:slots,host:slots` (slots default 1), filled in order.

    Raises:
        ValueError: a malformed entry, or fewer slots than np.
    """
    placed: list[str] = []
    for entry in hosts.split(","):
        host, _, slots = entry.strip().rpartition(":") if ":" in entry else (entry.strip(), "", "1")
        if not host or not slots.isdigit() or int(slots) < 1:
            raise ValueError(f"-H {hosts!r}: expected host:slots entries such as 10.0.0.1:2, got {entry!r}")
        placed += [host] * int(slots)
    if len(placed) < np:
        raise ValueError(f"-H {hosts!r} has {len(placed)} slots for -np {np}")
    return placed[:np]


def remote_command(agent: str, host: str, command: list[str], env: dict[str, str]) -> list[str]:
    """`command` run on `host` through the agent, in this directory, with `env` (as ssh passes it: one
    string for the remote shell)."""
    forwarded = {
        k: v
        for k, v in env.items()
        if k not in _NOT_FORWARDED and not k.startswith(_NOT_FORWARDED_PREFIXES) and "\n" not in v
    }
    assignments = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(forwarded.items()))
    line = f"cd {shlex.quote(os.getcwd())} && exec env {assignments} {shlex.join(command)}"
    return [*shlex.split(agent), host, line]
