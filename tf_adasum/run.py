"""Starts N local processes with TF_CONFIG set, for development and tests: the TF engine's mpirun.

Usage:
    python -m tf_adasum.run -np N [--timeout SECONDS] script.py [args ...]

Every process gets a TF_CONFIG naming N workers on free ports of 127.0.0.1 and its own index. Output
lines are prefixed with "[rank]". The exit code is the first failure's (0 if all succeed). When one
process fails, the others have GRACE_SECONDS to end on their own (a dead peer's closed connections
usually make tf_adasum raise PeerError in them at once, naming it, and a script can report it), then
are killed; on Ctrl-C or the timeout all are killed at once.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

# How long the others may take to notice a failed process and end with their own error.
GRACE_SECONDS = 10.0


def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def _forward(rank: int, stream: object, lock: threading.Lock) -> None:
    for line in iter(stream.readline, b""):  # type: ignore[attr-defined]
        with lock:
            sys.stdout.buffer.write(f"[{rank}] ".encode() + line)
            sys.stdout.buffer.flush()


def launch(np: int, command: list[str], timeout: float | None = None) -> int:
    """Runs `command` as np workers on 127.0.0.1; returns the first non-zero exit code, or 0."""
    workers = [f"127.0.0.1:{p}" for p in free_ports(np)]
    lock = threading.Lock()
    processes = []
    for rank in range(np):
        env = dict(os.environ, TF_ADASUM_LAUNCHER="1")
        env["TF_CONFIG"] = json.dumps(
            {"cluster": {"worker": workers}, "task": {"type": "worker", "index": rank}}
        )
        proc = subprocess.Popen(
            command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
        )
        threading.Thread(target=_forward, args=(rank, proc.stdout, lock), daemon=True).start()
        processes.append(proc)

    def kill_all() -> None:
        for p in processes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)

    deadline = None if timeout is None else time.monotonic() + timeout
    first_failure: tuple[int, float] | None = None
    try:
        while True:
            codes = [p.poll() for p in processes]
            failed = [c for c in codes if c not in (None, 0)]
            if failed and first_failure is None:
                first_failure = (failed[0], time.monotonic())
            if first_failure is not None:
                ended = all(c is not None for c in codes)
                late = time.monotonic() > first_failure[1] + GRACE_SECONDS
                if ended or late or (deadline is not None and time.monotonic() > deadline):
                    kill_all()
                    return first_failure[0]
                time.sleep(0.05)
                continue
            if all(c == 0 for c in codes):
                return 0
            if deadline is not None and time.monotonic() > deadline:
                kill_all()
                sys.stderr.write(
                    f"tf_adasum.run: killed all {np} processes after the {timeout:.0f} s timeout\n"
                )
                return 124
            time.sleep(0.05)
    except KeyboardInterrupt:
        kill_all()
        return 130
    finally:
        for p in processes:
            p.wait()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-np", type=int, required=True, help="number of processes")
    parser.add_argument("--timeout", type=float, default=None, help="kill everything after this many seconds")
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    sys.exit(launch(args.np, [sys.executable, args.script, *args.args], args.timeout))


if __name__ == "__main__":
    main()
