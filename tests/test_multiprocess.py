"""Real processes on 127.0.0.1: Open MPI through mpirun, and TensorFlow's collective runtime through
tf_adasum.run. Every launch is bounded by a timeout; one launch runs all checks for one (engine, P)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

import tf_adasum
from tests.support import oracle, processes
from tests.support.processes import log_tail
from tests.workers.data import (
    DEVICE_CASES,
    LANE_SHAPES,
    LOCAL,
    PIPELINE_SHAPES,
    PROCESS_WRITES,
    REPLICA_COUNTS,
    RESUMED,
    SHAPES,
    STEPS,
    lane_tensors,
    local_counts,
    pipeline_one,
    pipeline_tensors,
    rank_tensors,
    replica_tensors,
    saved,
)

# Launches real processes: `make test` runs these, `make test-fast` (-m 'not multiprocess') does not.
pytestmark = pytest.mark.multiprocess

WORKER = ["-m", "tests.workers.multiprocess"]
DEVICES_WORKER = ["-m", "tests.workers.multiprocess_devices"]


def launch(engine: str, p: int, out: Path, modes: str, extra_env: dict[str, str] | None = None) -> int:
    return processes.launch(engine, p, out, [*WORKER, str(out), modes], extra_env)


# The default algorithm (vhdd.algorithm: VHDD under MPI; for data this small, one all-gather under
# the TF engine), and each forced where the default is the other: the TF engine's VHDD with a fold (3)
# and with two levels (4), MPI's all-gather. Under MPI, powers of two, a fold of one (3), a fold of one
# over two levels (5) and a prime with a fold of three over two levels (7).
@pytest.mark.parametrize(
    ("engine", "p", "forced"),
    [("mpi", p, "") for p in (2, 3, 4, 5, 7)]
    + [("tf", 2, ""), ("tf", 3, "")]
    + [("mpi", 3, "gather"), ("tf", 3, "vhdd"), ("tf", 4, "vhdd")],
)
def test_allreduce_across_processes(engine: str, p: int, forced: str, tmp_path: Path) -> None:
    env = {"TF_ADASUM_ALGORITHM": forced} if forced else None
    code = launch(engine, p, tmp_path, "collectives,refusals", env)
    assert code == 0, log_tail(tmp_path)
    results = [dict(np.load(tmp_path / f"rank{r}.npz")) for r in range(p)]
    collectives = [json.loads((tmp_path / f"collectives{r}.json").read_text()) for r in range(p)]
    infos = [json.loads((tmp_path / f"refusals{r}.json").read_text()) for r in range(p)]

    want = oracle.tree([rank_tensors(r) for r in range(p)])
    for i, w in enumerate(want):
        got = results[0][f"adasum_eager_{i}"]
        dtype = SHAPES[i][1]
        assert str(results[0][f"dtype_{i}"]) == dtype and got.shape == w.shape
        # Each of the tree's log2(P) + 1 levels rounds to the dtype once.
        rtol = {"float16": 5e-3, "bfloat16": 4e-2, "float32": 1e-5, "float64": 1e-11}[dtype]
        np.testing.assert_allclose(got, w, rtol=rtol, atol=rtol * np.max(np.abs(w), initial=1.0))
        for r in range(p):  # bitwise identical on every rank, in and out of tf.function
            np.testing.assert_array_equal(results[r][f"adasum_eager_{i}"], got)
            np.testing.assert_array_equal(results[r][f"adasum_function_{i}"], got)
            np.testing.assert_array_equal(results[r][f"adasum_again_{i}"], got)

    # Several replicas per process. Two each: each process's tree, then VHDD over processes; three, or
    # 1, 2, 3, 1, ...: the tree splits inside processes, and the result is adasum_tree's over all the
    # replicas in one process, bit for bit.
    for case in ("two", "three", "uneven"):
        leaves = [x for q in range(p) for x in replica_tensors(case, p, q)]
        assert len(leaves) == sum(local_counts(case, p))
        if case == "two":
            want = oracle.tree(leaves)
        else:
            want = [
                saved(t) for t in tf_adasum.adasum_tree([[tf.constant(x) for x in leaf] for leaf in leaves])
            ]
        for i, w in enumerate(want):
            got = results[0][f"{case}_eager_{i}"]
            if case == "two":
                rtol = {"float16": 5e-3, "bfloat16": 4e-2, "float32": 1e-5, "float64": 1e-11}[SHAPES[i][1]]
                np.testing.assert_allclose(got, w, rtol=rtol, atol=rtol * np.max(np.abs(w), initial=1.0))
            else:
                np.testing.assert_array_equal(got, w)
            for r in range(p):
                np.testing.assert_array_equal(results[r][f"{case}_eager_{i}"], got)
                np.testing.assert_array_equal(results[r][f"{case}_function_{i}"], got)

    for r in range(p):
        np.testing.assert_array_equal(results[r]["empty"], [0, 0])
        assert "a subtree result overflows float16" in infos[r]["narrowed"], infos[r]
        assert infos[r]["replica_mismatch"].startswith(
            "allreduce_replicas: rank 0: tensor 0 of 7 has shape [1]"
        )
        assert f"rank {p - 1}: tensor 5 of 7 holds NaN" in infos[r]["replica_nonfinite"], infos[r]
        np.testing.assert_array_equal(results[r]["sum"], [sum(range(p)), p])
        np.testing.assert_allclose(results[r]["average"], [(p - 1) / 2])
        assert results[r]["scalar_sum"].shape == () and results[r]["scalar_sum"] == 2.5 * p
        np.testing.assert_array_equal(results[r]["broadcast"], [10.0 * (p - 1), 1.0])
        assert collectives[r]["engine"] == engine and collectives[r]["size"] == p
        # Eager Adasum under the TF engine: one compiled function per signature, reused (the tensors;
        # then the mismatched pair, the mismatched big one, the NaN pair); MPI runs it on the host.
        assert collectives[r]["compiled_syncs"] == (1 if engine == "tf" else 0), collectives[r]
        assert infos[r]["compiled_syncs"] == (3 if engine == "tf" else 0), infos[r]
        assert infos[r]["drift"].startswith(
            "allreduce(op=Adasum): tensor 0 of 1 has shape [1048592] and dtype float32 on rank 1 but "
            "shape [16]"
        ), infos[r]
        assert infos[r]["uneven"].startswith("rank(s) [0] ran out of data (rank 0 after 7 batches"), infos[r]
        assert infos[r]["different"].startswith(
            "the ranks are at different checks (rank 0: a mixed-precision check, rank 1: a model sync"
        ), infos[r]
        # The norms measured while fusing (MPI) or by the op (TF) find the NaN in the bfloat16 tensor.
        assert f"rank {p - 1}: tensor 1 of 2 holds NaN or Inf" in infos[r]["nonfinite"], infos[r]
        assert infos[r]["mismatch"] == (
            "allreduce(op=Adasum): tensor 0 of 2 has shape [4, 6] and dtype float32 on rank 1 "
            "but shape [4, 5] and dtype float32 on rank 0"
        )
    assert sorted(info["local_rank"] for info in collectives) == list(range(p))


@pytest.mark.parametrize("algorithm", ["vhdd", "gather"])
def test_large_exchanges_in_lanes_give_the_tree_and_the_same_bits_everywhere(
    algorithm: str, tmp_path: Path
) -> None:
    """The TF engine sends an exchange or an all-gather of 2 MiB or more as several collectives in lanes
    of their own (TFCollectiveCommunicator.LANES), which run at once. VHDD: through a fold, a halving
    level, a gather and the result to the folded rank (3 processes). The gather: every buffer's, and one
    buffer's with the agreement's codes in it. Both: one exchange of unequal sizes, and a rank at its
    epoch end against the others' traced sync, which every rank refuses with nothing left pending."""
    code = launch("tf", 3, tmp_path, "lanes", {"TF_ADASUM_ALGORITHM": algorithm})
    assert code == 0, log_tail(tmp_path)
    results = [dict(np.load(tmp_path / f"lanes{r}.npz")) for r in range(3)]
    want = oracle.tree([lane_tensors(r) for r in range(3)])
    for i, w in enumerate(want):
        got = results[0][f"eager_{i}"]
        rtol = {"float32": 1e-5, "bfloat16": 4e-2}[LANE_SHAPES[i][1]]
        np.testing.assert_allclose(got.astype(np.float64), w, rtol=rtol, atol=rtol * np.max(np.abs(w)))
        for r in range(3):
            np.testing.assert_array_equal(results[r][f"eager_{i}"], got)
            np.testing.assert_array_equal(results[r][f"function_{i}"], got)
    np.testing.assert_array_equal(results[0]["exchanged"], lane_tensors(1)[0][:524289])
    np.testing.assert_array_equal(results[1]["exchanged"], lane_tensors(0)[0])
    if algorithm == "gather":  # 3 MiB and the codes: 3 lanes of 1 MiB, the agreement in the first
        assert int(results[0]["single_gathers"]) == 3, results[0]["single_gathers"]
    alone = oracle.tree([lane_tensors(r)[:1] for r in range(3)])[0]
    single = results[0]["single"]
    np.testing.assert_allclose(single.astype(np.float64), alone, rtol=1e-5, atol=1e-5 * np.max(np.abs(alone)))
    for r in range(3):
        assert "ran out of data" in str(results[r]["uneven"]), results[r]["uneven"]
        np.testing.assert_array_equal(results[r]["single"], single)
        np.testing.assert_array_equal(results[r]["after"], single)


