"""Existing scripts run by hand's way, for the tests: launching tests/workers/existing_scripts.py,
reading what it wrote, the numpy simulation of its processes, and the checks of its runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.support import processes
from tests.support.processes import log_tail
from tests.support.training import Replica, mse_grads, simulate_replicas
from tests.workers.data import ACCUMULATION, BATCH, CASES, ROWS_PER_RANK, initial_weights, shard

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
