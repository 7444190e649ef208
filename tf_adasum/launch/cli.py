"""`python -m tf_adasum.run`: the command line, read into one settings object and dispatched to the static
launch (launch/static.py) or the elastic one (launch/elastic/driver.py), as Horovod's runner reads.

Usage:
    python -m tf_adasum.run -np N [-H host:slots,...] [--agent CMD] [--timeout SECONDS]
        [--output-filename DIR] [--elastic ...] script.py [args ...]    (or -m module [args ...])

Every process gets a TF_CONFIG naming the N workers and its own index, and runs `python script.py args`
(or `python -m module args`). Without -H all N run here, on 127.0.0.1; with -H (horovodrun's host
list) ranks fill the hosts in order, and a host other than localhost is reached through the agent
(default `ssh -o BatchMode=yes`, called as `AGENT HOST COMMAND`), with this process's environment sent
on its stdin. The exit code is the first failure's (0 if all succeed); the timeout's 124. With
--elastic the job goes on when workers are lost or added (docs/elastic.md).
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from tf_adasum.launch.hosts import DEFAULT_AGENT, StartError, parse_hosts
from tf_adasum.launch.settings import ElasticSettings, LaunchSettings

# The flags that only an elastic launch takes, with their settings' names.
ELASTIC_ONLY = {
    "--min-np": "min_np",
    "--max-np": "max_np",
    "--host-discovery-script": "host_discovery_script",
    "--host-discovery-interval": "host_discovery_interval",
    "--reset-limit": "reset_limit",
    "--state-dir": "state_dir",
    "--resume-from": "resume_from",
    "--standbys": "standbys",
}


def parser() -> argparse.ArgumentParser:
    """The launcher's flags: horovodrun's, where they fit."""
    parser = argparse.ArgumentParser(
        prog="python -m tf_adasum.run",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
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
    parser.add_argument(
        "--output-filename",
        default=None,
        help="a folder for every rank's stdout and stderr: DIR/rank.<r>/stdout and stderr (horovodrun's)",
    )
    _elastic_flags(parser)
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
    return parser


def _elastic_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("elastic training (see docs/elastic.md)")
    group.add_argument("--elastic", action="store_true", help="go on when workers are lost or added")
    group.add_argument(
        "--min-np", type=int, default=None, help="the fewest workers to go on with (default -np)"
    )
    group.add_argument("--max-np", type=int, default=None, help="the most workers (default -np)")
    group.add_argument(
        "--host-discovery-script",
        default=None,
        help="prints the available host:slots lines; run every --host-discovery-interval seconds",
    )
    group.add_argument(
        "--host-discovery-interval",
        type=float,
        default=None,
        metavar="SECONDS",
        help="seconds between two runs of the discovery script (1, as Horovod's). A growth waits half of "
        "it on average before the launcher sees the new slots: a script that reads a file can run every "
        "0.1-0.25 s, one that asks a cloud's API should not",
    )
    group.add_argument("--reset-limit", type=int, default=None, help="the most resets (default: no limit)")
    group.add_argument(
        "--elastic-timeout", type=float, default=600.0, help="seconds to wait for --min-np slots (600)"
    )
    group.add_argument(
        "--state-dir",
        default=None,
        help="where processes leave their commits for the next group (default: a new private folder)",
    )
    group.add_argument("--resume-from", default=None, help="a group folder of STATE_DIR/job to resume from")
    group.add_argument(
        "--standbys",
        type=int,
        default=None,
        help="warm processes kept waiting on each host for the next group, so a membership change costs "
        "no Python and TensorFlow start (default: the most slots the host has had, up to --max-np; 0: "
        "cold starts, and no fork server). They are forks of the host's one fork server, which imports "
        "TensorFlow once (about 0.7 GB); each shares its memory and holds about 15 MB of its own (the "
        "fork and its relay), and no CPU while it waits",
    )


def settings_from(args: argparse.Namespace) -> LaunchSettings:
    """The settings the parsed command line asks for.

    Raises:
        ValueError: no program to run, an elastic flag without --elastic, or sizes no job can keep.
    """
    if args.module is not None:
        if not args.module:
            raise ValueError("-m needs a module to run")
        args.module, args.script, args.args = args.module[0], None, args.module[1:]
    if args.module is None and args.script is None:
        raise ValueError("give the script to run, or -m MODULE")
    program = ["-m", args.module] if args.module else []
    command = [sys.executable, *program, *([args.script] if args.script else []), *args.args]
    common = {
        "np": args.np,
        "command": command,
        "hosts": args.hosts,
        "agent": args.agent,
        "timeout": args.timeout,
        "output_filename": args.output_filename,
    }
    if not args.elastic:
        given = [flag for flag, name in ELASTIC_ONLY.items() if getattr(args, name) is not None]
        if given:
            raise ValueError(f"{', '.join(given)} only go with --elastic")
        settings = LaunchSettings(**common)
        if settings.hosts:
            parse_hosts(settings.hosts, settings.np)
        return settings
    elastic = {
        "min_np": args.min_np,
        "max_np": args.max_np,
        "discovery_script": args.host_discovery_script,
        "reset_limit": args.reset_limit,
        "elastic_timeout": args.elastic_timeout,
        "state_dir": args.state_dir,
        "resume_from": args.resume_from,
        "standbys": args.standbys,
    }
    if args.host_discovery_interval is not None:
        elastic["discovery_interval"] = args.host_discovery_interval
    return ElasticSettings(**common, **elastic)


def run(settings: LaunchSettings) -> int:
    """Launches the job `settings` describe; returns its exit code."""
    if isinstance(settings, ElasticSettings):
        from tf_adasum.launch.elastic.driver import elastic_launch

        return elastic_launch(settings)
    from tf_adasum.launch.static import launch

    return launch(settings)


def main(argv: list[str] | None = None) -> NoReturn:
    """Parses the command line and runs the job; exits with its code. A usage error exits 2, a job that
    could not start 1, each said in one line."""
    arguments = parser()
    try:
        settings = settings_from(arguments.parse_args(argv))
    except ValueError as error:
        arguments.error(str(error))
    try:
        sys.exit(run(settings))
    except ValueError as error:
        arguments.error(str(error))
    except (OSError, StartError) as error:
        sys.stderr.write(f"tf_adasum.run: {error}\n")
        sys.exit(1)