@pytest.mark.parametrize("p", [3, 4])
def test_vhdd_as_a_pipeline_of_chunks_gives_the_tree_and_the_same_bits_everywhere(
    p: int, tmp_path: Path
) -> None:
    """The TF engine runs a large buffer's VHDD as a pipeline of chunks of whole tensors, each step
    (fold, halving and gather levels, result to the folded rank) ordered only among the chunks' same
    step (vhdd.pipelined_tensors). Through a fold (3 processes) and two levels (4), two dtypes."""
    code = launch("tf", p, tmp_path, "pipeline", {"TF_ADASUM_ALGORITHM": "vhdd"})
    assert code == 0, log_tail(tmp_path)
    results = [dict(np.load(tmp_path / f"pipeline{r}.npz")) for r in range(p)]
    want = oracle.tree([pipeline_tensors(r) for r in range(p)])
    for i, w in enumerate(want):
        got = results[0][f"eager_{i}"]
        rtol = {"float32": 1e-5, "bfloat16": 4e-2}[PIPELINE_SHAPES[i][1]]
        np.testing.assert_allclose(got.astype(np.float64), w, rtol=rtol, atol=rtol * np.max(np.abs(w)))
        # One VHDD over the whole buffer cuts a tensor's dot products into other partial sums.
        whole = results[0][f"whole_{i}"].astype(np.float64)
        np.testing.assert_allclose(
            got.astype(np.float64), whole, rtol=rtol / 10, atol=rtol / 10 * np.max(np.abs(w))
        )
        for r in range(p):
            np.testing.assert_array_equal(results[r][f"eager_{i}"], got)
            np.testing.assert_array_equal(results[r][f"function_{i}"], got)
            np.testing.assert_array_equal(results[r][f"whole_{i}"], results[0][f"whole_{i}"])
    stages = int(results[0]["stages"])
    assert stages == {3: 4, 4: 4}[p]
    # The pipeline's collectives take the token of every step a rank takes part in (no chunk is large
    # enough for lanes), the agreement its own: at 3 processes rank 1 is folded away (the fold and the
    # result) and rank 2 sits out the fold (the two levels). One VHDD a buffer takes only the
    # agreement's token and, for the fold's 2.6 MB at 3 processes, two lanes'.
    pipelined = [int(results[r]["tokens_pipelined"]) for r in range(p)]
    whole = [int(results[r]["tokens_whole"]) for r in range(p)]
    assert pipelined == {3: [stages + 1, 3, 3], 4: [stages + 1] * 4}[p], pipelined
    assert whole == {3: [3, 3, 1], 4: [1] * 4}[p], whole
    # Which steps: the fold is step 0, the levels 1 and 2, the result 3 (at 4 processes: the halving
    # levels 0 and 1, the gather levels 2 and 3), on every rank the same numbers for the same step.
    steps = [results[r]["steps_pipelined"].tolist() for r in range(p)]
    assert steps == {3: [[0, 1, 2, 3], [0, 3], [1, 2]], 4: [[0, 1, 2, 3]] * 4}[p], steps
    # With lanes from 32 KiB, every step's exchanges go in its lanes: the same steps, more tokens (each
    # lane's of each step), and the same bits, since lanes move bits only.
    for r in range(p):
        for i in range(len(want)):
            np.testing.assert_array_equal(results[r][f"lanes_{i}"], results[r][f"function_{i}"])
        assert results[r]["steps_lanes"].tolist() == steps[r]
        assert int(results[r]["tokens_lanes"]) > pipelined[r] + len(steps[r]), (r, results[r]["tokens_lanes"])

    # One tensor of 12 PIPELINE_BYTES: where the gather has two levels (4 processes) it goes in 8
    # parts, each part through both gather levels; it moves bits only, so the same bits as one VHDD.
    want = oracle.tree([[pipeline_one(r)] for r in range(p)])[0]
    got = results[0]["one_eager"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.max(np.abs(want)))
    for r in range(p):
        for kind in ("one_eager", "one_function", "one_whole"):
            np.testing.assert_array_equal(results[r][kind], got)
    one_steps = [results[r]["one_steps"].tolist() for r in range(p)]
    per_step = [results[r]["one_per_step"].tolist() for r in range(p)]
    if p == 4:
        # The halving levels once each (steps 0 and 1), each gather level in 8 parts (steps 2 and 3).
        assert one_steps == [[0, 1, 2, 3]] * 4, one_steps
        assert [s[2:] for s in per_step] == [[8, 8]] * 4, per_step
    else:  # one gather level: nothing to overlap, so one VHDD as before, on the shared token
        assert one_steps == [[]] * 3, one_steps
        assert [int(results[r]["one_tokens"]) for r in range(p)] == [
            int(results[r]["one_whole_tokens"]) for r in range(p)
        ]


