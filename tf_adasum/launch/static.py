"""A launch of N processes with TF_CONFIG set, on this host or on several: the TF engine's mpirun
(`python -m tf_adasum.run` without --elastic). No TensorFlow here.

Every process gets a TF_CONFIG naming the N workers and its own index. Without -H all N run here, on
127.0.0.1. With -H (horovodrun's host list), ranks fill the hosts in order, slots processes each, and
each worker's address is its host's; a host other than localhost and 127.0.0.1 is reached through the
agent (hosts.start). The output is shown as launch/output.py says. The exit status is the first
failure's (0 once every process exited 0): when one process fails, the others have GRACE_SECONDS to end
on their own, then are killed (launch/supervise.py); on Ctrl-C or the timeout all are killed at once.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from tf_adasum.launch.hosts import (
    GRACE_SECONDS,
    LOCAL_HOSTS,
    StartError,
    end_all,
    exit_status,
    free_ports,
    parse_hosts,
    start,
    tf_config,
)
from tf_adasum.launch.output import Output
from tf_adasum.launch.settings import LaunchSettings
from tf_adasum.launch.supervise import supervise


def launch(settings: LaunchSettings) -> int:
    """Runs settings.command as settings.np workers; returns the first non-zero exit status (a signal's
    as 128 + its number), 124 after the timeout, 130 on Ctrl-C, or 0 once every process exited 0.

    Raises:
        ValueError: a malformed host list.
        OSError: the output folder cannot be made or written (before any process starts).
        StartError: a process could not be started (those started before it are ended).
    """
    np = settings.np
    placed = parse_hosts(settings.hosts, np) if settings.hosts else ["127.0.0.1"] * np
    workers = [f"{host}:{port}" for host, port in zip(placed, free_ports(np), strict=True)]
    output = Output(settings.output_filename, ranks=np)
    processes: list[subprocess.Popen[bytes]] = []
    try:
        for rank in range(np):
            env = dict(os.environ, TF_ADASUM_LAUNCHER="1")
            env["TF_CONFIG"] = tf_config(workers, rank)
            try:
                proc = start(placed[rank], settings.command, env, settings.agent)
            except OSError as error:
                raise StartError(
                    f"could not start rank {rank} on {placed[rank]}"
                    + (f" through the agent {settings.agent!r}" if placed[rank] not in LOCAL_HOSTS else "")
                    + f": {error}; the {rank} process(es) already started were ended"
                ) from error
            output.follow(rank, proc.stdout, proc.stderr)
            processes.append(proc)
    except BaseException:
        end_all(processes)
        output.close()
        output.wait()
        raise
    deadline = None if settings.timeout is None else time.monotonic() + settings.timeout
    try:
        ending = supervise(processes, deadline, hung=lambda now, first, alone: now > first + GRACE_SECONDS)
    finally:
        output.wait()
    if ending.how == "interrupted":
        return 130
    failed = ending.first_failure()
    if failed is not None:
        return exit_status(ending.codes[failed])
    if ending.how == "timeout":
        sys.stderr.write(
            f"tf_adasum.run: killed all {np} processes after the {settings.timeout:.0f} s timeout\n"
        )
        return 124
    return 0
