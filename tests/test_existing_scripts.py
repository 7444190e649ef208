"""Existing scripts on real processes: plain Keras with AdasumCallback, Horovod scripts with
tf_adasum.keras, and failures (a NaN, uneven data, a killed rank). Each launch runs under mpirun or the
TF launcher, on 127.0.0.1, bounded by a timeout, and the 3-process scripts under horovodrun's Gloo mode
too; tests/workers/existing_scripts.py is what every process runs."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from tests.support.processes import log_tail
from tests.support.scripts import (
    HOROVOD_MODES,
    check_callback_run,
    check_horovod_run,
    check_resumed_from_the_backup,
    launch,
    load,
    simulate_processes,
)
from tests.workers.data import CASES

# Launches real processes: `make test` runs these, `make test-fast` (-m 'not multiprocess') does not.
pytestmark = pytest.mark.multiprocess


def test_adasum_callback_on_three_processes_equals_the_simulation(three_processes: tuple[str, Path]) -> None:
    launcher, tmp_path = three_processes
    check_callback_run(tmp_path, 3)
    infos, _ = load(tmp_path, "callback_case0_", 3)
    for info in infos:  # the engine the launcher starts: MPI under mpirun, the TF engine's workers else
        assert info["engine"] == ("mpi" if launcher == "mpi" else "tf") and info["size"] == 3, info
        assert (info["workers"] is None) == (launcher == "mpi"), info
        # horovodrun's Gloo mode: the TF engine started from its rendezvous store (Horovod's own Adasum
        # aborts at 3 ranks and refuses Gloo).
        assert (info["rendezvous"] is not None) == (launcher == "horovodrun"), info


def test_the_simulation_can_tell_root_and_sync_every_apart() -> None:
    # The oracle above is only a check if the cases it separates really end in different places.
    ends = [simulate_processes(kind, 3, k, root)[0] for kind, k, root, _ in CASES]
    for i in range(len(ends)):
        for j in range(i + 1, len(ends)):
            assert not np.allclose(ends[i], ends[j], atol=1e-3), (CASES[i], CASES[j])
    without_sync = simulate_processes("sgd_momentum", 3, 1000, 0)[0]
    assert not np.allclose(ends[0], without_sync, atol=1e-3)


@pytest.mark.parametrize("launcher", ["mpi", "tf"])
def test_the_horovod_example_runs_with_tf_adasum_keras(launcher: str, tmp_path: Path) -> None:
    code = launch(launcher, 2, tmp_path, HOROVOD_MODES)
    assert code == 0, log_tail(tmp_path)
    check_horovod_run(tmp_path, 2)


def test_a_nan_or_uneven_data_stops_every_rank_with_the_same_error(three_processes: tuple[str, Path]) -> None:
    # The layers' names count the models the process built before (sequential_8/dense_8/kernel).
    kernel = r"rank 1: tensor 0 of 2 \(sequential\w*/dense\w*/kernel\) holds NaN or Inf"
    ran_out = re.escape("rank(s) [1] ran out of data (rank 1 after 2 batches")
    for case, error, says in [
        ("nan", "NonFiniteUpdateError", kernel),
        ("uneven_known", "UnevenDataError", re.escape("(rank 0: 4, rank 1: 3, rank 2: 4)")),
        ("uneven_unknown", "UnevenDataError", ran_out),
        ("uneven_buckets", "UnevenDataError", ran_out),
    ]:
        infos, _ = load(three_processes[1], case, 3)
        for r in range(3):
            seen = infos[r]
            assert seen["error"] == error and re.search(says, seen["message"]), (case, r, seen)
            assert seen["message"] == infos[0]["message"]  # the same error on every rank
            assert "steps_per_epoch" in seen["message"] or case == "nan"
            assert seen["seconds"] < 20, (case, r, seen)  # far below the 60 s peer timeout: no waiting


def test_a_killed_rank_stops_the_others_and_backup_and_restore_resumes_tf_engine(tmp_path: Path) -> None:
    code = launch("tf", 2, tmp_path, "killed")
    assert code != 0, log_tail(tmp_path)
    seen = json.loads((tmp_path / "killed0.json").read_text())
    assert seen["error"] == "PeerError" and "lost rank 1" in seen["message"], seen
    assert seen["seconds"] < 30, seen
    assert launch("tf", 2, tmp_path, "resume_from_backup") == 0, log_tail(tmp_path)
    check_resumed_from_the_backup(tmp_path)


def test_a_killed_rank_ends_the_mpi_job_and_backup_and_restore_resumes(tmp_path: Path) -> None:
    # Open MPI itself ends the job within a second and names the rank; nobody waits for it.
    code = launch("mpi", 2, tmp_path, "killed")
    assert code != 0 and "process rank 1" in log_tail(tmp_path), log_tail(tmp_path)
    assert launch("mpi", 2, tmp_path, "resume_from_backup") == 0, log_tail(tmp_path)
    check_resumed_from_the_backup(tmp_path)


def test_a_hung_mpi_rank_gives_peer_error_inside_fit(tmp_path: Path) -> None:
    code = launch("mpi", 2, tmp_path, "hung", peer_timeout="10")
    assert code != 0, log_tail(tmp_path)
    seen = json.loads((tmp_path / "hung0.json").read_text())
    assert seen["error"] == "PeerError" and "rank(s) [1]" in seen["message"], seen
    assert 10 <= seen["seconds"] < 40, seen
