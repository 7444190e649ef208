"""Existing scripts on real processes: plain Keras with AdasumCallback, Horovod scripts with
tf_adasum.keras, and failures (a NaN, uneven data, a killed rank). Each launch runs under mpirun or the
TF launcher, on 127.0.0.1, bounded by a timeout, and the 3-process scripts under horovodrun's Gloo mode
too; tests/workers/existing_scripts.py is what every process runs."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests import processes
from tests.processes import log_tail
from tests.test_training import Replica, mse_grads, simulate_replicas
from tests.workers.data import ACCUMULATION, BATCH, CASES, ROWS_PER_RANK, initial_weights, shard

# Launches real processes: `make test` runs these, `make test-fast` (-m 'not multiprocess') does not.
pytestmark = pytest.mark.multiprocess

WORKER = ["-m", "tests.workers.existing_scripts"]
# The plain Keras scripts under AdasumCallback (check_callback_run), and the Horovod scripts on
# tf_adasum.keras (check_horovod_run): the worker's modes, chained in one launch.
CALLBACK_MODES = "callback,mixed_precision,orthogonality"
HOROVOD_MODES = "example,average,accumulate,lazy,local_variables,sparse,resume_on_rank_0"
FAILURE_MODES = "nan,uneven_known,uneven_unknown,uneven_buckets"


def launch(launcher: str, p: int, out: Path, modes: str, peer_timeout: str | None = None) -> int:
    extra = {"TF_ADASUM_TIMEOUT_SECONDS": peer_timeout} if peer_timeout else None
    return processes.launch(launcher, p, out, [*WORKER, str(out), modes], extra)


def load(out: Path, name: str, p: int) -> tuple[list[dict[str, Any]], list[list[np.ndarray]]]:
    infos = [json.loads((out / f"{name}{r}.json").read_text()) for r in range(p)]
    weights = []
    for r in range(p):
        path = out / f"{name}{r}.npz"
        weights.append(list(np.load(path).values()) if path.exists() else [])
    return infos, weights


def simulate_processes(kind: str, p: int, sync_every: int, root: int) -> list[np.ndarray]:
    """Each process: its own shard and optimizer state, from root's weights; every sync: the tree."""
    batches = [
        [tuple(a[s * BATCH : (s + 1) * BATCH] for a in shard(r)) for s in range(ROWS_PER_RANK // BATCH)]
        for r in range(p)
    ]
    return simulate_replicas(kind, initial_weights(root), batches, sync_every)


def check_callback_run(out: Path, p: int) -> None:
    for i, (kind, sync_every, root, _) in enumerate(CASES):
        infos, weights = load(out, f"callback_case{i}_", p)
        want = simulate_processes(kind, p, sync_every, root % p)
        for r in range(p):
            assert infos[r]["plain_optimizer"], f"case {i}: rank {r} kept a patched optimizer"
            for got, first in zip(weights[r], weights[0], strict=True):
                np.testing.assert_array_equal(got, first)  # bitwise equal on every rank
        # Adam divides by sqrt(v): float32 rounding of small gradients moves it more than SGD.
        atol = 3e-5 if kind == "adam" else 3e-6
        for got, w in zip(weights[0], want, strict=True):
            np.testing.assert_allclose(got, w, rtol=3e-5, atol=atol, err_msg=f"case {i}: {CASES[i]}")
    # OrthogonalityMonitor under AdasumCallback: orthogonal steps give 1, equal steps 1/p.
    infos, _ = load(out, "orthogonality", p)
    for values in infos:
        assert values["orthogonality/orthogonal/kernel"] == pytest.approx(1.0, rel=1e-12), values
        assert values["orthogonality/parallel/kernel"] == pytest.approx(1 / p, rel=1e-12), values
    # mixed_float16, rank 1's first batch overflowing: every rank skips that step and halves its loss
    # scale (under AdasumCallback and DistributedOptimizer(op=Adasum)), then all step and sync alike.
    for case, sync_every in (("callback", 1), ("callback", 2), ("distributed_optimizer", 2)):
        infos, weights = load(out, f"mixed_{case}{sync_every}_", p)
        for r in range(p):
            assert infos[r]["skipped"] == {"scale": 2.0**14, "iterations": 0, "unchanged": True}, (case, r)
            assert infos[r]["iterations"] == sync_every, (case, r, infos[r])
            for got, first in zip(weights[r], weights[0], strict=True):
                assert np.all(np.isfinite(got))
                np.testing.assert_array_equal(got, first)


@pytest.fixture(scope="module", params=["mpi", "tf", "horovodrun"])
def three_processes(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, Path]:
    """One 3-process launch per launcher for the callback's runs and then the failure cases, in the same
    processes (a launch's start-up is most of its time): (launcher, its output folder)."""
    out = tmp_path_factory.mktemp(f"three_processes_{request.param}")
    code = launch(request.param, 3, out, f"{CALLBACK_MODES},{FAILURE_MODES}")
    assert code == 0, log_tail(out)
    return request.param, out


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


def check_horovod_run(out: Path, p: int) -> None:
    infos, weights = load(out, "example", p)
    for r in range(p):
        for got, first in zip(weights[r], weights[0], strict=True):
            np.testing.assert_array_equal(got, first)  # bitwise equal on every rank
        assert infos[r]["history"] == infos[0]["history"]  # MetricAverageCallback: the same logs everywhere
    history = infos[0]["history"]
    initial_lr = 0.001 * p  # the example's scaled_lr
    assert infos[0]["learning_rate"] == pytest.approx(initial_lr, rel=1e-6)  # after warm-up: initial_lr
    assert history["lr"][0] < initial_lr  # it did warm up
    assert history["accuracy"][-1] > 0.9, history
    assert len(list(out.glob("checkpoint-*.keras"))) == 4  # rank 0's ModelCheckpoint, once per epoch

    # DistributedOptimizer(op=Average): the same as one process stepping on both ranks' batches at once.
    _, averaged = load(out, "average", p)
    params = [w.astype(np.float64) for w in initial_weights(0)]
    sgd = Replica("sgd_momentum", params)
    data = [[a.astype(np.float64) for a in shard(r)] for r in range(p)]
    for step in range(ROWS_PER_RANK // BATCH):
        x = np.concatenate([d[0][step * BATCH : (step + 1) * BATCH] for d in data])
        y = np.concatenate([d[1][step * BATCH : (step + 1) * BATCH] for d in data])
        params = sgd.step(params, mse_grads(params, x, y), step + 1)
    for r in range(p):
        for got, want in zip(averaged[r], params, strict=True):
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
        for got, first in zip(averaged[r], averaged[0], strict=True):
            np.testing.assert_array_equal(got, first)

    # A model built in its first step (no Input) starts from rank 0's weights after the first batch.
    _, lazy = load(out, "lazy", p)
    for r in range(1, p):
        for mine, first in zip(lazy[r], lazy[0], strict=True):
            np.testing.assert_array_equal(mine, first)

    # Local variables stay each rank's own; everything else is bitwise the same everywhere.
    for op in ("Average", "Adasum"):
        _, results = load(out, f"local_{op}", p)
        for r in range(1, p):
            for shared, first in zip(results[r][:2], results[0][:2], strict=True):
                np.testing.assert_array_equal(shared, first)
            for own, first in zip(results[r][2:], results[0][2:], strict=True):
                assert not np.allclose(own, first), (op, r)

    # sparse_as_dense (Horovod's Embedding test): the average of every rank's IndexedSlices gradient is
    # the whole global batch's, as one plain model stepping on every rank's rows.
    infos, sparse = load(out, "sparse", p)
    for r in range(p):
        half = len(sparse[r]) // 2
        for got, want in zip(sparse[r][:half], sparse[r][half:], strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        for got, first in zip(sparse[r], sparse[0], strict=True):
            np.testing.assert_array_equal(got, first)
    assert infos[0]["moved"] > 1e-3, infos

    # Horovod's resume on rank 0 alone. Average: every rank's optimizer state is the same, so the
    # resumed run is bitwise the run that went on. Adasum: each rank's state is its own and rank 0's
    # file holds only rank 0's: the others resume from it (as if every rank had loaded that file) and
    # say so; each rank's own file resumes bitwise.
    for op in ("Average", "Adasum"):
        _, went_on = load(out, f"went_on_{op}", p)
        infos, rank0 = load(out, f"resumed_rank0_{op}", p)
        _, everywhere = load(out, f"resumed_all_{op}", p)
        reference = went_on if op == "Average" else everywhere
        for r in range(p):
            assert infos[r]["class"] == ("AdasumOptimizer" if op == "Adasum" else "AllreduceOptimizer")
            assert len(rank0[r]) == len(reference[r]) > 2
            for got, want in zip(rank0[r], reference[r], strict=True):
                np.testing.assert_array_equal(got, want)
            assert bool(infos[r]["warned"]) == (op == "Adasum" and r > 0), infos[r]
        if op == "Adasum":
            assert not np.allclose(rank0[1][0], went_on[1][0])  # rank 1's Adam state was not saved
            _, own = load(out, f"resumed_own_{op}", p)
            for r in range(p):
                for got, want in zip(own[r], went_on[r], strict=True):
                    np.testing.assert_array_equal(got, want)

    # Gradient accumulation, Horovod's formula: each rank sums k passes' gradients, they are all-reduced
    # (the mean, or the sum over ranks) once, divided by k with average_aggregated_gradients, applied.
    for name, (op, kind, k, average) in ACCUMULATION.items():
        infos, results = load(out, name, p)
        params = [w.astype(np.float64) for w in initial_weights(0)]
        stepper, summed = Replica(kind, params), [np.zeros_like(q) for q in params]
        steps = ROWS_PER_RANK // BATCH
        for step in range(2 * steps):
            rows = slice((step % steps) * BATCH, (step % steps + 1) * BATCH)
            grads = [mse_grads(params, d[0][rows], d[1][rows]) for d in data]
            reduced = [sum(g) / (p if op == "Average" else 1) for g in zip(*grads, strict=True)]
            summed = [s + g for s, g in zip(summed, reduced, strict=True)]
            if (step + 1) % k == 0:
                params = stepper.step(params, [s / k if average else s for s in summed], step + 1)
                summed = [np.zeros_like(q) for q in params]
        for r in range(p):
            assert infos[r]["iterations"] == 2 * steps, infos[r]
            for got, want, first in zip(results[r], params, results[0], strict=True):
                np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
                np.testing.assert_array_equal(got, first)


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


def check_resumed_from_the_backup(out: Path) -> None:
    for r in range(2):
        backup_info, backup = load(out, "killed_batch4_", 2)
        begin_info, begin = load(out, "resume_begin_", 2)
        assert begin_info[r]["iterations"] == backup_info[r]["iterations"] == 4
        for got, want in zip(begin[r], backup[r], strict=True):  # weights and this rank's own momentum
            np.testing.assert_array_equal(got, want)
    momentum = begin[0][begin_info[0]["weights"] :]
    assert not np.array_equal(momentum[0], begin[1][begin_info[1]["weights"]]), "per-rank state was lost"
    infos, final = load(out, "resumed", 2)
    assert [i["error"] for i in infos] == ["none", "none"], infos
    for got, first in zip(final[1], final[0], strict=True):
        np.testing.assert_array_equal(got, first)


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