@pytest.mark.parametrize(("engine", "mode"), [("mpi", "absent"), ("tf", "dead")])
def test_a_missing_peer_gives_an_error_naming_it(engine: str, mode: str, tmp_path: Path) -> None:
    code = launch(engine, 2, tmp_path, mode, {"TF_ADASUM_TIMEOUT_SECONDS": "10"})
    log = (tmp_path / "output.log").read_text()
    assert code != 0, log[-3000:]
    info = json.loads((tmp_path / "rank0.json").read_text())
    assert info["message"].startswith("rank 0:") and "[1]" in info["message"], info["message"]
    assert info["seconds"] < 60, info


def test_a_long_fast_run_holds_a_bounded_number_of_threads(tmp_path: Path) -> None:
    """At the default timeout (300 s), TensorFlow's timeout of a collective parked a thread for the whole
    300 s, however soon the collective ended, so the TF engine's process held one thread per
    collective of the last 5 minutes: 5,600 after 40 s of short fits, until it aborted. And the iterator
    release kept every iterator of a loop of short fits it could not free as fast (20 threads a fit).
    Both are bounded now, whatever the run's length."""
    code = launch("tf", 2, tmp_path, "threads", {"TF_ADASUM_TIMEOUT_SECONDS": "300"})
    assert code == 0, log_tail(tmp_path)
    for r in range(2):
        info = json.loads((tmp_path / f"threads{r}.json").read_text())
        # About 150 at rest; 300 compiled all-reduces were over 1,000 collectives, and 60 fits 1,200
        # threads, before.
        assert info["after_collectives"] < 500 and info["after_fits"] < 500, info


