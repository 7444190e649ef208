#!/usr/bin/env python3
"""A test cluster on this machine: H hosts as Linux network namespaces on one switch, links shaped by tc.

Each host is a network namespace with its own interface (eth0), its own address in a private subnet
made for the cluster, its own hostname and an /etc/hosts naming every host. The switch is a bridge in a
namespace of its own, so nothing is added to this machine's own network and no traffic leaves the
cluster. Each link is shaped in both directions (rate; delay and loss where the kernel has netem), as a host's
NIC on a switch port. Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN); available() says why not.

Usage:
    cluster.py up [--name N] [--hosts H] [--rate 1gbit] [--delay 100us] [--loss 0%]
    cluster.py shape [--name N] [--rate R] [--delay D] [--loss L]   # reshape every link
    cluster.py exec [--name N] HOST COMMAND...   # run COMMAND on HOST (an address or hostname)
    cluster.py agent [-x ...] HOST COMMAND...    # a launch agent in ssh's place (mpirun, tf_adasum.run)
    cluster.py cut [--name N] HOST               # take HOST's link down (a pulled cable)
    cluster.py down [--name N]                   # remove every namespace, link and file of the cluster

As a module, Cluster(...) is a context manager that brings the cluster up and always takes it down,
on an exception or on SIGTERM too. `down` also clears a cluster that an interrupted run left.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# Where each cluster's description lives while it is up: agents and `down` read it.
STATE = Path("/run/tf_adasum_cluster")
# Per-namespace files that `ip netns exec` bind-mounts over /etc (here: hosts).
NETNS_ETC = Path("/etc/netns")
DEFAULT_NAME = "tfa"
SUBNET = "10.213.0"  # a private /24 that exists only on the cluster's own bridge


def _ip(*args: str, namespace: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    command = ["ip", *(["-n", namespace] if namespace else []), *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=30, check=False)
    if check and result.returncode != 0:
        raise RuntimeError(f"`{' '.join(command)}` failed ({result.returncode}): {result.stderr.strip()}")
    return result


def available() -> str | None:
    """None where this process can make a cluster; otherwise why not, for a test's skip reason."""
    if sys.platform != "linux":
        return f"network namespaces need Linux, this is {sys.platform}"
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (iproute2, util-linux)"
    if os.geteuid() != 0:
        return "making network namespaces needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN); not root here"
    probe = f"tfa-probe-{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


