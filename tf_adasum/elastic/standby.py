"""A warm process of the elastic launcher's pool (tf_adasum/launch/elastic/pool.py): `python -m
tf_adasum.elastic.standby`, started by the launcher, never by hand.

It imports TensorFlow, Keras and tf_adasum (importing starts no TensorFlow context, so the collective
runtime can still be configured), connects to the launcher's pool, where each side proves it holds the
job's key (a pool that does not is refused, and nothing it says is run), and waits.
Given a place in a group, it takes that place's environment, arguments and directory, starts tf_adasum
as `import tf_adasum` would have in a process launched there (the TF engine, the elastic hook), and
runs the job's script as `python script.py args` or `python -m module args` would: as __main__, its
directory first on sys.path. Told nothing (the launcher closed the connection), it exits 0.
"""

from __future__ import annotations

import os
import runpy
import sys
from typing import Any

import keras  # noqa: F401  (warm: the imports a script makes first)
import tensorflow  # noqa: F401

import tf_adasum
from tf_adasum.launch.elastic.pool import ENV_STANDBY
from tf_adasum.launch.protocol import ENV_POOL
from tf_adasum.launch.secret import ENV_SECRET, AuthenticationError, PeerClosed
from tf_adasum.launch.service import connect


def _assignment(pool: str, secret: str) -> dict[str, Any] | None:
    """This process's place, from the launcher's pool at `pool`; None when told nothing."""
    channel = connect(pool, secret, timeout=30)
    try:
        channel.send({"standby": os.environ[ENV_STANDBY]})
        channel.connection.settimeout(None)
        assignment, _ = channel.receive()
    except PeerClosed:  # the launcher closed the connection
        return None
    finally:
        channel.close()
    return assignment


def main() -> int:
    pool, secret = os.environ[ENV_POOL], os.environ[ENV_SECRET]
    try:
        assignment = _assignment(pool, secret)
    except AuthenticationError as error:
        print(f"tf_adasum.elastic.standby: the pool at {pool}: {error}", file=sys.stderr)
        return 1
    if assignment is None:
        return 0
    os.environ.clear()
    os.environ.update({**assignment["env"], ENV_SECRET: secret})
    os.chdir(assignment["cwd"])
    argv = list(assignment["argv"])
    tf_adasum._start_as_launched()
    if argv[:1] == ["-m"]:
        sys.argv = argv[1:]
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
