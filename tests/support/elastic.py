"""Elastic jobs for the tests: launching tests/workers/elastic.py under the elastic launcher, and
reading what its processes wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from tests.support.processes import ROOT
from tf_adasum.elastic.state import read_commits
from tf_adasum.launch.elastic.commits import KEY_FILE, read_key

WORKER = ["-m", "tests.workers.elastic"]


LAUNCH_TIMEOUT = 240


PEER_TIMEOUT = "15"


def launch(
    out: Path,
    mode: str,
    np_: int,
    *flags: str,
    env: dict[str, str] | None = None,
    timeout: float = LAUNCH_TIMEOUT,
) -> tuple[int, str, float]:
    """Runs the worker elastically; returns (exit code, the launcher's and workers' output, seconds)."""
    out.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable, "-m", "tf_adasum.run", "--elastic", "-np", str(np_),
        "--timeout", str(timeout - 20),
        "--state-dir", str(out / "state"), *flags, *WORKER, str(out), mode,
    ]  # fmt: skip
    environ = dict(
        os.environ,
        PYTHONPATH=str(ROOT),
        TF_ADASUM_TIMEOUT_SECONDS=PEER_TIMEOUT,
        TF_CPP_MIN_LOG_LEVEL="3",
        PYTHONFAULTHANDLER="1",  # a worker that dies of a signal prints its threads' stacks
        **(env or {}),
    )
    started = time.monotonic()
    done = subprocess.run(
        command, cwd=out, env=environ, capture_output=True, text=True, timeout=timeout, check=False
    )
    log = done.stdout + done.stderr
    (out / "output.log").write_text(log)
    return done.returncode, log, time.monotonic() - started


def tail(log: str) -> str:
    lines = [line for line in log.splitlines() if "oneDNN" not in line and "absl::" not in line]
    return "\n".join(lines[-40:])


def read(out: Path, name: str, size: int) -> list[dict]:
    return [json.loads((out / f"{name}-rank{r}.json").read_text()) for r in range(size)]


def weights(out: Path, size: int) -> list[list[np.ndarray]]:
    loaded = [np.load(out / f"final-rank{r}.npz") for r in range(size)]
    return [[f[k] for k in sorted(f.files)] for f in loaded]


def assert_same_on_every_rank(found: list[list[np.ndarray]]) -> None:
    for other in found[1:]:
        for a, b in zip(found[0], other, strict=True):
            np.testing.assert_array_equal(a, b)


def commits_in(path: Path) -> dict[int, Any]:
    """The commits in a state file (STATE_DIR/group<g>/... or STATE_DIR/job/group<g>/...), checked under
    the job's key, which lies in STATE_DIR/job."""
    state_dir = next(p for p in path.parents if (p / "job" / KEY_FILE).exists())
    return read_commits(path.read_bytes(), read_key(str(state_dir / "job")), str(path))


def committed_optimizer(path: Path, commit: int) -> list[float]:
    """The optimizer digest (tests/workers/elastic.py's record) of a commit in a survivor's state file."""
    return [float(np.sum(np.abs(parts[0]))) for parts in commits_in(path)[commit]["optimizer"]]