class Cluster:
    """H hosts, h0 ... h{H-1}, at SUBNET.1 ... SUBNET.H, on one switch.

    Args:
        hosts: how many.
        name: the cluster's name, a prefix of its namespaces and interfaces (at most 5 characters).
        rate, delay, loss: each link's shaping, in tc's units ("1gbit", "100us", "0.1%"); rate None for
            an unshaped link.
    """

    def __init__(
        self,
        hosts: int = 2,
        name: str = DEFAULT_NAME,
        rate: str | None = "1gbit",
        delay: str | None = None,
        loss: str | None = None,
    ) -> None:
        if not 1 <= hosts <= 200:
            raise ValueError(f"hosts must be 1 to 200, got {hosts}")
        if not (1 <= len(name) <= 5 and name.replace("-", "").isalnum()):
            raise ValueError(f"name must be 1-5 letters or digits, got {name!r}")
        self.name, self.size = name, hosts
        self.rate, self.delay, self.loss = rate, delay, loss
        self.switch = f"{name}-sw"
        self.namespaces = [f"{name}-h{i}" for i in range(hosts)]
        self.hostnames = [f"{name}h{i}" for i in range(hosts)]
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(hosts)]
        self._previous_sigterm: Any = None
        self.applied: dict[str, Any] = {}

    # ---- life cycle -------------------------------------------------------------------------------

    def up(self) -> Cluster:
        """Makes the cluster, first removing any left by an interrupted run under the same name."""
        down(self.name)
        STATE.mkdir(parents=True, exist_ok=True)
        # Written first, so that `down` finds whatever part of the cluster exists if this fails.
        (STATE / f"{self.name}.json").write_text(json.dumps(self.describe()))
        try:
            _ip("netns", "add", self.switch)
            _ip("link", "add", "br0", "type", "bridge", namespace=self.switch)
            _ip("link", "set", "br0", "up", namespace=self.switch)
            hosts_file = "127.0.0.1 localhost\n" + "".join(
                f"{a} {h}\n" for a, h in zip(self.addresses, self.hostnames, strict=True)
            )
            for i, ns in enumerate(self.namespaces):
                _ip("netns", "add", ns)
                inside, port = f"{self.name}h{i}", f"{self.name}s{i}"
                _ip("link", "add", inside, "type", "veth", "peer", "name", port)
                _ip("link", "set", inside, "netns", ns, "name", "eth0")
                _ip("link", "set", port, "netns", self.switch)
                _ip("link", "set", port, "master", "br0", namespace=self.switch)
                _ip("link", "set", port, "up", namespace=self.switch)
                _ip("addr", "add", f"{self.addresses[i]}/24", "dev", "eth0", namespace=ns)
                _ip("link", "set", "eth0", "up", namespace=ns)
                _ip("link", "set", "lo", "up", namespace=ns)
                etc = NETNS_ETC / ns
                etc.mkdir(parents=True, exist_ok=True)
                (etc / "hosts").write_text(hosts_file)
            self.shape(self.rate, self.delay, self.loss)
        except BaseException:
            down(self.name)
            raise
        return self

    def down(self) -> None:
        down(self.name)

    def __enter__(self) -> Cluster:
        # SIGTERM (pytest-timeout, a CI kill) unwinds through __exit__, so the cluster still goes.
        self._previous_sigterm = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
        return self.up()

    def __exit__(self, *exc: object) -> None:
        try:
            self.down()
        finally:
            signal.signal(signal.SIGTERM, self._previous_sigterm or signal.SIG_DFL)

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "switch": self.switch,
            "namespaces": self.namespaces,
            "hostnames": self.hostnames,
            "addresses": self.addresses,
            "applied": self.applied,
        }

    # ---- links ------------------------------------------------------------------------------------

    def shape(self, rate: str | None, delay: str | None = None, loss: str | None = None) -> list[str]:
        """Every link, both directions, at this rate, delay and loss (None: not shaped that way).

        The host's side shapes what the host sends; the switch port's side, what it receives. With
        sch_netem in the kernel, netem does all three. Without it (this project's machines: their
        kernel has tbf and htb but no netem), tbf shapes the rate, and a delay or loss asked for is not
        applied: the returned warnings say so, and `describe()["applied"]` records what was.
        """
        self.rate, self.delay, self.loss = rate, delay, loss
        warnings = []
        if netem_available():
            qdisc = ["netem", "limit", "100000"]
            qdisc += ["delay", delay] if delay else []
            qdisc += ["rate", rate] if rate else []
            qdisc += ["loss", loss] if loss else []
            self.applied = {"rate": rate, "delay": delay, "loss": loss, "qdisc": "netem"}
        else:
            for what, value in (("delay", delay), ("loss", loss)):
                if value:
                    warnings.append(f"{what} {value} not applied: this kernel has no sch_netem")
            if rate:
                bits = _bits_per_second(rate)
                # A 1 ms bucket (at least 64 KiB, a GSO packet) and up to 50 ms of queue.
                burst = max(65536, bits // 8 // 1000)
                qdisc = ["tbf", "rate", rate, "burst", str(burst), "latency", "50ms"]
            else:
                qdisc = ["pfifo", "limit", "10000"]
            self.applied = {"rate": rate, "delay": None, "loss": None, "qdisc": qdisc[0]}
        for i, ns in enumerate(self.namespaces):
            for namespace, dev in ((ns, "eth0"), (self.switch, f"{self.name}s{i}")):
                command = ["tc", "-n", namespace, "qdisc", "replace", "dev", dev, "root", *qdisc]
                result = subprocess.run(command, capture_output=True, text=True, timeout=30, check=False)
                if result.returncode != 0:
                    raise RuntimeError(f"`{' '.join(command)}` failed: {result.stderr.strip()}")
        if STATE.joinpath(f"{self.name}.json").exists():
            STATE.joinpath(f"{self.name}.json").write_text(json.dumps(self.describe()))
        for warning in warnings:
            print(f"cluster.py: {warning}", file=sys.stderr)
        return warnings

    def cut(self, host: int | str) -> None:
        """Takes a host's link down, as a pulled cable: its packets, and others' to it, are lost."""
        _ip("link", "set", "eth0", "down", namespace=self.namespaces[self.index(host)])

    def bytes_sent(self) -> list[int]:
        """Bytes each host's interface has sent (its tx counter), in host order."""
        counts = []
        for ns in self.namespaces:
            stats = json.loads(_ip("-s", "-j", "link", "show", "eth0", namespace=ns).stdout)
            counts.append(int(stats[0]["stats64"]["tx"]["bytes"]))
        return counts

    # ---- running on hosts -------------------------------------------------------------------------

    def index(self, host: int | str) -> int:
        """A host's index from its index, address or hostname."""
        if isinstance(host, int) or host.isdigit():
            if not 0 <= int(host) < self.size:
                raise ValueError(f"host {host} of cluster {self.name!r}: it has hosts 0 to {self.size - 1}")
            return int(host)
        for names in (self.addresses, self.hostnames, self.namespaces):
            if host in names:
                return names.index(host)
        raise ValueError(f"{host!r} is none of cluster {self.name!r}'s hosts {self.addresses}")

    def command(self, host: int | str, command: list[str]) -> list[str]:
        """`command` as run on `host`: in its network namespace, under its own hostname."""
        return host_command(self.describe(), self.index(host), command)

    def popen(self, host: int | str, command: list[str], **kwargs: Any) -> subprocess.Popen[Any]:
        return subprocess.Popen(self.command(host, command), **kwargs)

    def run(self, host: int | str, command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[Any]:
        kwargs.setdefault("timeout", 600)
        return subprocess.run(self.command(host, command), **kwargs)


_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}


def _bits_per_second(rate: str) -> int:
    """tc's rate ("1gbit", "500mbit") in bits per second."""
    for unit in sorted(_UNITS, key=len, reverse=True):
        if rate.lower().endswith(unit):
            return int(float(rate[: -len(unit)]) * _UNITS[unit])
    raise ValueError(f"rate {rate!r}: expected a number and one of {list(_UNITS)}, as tc takes it")


_NETEM: bool | None = None


def netem_available() -> bool:
    """Whether this kernel has sch_netem (delay and loss), tried once on a scratch namespace."""
    global _NETEM
    if _NETEM is None:
        probe = f"tfa-netem-{os.getpid()}"
        _ip("netns", "add", probe)
        try:
            _ip("link", "add", "probe0", "type", "veth", "peer", "name", "probe1", namespace=probe)
            command = ["tc", "-n", probe, "qdisc", "add", "dev", "probe0", "root", "netem", "delay", "1ms"]
            _NETEM = subprocess.run(command, capture_output=True, timeout=30, check=False).returncode == 0
        finally:
            _ip("netns", "del", probe, check=False)
    return _NETEM


def _raise_keyboard_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def host_command(description: dict[str, Any], index: int, command: list[str]) -> list[str]:
    """The command line that runs `command` on host `index` of a described cluster.

    `ip netns exec` enters the namespace (and mounts /etc/netns/NS/hosts over /etc/hosts); unshare
    gives the host its own hostname, so that Open MPI tells the hosts apart (it knows a node by name).
    """
    hostname = description["hostnames"][index]
    return [
        "ip", "netns", "exec", description["namespaces"][index],
        "unshare", "--uts", "sh", "-c", f'hostname {hostname} && exec "$@"', "sh", *command,
    ]  # fmt: skip


def load(name: str = DEFAULT_NAME) -> dict[str, Any]:
    path = STATE / f"{name}.json"
    if not path.exists():
        raise SystemExit(f"cluster {name!r} is not up ({path} does not exist): `cluster.py up` first")
    return json.loads(path.read_text())


def down(name: str = DEFAULT_NAME) -> None:
    """Removes cluster `name`: kills what runs in its namespaces, deletes them (and so their links)."""
    path = STATE / f"{name}.json"
    described = json.loads(path.read_text()) if path.exists() else {}
    listed = _ip("netns", "list", check=False).stdout.split()
    ours = {ns for ns in listed if ns.startswith(f"{name}-")}
    ours |= set(described.get("namespaces", [])) | ({described["switch"]} if described else set())
    for ns in sorted(ours):
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, check=False)
        for pid in pids.stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
    for ns in sorted(ours):
        if ns in listed:
            for _ in range(50):  # a killed process may hold the namespace for a moment
                if _ip("netns", "del", ns, check=False).returncode == 0:
                    break
                time.sleep(0.1)
        shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)
    path.unlink(missing_ok=True)


