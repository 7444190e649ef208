"""Starts N processes with TF_CONFIG set, on this host or on several: the TF engine's mpirun.

Usage:
    python -m tf_adasum.run -np N [-H host:slots,...] [--agent CMD] [--timeout SECONDS]
        [--output-filename DIR] script.py [args ...]    (or -m module [args ...])

Every process gets a TF_CONFIG naming the N workers and its own index. Without -H all N run here, on
127.0.0.1. With -H (horovodrun's host list), ranks fill the hosts in order, slots processes each, and
each worker's address is its host's; a host other than localhost and 127.0.0.1 is reached through the
agent (default `ssh -o BatchMode=yes`; anything called as `AGENT HOST COMMAND`, as Open MPI's rsh
agent is), which runs `python script.py args` there, in this directory, with this process's environment
(sent on the agent's stdin, not on the command line, which that host's process list shows): the same
paths on every host. The output is shown as tf_adasum/launch_output.py says: in a log, whole lines
prefixed with "[rank]"; on a terminal, rank 0's progress bar alone. The exit code is the first
failure's (0 if all succeed). When one process fails, the others have GRACE_SECONDS to end on their
own (a dead peer's closed connections usually make tf_adasum raise PeerError in them at once, naming
it, and a script can report it), then are killed; on Ctrl-C or the timeout all are killed at once.
Killing a process on another host kills its agent: the namespace agent of scripts/cluster.py execs the
process itself, so it goes too; over ssh, have the remote side end with its connection (ssh -tt).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from tf_adasum.hosts import (
    DEFAULT_AGENT,
    GRACE_SECONDS,
    LOCAL_HOSTS,
    StartError,
    check_sizes,
    end_all,
    exit_status,
    free_ports,
    parse_hosts,
    start,
)
from tf_adasum.launch_output import Output


def launch(
    np: int,
    command: list[str],
    timeout: float | None = None,
    hosts: str | None = None,
    agent: str = DEFAULT_AGENT,
    output_filename: str | None = None,
) -> int:
    """Runs `command` as np workers; returns the first non-zero exit status (a signal's as 128 + its
    number), or 0 once every process exited 0.

    Args:
        np: how many processes.
        command: what each runs.
        timeout: seconds after which every process is killed (exit code 124).
        hosts: horovodrun's -H list; default all on 127.0.0.1.
        agent: how a process starts on a host that is not this one.
        output_filename: a folder for each rank's stdout and stderr (launch_output.py).

    Raises:
        ValueError: np below 1, a malformed host list, or a timeout that is not above 0.
        OSError: the output folder cannot be made or written (before any process starts).
        StartError: a process could not be started (those started before it are ended).
    """
    check_sizes(np, timeout)
    placed = parse_hosts(hosts, np) if hosts else ["127.0.0.1"] * np
    workers = [f"{host}:{port}" for host, port in zip(placed, free_ports(np), strict=True)]
    output = Output(output_filename, ranks=np)
    processes: list[subprocess.Popen[bytes]] = []
    try:
        for rank in range(np):
            env = dict(os.environ, TF_ADASUM_LAUNCHER="1")
            env["TF_CONFIG"] = json.dumps(
                {"cluster": {"worker": workers}, "task": {"type": "worker", "index": rank}}
            )
            try:
                proc = start(placed[rank], command, env, agent)
            except OSError as error:
                raise StartError(
                    f"could not start rank {rank} on {placed[rank]}"
                    + (f" through the agent {agent!r}" if placed[rank] not in LOCAL_HOSTS else "")
                    + f": {error}; the {rank} process(es) already started were ended"
                ) from error
            output.follow(rank, proc.stdout, proc.stderr)
            processes.append(proc)
    except BaseException:
        end_all(processes)
        output.close()
        output.wait()
        raise

    def kill_all() -> None:
        end_all([p for p in processes if p.poll() is None])

    deadline = None if timeout is None else time.monotonic() + timeout
    first_failure: tuple[int, float] | None = None
    try:
        while True:
            codes = [p.poll() for p in processes]
            failed = [c for c in codes if c not in (None, 0)]
            if failed and first_failure is None:
                first_failure = (exit_status(failed[0]), time.monotonic())
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
        output.wait()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-np", type=int, required=True, help="number of processes")
    parser.add_argument("--timeout", type=float, default=None, help="kill everything after this many seconds")
    parser.add_argument(
        "-H", "--hosts", default=None, help="host:slots,... as horovodrun's (default: this host)"
    )
    parser.add_argument(
        "--agent",
        default=DEFAULT_AGENT,
        help=f"starts a process on another host: AGENT HOST COMMAND ({DEFAULT_AGENT!r})",
    )
    elastic = parser.add_argument_group("elastic training (see docs/elastic.md)")
    elastic.add_argument("--elastic", action="store_true", help="go on when workers are lost or added")
    elastic.add_argument(
        "--min-np", type=int, default=None, help="the fewest workers to go on with (default -np)"
    )
    elastic.add_argument("--max-np", type=int, default=None, help="the most workers (default -np)")
    elastic.add_argument(
        "--host-discovery-script",
        default=None,
        help="prints the available host:slots lines; run every --host-discovery-interval seconds",
    )
    elastic.add_argument(
        "--host-discovery-interval",
        type=float,
        default=None,
        metavar="SECONDS",
        help="seconds between two runs of the discovery script (1, as Horovod's). A growth waits half of "
        "it on average before the launcher sees the new slots: a script that reads a file can run every "
        "0.1-0.25 s, one that asks a cloud's API should not",
    )
    elastic.add_argument("--reset-limit", type=int, default=None, help="the most resets (default: no limit)")
    elastic.add_argument(
        "--elastic-timeout", type=float, default=600.0, help="seconds to wait for --min-np slots (600)"
    )
    elastic.add_argument(
        "--state-dir", default=None, help="where processes leave their commits for the next group"
    )
    elastic.add_argument(
        "--resume-from", default=None, help="a group directory of STATE_DIR/job to resume from"
    )
    elastic.add_argument(
        "--standbys",
        type=int,
        default=None,
        help="warm processes kept waiting on each host for the next group, so a membership change costs "
        "no Python and TensorFlow start (default: the most slots the host has had, up to --max-np; 0: "
        "cold starts, and no fork server). They are forks of the host's one fork server, which imports "
        "TensorFlow once (about 0.7 GB); each shares its memory and holds about 15 MB of its own (the "
        "fork and its relay), and no CPU while it waits",
    )
    parser.add_argument(
        "--output-filename",
        default=None,
        help="a folder for every rank's stdout and stderr: DIR/rank.<r>/stdout and stderr (horovodrun's)",
    )
    # -m takes the rest of the line, as python's does: the module's own flags are not the launcher's.
    parser.add_argument(
        "-m",
        dest="module",
        nargs=argparse.REMAINDER,
        default=None,
        help="run a module, as python -m MODULE does",
    )
    parser.add_argument("script", nargs="?", default=None, help="the script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    if args.module is not None:
        if not args.module:
            parser.error("-m needs a module to run")
        args.module, args.script, args.args = args.module[0], None, args.module[1:]
    if args.module is None and args.script is None:
        parser.error("give the script to run, or -m MODULE")
    program = ["-m", args.module] if args.module else []
    command = [sys.executable, *program, *([args.script] if args.script else []), *args.args]
    try:
        check_sizes(args.np, args.timeout)
        if args.hosts and not args.elastic:
            parse_hosts(args.hosts, args.np)
    except ValueError as error:
        parser.error(str(error))
    elastic_only = [
        flag
        for flag, value in (
            ("--min-np", args.min_np),
            ("--max-np", args.max_np),
            ("--host-discovery-script", args.host_discovery_script),
            ("--host-discovery-interval", args.host_discovery_interval),
            ("--reset-limit", args.reset_limit),
            ("--state-dir", args.state_dir),
            ("--resume-from", args.resume_from),
            ("--standbys", args.standbys),
        )
        if value is not None
    ]
    if elastic_only and not args.elastic:
        parser.error(f"{', '.join(elastic_only)} only go with --elastic")
    if args.elastic:
        from tf_adasum.elastic_discovery import DEFAULT_INTERVAL_SECONDS
        from tf_adasum.elastic_launcher import elastic_launch

        if args.hosts and args.host_discovery_script:
            parser.error("give -H or --host-discovery-script, not both")
        try:
            code = elastic_launch(
                args.np,
                command,
                min_np=args.min_np,
                max_np=args.max_np,
                hosts=args.hosts,
                discovery_script=args.host_discovery_script,
                discovery_interval=(
                    DEFAULT_INTERVAL_SECONDS
                    if args.host_discovery_interval is None
                    else args.host_discovery_interval
                ),
                reset_limit=args.reset_limit,
                elastic_timeout=args.elastic_timeout,
                timeout=args.timeout,
                agent=args.agent,
                state_dir=args.state_dir,
                resume_from=args.resume_from,
                output_filename=args.output_filename,
                standbys=args.standbys,
            )
        except ValueError as error:
            parser.error(str(error))
        except (OSError, StartError) as error:
            _fail(error)
        sys.exit(code)
    try:
        sys.exit(launch(args.np, command, args.timeout, args.hosts, args.agent, args.output_filename))
    except (OSError, StartError) as error:
        _fail(error)


def _fail(error: BaseException) -> None:
    """Ends the launcher with `error` said in one line (no process of the job runs any more)."""
    sys.stderr.write(f"tf_adasum.run: {error}\n")
    sys.exit(1)


if __name__ == "__main__":
    main()