def test_an_mpi_rank_that_exits_ends_the_job_naming_it(tmp_path: Path) -> None:
    # Open MPI itself detects a process that exits without MPI_Finalize and kills the job.
    code = launch("mpi", 2, tmp_path, "dead", {"TF_ADASUM_TIMEOUT_SECONDS": "60"})
    log = (tmp_path / "output.log").read_text()
    assert code != 0 and "process rank 1" in log, log[-3000:]


@pytest.fixture(scope="module", params=["mpi", "tf"])
def fit_and_strategy(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One launch per engine for the three tests below: fit with AdasumOptimizer, AdasumStrategy's
    modes, then resuming from checkpoints, in the same two processes (a launch's start-up is most of
    its time here)."""
    out = tmp_path_factory.mktemp(f"fit_and_strategy_{request.param}")
    code = launch(request.param, 2, out, "fit,strategy,batchnorm,from_function,mixed_precision,resume")
    assert code == 0, log_tail(out)
    return out


def test_fit_with_adasum_optimizer_across_two_processes(fit_and_strategy: Path) -> None:
    from tests.support.training import simulate

    tmp_path = fit_and_strategy
    weights = [list(np.load(tmp_path / f"fit{r}.npz").values()) for r in range(2)]
    want = simulate("sgd_momentum", 2, 1, 4, 8)
    for got, theirs, w in zip(weights[0], weights[1], want, strict=True):
        np.testing.assert_array_equal(got, theirs)  # bitwise the same on both processes
        np.testing.assert_allclose(got, w, rtol=2e-5, atol=2e-6)


def test_fit_with_three_replicas_in_each_of_two_processes(tmp_path: Path) -> None:
    # The tree over all six replicas pairs replica 2 (process 0) with replica 3 (process 1) in its fold:
    # not a tree per process, then a tree over processes.
    from tests.support.training import simulate

    code = launch("mpi", 2, tmp_path, "replicas")
    assert code == 0, log_tail(tmp_path)
    # A tree per process, then one over processes, misses these by 0.06 to 0.2.
    for kind, sync_every, atol in (("sgd_momentum", 1, 2e-6), ("adam", 2, 2e-5)):
        weights = [list(np.load(tmp_path / f"replicas_{kind}{r}.npz").values()) for r in range(2)]
        want = simulate(kind, 6, sync_every, 4, 12)
        for got, theirs, w in zip(weights[0], weights[1], want, strict=True):
            for replica in [*got, *theirs]:  # every replica of both processes, bitwise
                np.testing.assert_array_equal(replica, got[0])
            np.testing.assert_allclose(got[0], w, rtol=2e-5, atol=atol)


def test_adasum_strategy_across_two_processes(fit_and_strategy: Path) -> None:
    from tests.support.training import problem, simulate, simulate_replicas

    tmp_path = fit_and_strategy
    weights = [list(np.load(tmp_path / f"strategy{r}.npz").values()) for r in range(2)]
    infos = [json.loads((tmp_path / f"strategy{r}.json").read_text()) for r in range(2)]
    losses: list[float] = []
    # Two processes behave as two replicas of one strategy, both from rank 0's weights.
    want = simulate("adam", 2, 2, 4, 8, losses)
    for got, theirs, w in zip(weights[0], weights[1], want, strict=True):
        np.testing.assert_array_equal(got, theirs)
        np.testing.assert_allclose(got, w, rtol=2e-5, atol=2e-5)
    assert infos[0] == infos[1], infos  # logs averaged over processes: the same on both
    # ... and they are the global values: the epoch's loss is the mean over every step of both
    # processes, and evaluate's the mean over all 32 rows with the final weights.
    assert infos[0]["loss"] == pytest.approx(np.mean(losses), rel=1e-5)
    x, y, _, _ = problem()
    squared = (x[:32].astype(np.float64) @ want[0] + want[1] - y[:32]) ** 2
    assert infos[0]["evaluate"] == pytest.approx(float(np.mean(squared)), rel=1e-5)

    bn = [list(np.load(tmp_path / f"batchnorm{r}.npz").values()) for r in range(2)]
    assert len(bn[0]) == 6  # gamma, beta, moving mean, moving variance, kernel, bias
    for mine, theirs in zip(*bn, strict=True):
        np.testing.assert_array_equal(mine, theirs)
    # The moving statistics: every step, each process's batch moments, averaged over processes.
    mean, variance = np.zeros(3), np.ones(3)
    for step in range(4):
        rows = [x[step * 8 + r * 4 : step * 8 + r * 4 + 4].astype(np.float64) * (1 + r) for r in range(2)]
        mean = 0.99 * mean + 0.01 * np.mean([b.mean(0) for b in rows], axis=0)
        variance = 0.99 * variance + 0.01 * np.mean([b.var(0) for b in rows], axis=0)
    np.testing.assert_allclose(bn[0][2], mean, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(bn[0][3], variance, rtol=1e-5, atol=1e-7)

    # distribute_datasets_from_function: process r is input pipeline r of 2, and with shard() it reads
    # rows r, r + 2, ... of the data, four per step.
    for r in range(2):
        contexts = json.loads((tmp_path / f"contexts{r}.json").read_text())
        assert contexts == [[2, r, 2]], contexts
    shares = [[(x[r:32:2][i : i + 4], y[r:32:2][i : i + 4]) for i in range(0, 16, 4)] for r in range(2)]
    want = simulate_replicas("adam", list(problem()[2:]), shares, 2)
    sharded = [list(np.load(tmp_path / f"from_function{r}.npz").values()) for r in range(2)]
    for got, theirs, w in zip(*sharded, want, strict=True):
        np.testing.assert_array_equal(got, theirs)
        np.testing.assert_allclose(got, w, rtol=2e-5, atol=2e-5)

    # mixed_float16, rank 1's share overflowing: the step is skipped on both, the loss scale halves,
    # then both step and stay identical, with sync_every 1 and 2.
    mixed = [json.loads((tmp_path / f"mixed{r}.json").read_text()) for r in range(2)]
    for sync_every in ("1", "2"):
        for r in range(2):
            result = mixed[r][sync_every]
            assert result["skipped"] == {"scale": 2.0**14, "iterations": 0, "unchanged": True}, (r, result)
            assert result["iterations"] == int(sync_every), (r, result)
        ranks = [list(np.load(tmp_path / f"mixed{sync_every}_{r}.npz").values()) for r in range(2)]
        for mine, theirs in zip(*ranks, strict=True):
            assert np.all(np.isfinite(mine))
            np.testing.assert_array_equal(mine, theirs)


@pytest.mark.parametrize("engine", ["mpi", "tf"])
def test_weights_written_between_fits_across_two_processes(engine: str, tmp_path: Path) -> None:
    # set_weights inside a window and EarlyStopping's restore: the written weights everywhere, then
    # Adasum of the steps that follow, as on two local replicas. Its own launch: at the end of the
    # AdasumStrategy launch above, the TF engine's rank 0 died (SIGSEGV, no Python traceback) in 2 of
    # 27 runs; alone, 10 of 10 passed.
    from tests.support.training import check_fit_write_fit

    code = launch(engine, 2, tmp_path, "writes")
    assert code == 0, log_tail(tmp_path)
    for how, kind, sync_every in PROCESS_WRITES:
        ranks = [list(np.load(tmp_path / f"writes_{how}{r}.npz").values()) for r in range(2)]
        for mine, theirs in zip(*ranks, strict=True):
            np.testing.assert_array_equal(mine, theirs)
        saved = list(np.load(tmp_path / f"writes_{how}_run0.npz").values())
        run = json.loads((tmp_path / f"writes_{how}_run0.json").read_text())
        start, written = saved[:2], saved[2:]
        check_fit_write_fit(ranks[0], how, kind, 2, sync_every, (start, written, run["steps"], run["at"]))


def test_resuming_across_processes_equals_training_without_a_break(fit_and_strategy: Path) -> None:
    for r in range(2):
        results = json.loads((fit_and_strategy / f"resume{r}.json").read_text())
        assert len(results) == 6 and all(results.values()), results


# Each rank's number of replicas (logical CPUs), under both engines: 3 processes x 2 (equal powers of
# two: each process's tree, then VHDD over the processes) and 2 processes of 2 and 3 (the tree split
# inside processes). 2 x 2 and 3 x 3 take the same two paths.
# Then the layouts where a process holds exactly one device (1 + N, N + 1, 1 + 1 + N) under both
# engines: Keras's build before fit reduces a batch only where a process has several replicas, and the
# ranks took different collectives there. And 1 + 1 under the TF engine, MultiWorkerMirroredStrategy's
# own layout, where its ReplicaContext.all_reduce gives the same number as AdasumStrategy's.
LAYOUTS = [(e, c) for c in ("2,3", "2,2,2") for e in ("mpi", "tf")]
LAYOUTS += [(e, c) for c in ("1,3", "3,1", "1,1,2") for e in ("mpi", "tf")] + [("tf", "1,1")]


@pytest.mark.parametrize(("engine", "counts"), LAYOUTS)
def test_adasum_strategy_with_several_devices_in_each_process(
    engine: str, counts: str, tmp_path: Path
) -> None:
    from tests.support.training import problem, simulate

    per_rank = [int(c) for c in counts.split(",")]
    p, total = len(per_rank), sum(per_rank)
    modes = "refused,fit,resume,batchnorm,synced_batchnorm,reductions"
    code = processes.launch(
        engine, p, tmp_path, [*DEVICES_WORKER, str(tmp_path), modes], {REPLICA_COUNTS: counts}
    )
    assert code == 0, log_tail(tmp_path)
    x, y, _, _ = problem()
    rows = LOCAL * total * STEPS
    for r in range(p):  # TensorFlow lists every process's devices under the TF engine: refused, named
        refused = tmp_path / f"devices_refused{r}.txt"
        assert refused.exists() == (engine == "tf")
        if engine == "tf":
            message = refused.read_text()
            assert f"on rank {r} got other processes' devices ['/job:worker/replica:0/task:" in message
    for kind, sync_every, local_reduction in DEVICE_CASES:
        name = f"devices_{kind}_{local_reduction}"
        infos = [json.loads((tmp_path / f"{name}{r}.json").read_text()) for r in range(p)]
        weights = [list(np.load(tmp_path / f"{name}{r}.npz").values()) for r in range(p)]
        losses: list[float] = []
        # Global replica i (rank order) takes the i-th LOCAL rows of each global batch, as one
        # AdasumStrategy over all of them in one process would: the tree over every replica, or with
        # local_reduction="mean" the tree over each process's mean.
        groups = per_rank if local_reduction == "mean" else None
        want = simulate(kind, total, sync_every, STEPS, LOCAL * total, losses, mean_groups=groups)
        for r in range(p):
            assert infos[r]["replicas"] == total and infos[r]["counts"] == per_rank, infos[r]
            assert infos[r] == infos[0], infos  # the logs are global: the same everywhere
            for got, first, w in zip(weights[r], weights[0], want, strict=True):
                assert len(got) == per_rank[r]
                for replica in got:  # every replica of every process, bitwise
                    np.testing.assert_array_equal(replica, first[0])
                np.testing.assert_allclose(got[0], w, rtol=2e-5, atol=2e-5)
        # The epoch's loss: the mean over every step of every replica; evaluate's, over all rows.
        assert infos[0]["loss"] == pytest.approx(np.mean(losses), rel=1e-5)
        if (kind, sync_every, local_reduction) in RESUMED:  # every weight and optimizer variable
            for r in range(p):
                resumed = list(np.load(tmp_path / f"resumed_{kind}_{local_reduction}{r}.npz").values())
                went_on = list(np.load(tmp_path / f"{name}_state{r}.npz").values())
                assert len(resumed) > len(weights[r]), (r, len(resumed))
                for mine, theirs in zip(resumed, went_on, strict=True):  # every replica's, bitwise
                    np.testing.assert_array_equal(mine, theirs)
        squared = (x[:rows].astype(np.float64) @ want[0] + want[1] - y[:rows]) ** 2
        assert infos[0]["evaluate"] == pytest.approx(float(np.mean(squared)), rel=1e-5)

    bn = [list(np.load(tmp_path / f"devices_batchnorm{r}.npz").values()) for r in range(p)]
    for r in range(1, p):
        for mine, first in zip(bn[r], bn[0], strict=True):
            np.testing.assert_array_equal(mine, first)
    mean, variance = np.zeros(3), np.ones(3)
    owner = [r for r, n in enumerate(per_rank) for _ in range(n)]  # global replica -> its rank
    for step in range(STEPS):
        batches = [
            x[step * LOCAL * total + i * LOCAL : step * LOCAL * total + (i + 1) * LOCAL].astype(np.float64)
            * (1 + owner[i])
            for i in range(total)
        ]
        mean = 0.99 * mean + 0.01 * np.mean([b.mean(0) for b in batches], axis=0)
        variance = 0.99 * variance + 0.01 * np.mean([b.var(0) for b in batches], axis=0)
    np.testing.assert_allclose(bn[0][2], mean, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(bn[0][3], variance, rtol=1e-5, atol=1e-7)

    # BatchNormalization(synchronized=True): every step, the moments of the whole global batch.
    synced = [list(np.load(tmp_path / f"devices_synced{r}.npz").values()) for r in range(p)]
    for r in range(1, p):
        for mine, first in zip(synced[r], synced[0], strict=True):
            np.testing.assert_array_equal(mine, first)
    mean, variance = np.zeros(3), np.ones(3)
    for step in range(STEPS):
        rows_of_step = np.concatenate(
            [
                x[step * LOCAL * total + i * LOCAL : step * LOCAL * total + (i + 1) * LOCAL].astype(
                    np.float64
                )
                * (1 + owner[i])
                for i in range(total)
            ]
        )
        mean = 0.99 * mean + 0.01 * rows_of_step.mean(0)
        variance = 0.99 * variance + 0.01 * rows_of_step.var(0)
    np.testing.assert_allclose(synced[0][2], mean, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(synced[0][3], variance, rtol=1e-5, atol=1e-7)

    # ReplicaContext.all_reduce and strategy.reduce("sum"/"Mean"): over every replica of every
    # process (global replica g holds g + 1), eagerly and compiled; MWMS's own sum where it can run.
    for r in range(p):
        got = json.loads((tmp_path / f"devices_reductions{r}.json").read_text())
        want = [total * (total + 1) / 2, (total + 1) / 2, float(total + 1)]
        assert got["eager"] == want and got["compiled"] == want, (r, got, want)
        assert got["reduce"] == want[:2], (r, got)
        if engine == "tf":  # MultiWorkerMirroredStrategy's sum, in its own layout, checks the oracle
            theirs = sum(sum(per_rank[:q]) + 1 for q in range(p))
            assert got["mwms_sum"] == theirs, (r, got)
            if set(per_rank) == {1}:  # the same layout: the same number
                assert got["eager"][0] == theirs, (r, got)