def _agent(argv: list[str], name: str) -> int:
    """ssh's interface, for a launcher's agent: [options] HOST COMMAND..., COMMAND run by a shell.

    Open MPI's rsh launcher and `tf_adasum.run --agent` both call it so. ssh's options (such as -x)
    are accepted and ignored.
    """
    while argv and argv[0].startswith("-"):
        argv = argv[1:]
    if len(argv) < 2:
        print("cluster.py agent: usage: agent [options] HOST COMMAND...", file=sys.stderr)
        return 2
    description = load(name)
    host, command = argv[0], " ".join(argv[1:])
    for names in (description["addresses"], description["hostnames"]):
        if host in names:
            index = names.index(host)
            break
    else:
        print(f"cluster.py agent: {host!r} is not a host of cluster {name!r}", file=sys.stderr)
        return 255
    line = host_command(description, index, ["sh", "-c", command])
    os.execvp(line[0], line)
    return 0  # not reached


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--name", default=os.environ.get("TF_ADASUM_CLUSTER", DEFAULT_NAME))
    sub = parser.add_subparsers(dest="verb", required=True)
    up_parser = sub.add_parser("up")
    up_parser.add_argument("--hosts", type=int, default=2)
    for p in (up_parser, shape_parser := sub.add_parser("shape")):
        p.add_argument("--rate", default="1gbit", help='tc rate, e.g. 1gbit; "none" for unshaped')
        p.add_argument("--delay", default=None, help="tc delay, e.g. 100us (needs sch_netem)")
        p.add_argument("--loss", default=None)
    exec_parser = sub.add_parser("exec")
    exec_parser.add_argument("host")
    exec_parser.add_argument("command", nargs=argparse.REMAINDER)
    cut_parser = sub.add_parser("cut")
    cut_parser.add_argument("host")
    sub.add_parser("down")
    sub.add_parser("show")
    if len(sys.argv) > 1 and sys.argv[1] == "agent":  # ssh's argument shape: no argparse
        sys.exit(_agent(sys.argv[2:], os.environ.get("TF_ADASUM_CLUSTER", DEFAULT_NAME)))
    args = parser.parse_args()
    if args.verb == "down":
        down(args.name)
        return
    if args.verb == "up":
        rate = None if args.rate == "none" else args.rate
        cluster = Cluster(args.hosts, args.name, rate, args.delay, args.loss).up()
        print(json.dumps(cluster.describe()))
        return
    described = load(args.name)
    cluster = Cluster(len(described["namespaces"]), args.name)
    if args.verb == "show":
        print(json.dumps(described | {"bytes_sent": cluster.bytes_sent()}))
    elif args.verb == "shape":
        cluster.shape(None if args.rate == "none" else args.rate, args.delay, args.loss)
    elif args.verb == "cut":
        cluster.cut(args.host)
    elif args.verb == "exec":
        line = cluster.command(args.host, args.command)
        os.execvp(line[0], line)
    del shape_parser


if __name__ == "__main__":
    main()
