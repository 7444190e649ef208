"""The worker of tests/test_multiprocess.py, under `mpirun` or `python -m tf_adasum.run`:
`python -m tests.workers.multiprocess OUT MODE[,MODE...]` (tests/workers/dispatch.py).

Modes:
    collectives      eager and compiled Adasum all-reduces of rank_tensors (every dtype), again eagerly,
                     nothing at all, Sum / Average / a scalar, a broadcast, and allreduce_replicas with
                     two, three and uneven replicas per process: OUT/rank{r}.npz and collectives{r}.json
    pipeline         Adasum of PIPELINE_SHAPES by VHDD as a pipeline of chunks, and of one tensor
                     (pipeline_one) with its gather in parts, eagerly and compiled, and compiled as one
                     VHDD per buffer, with the ordering tokens each graph takes: OUT/pipeline{r}.npz
    refusals         what every rank must raise together: a shape mismatch, a mismatch that has the
                     ranks trace different algorithms, NaN on one rank, replicas that disagree, fp16
                     compression overflowing, NaN in one replica, one rank at its epoch end and one at a
                     mixed-precision check while the others sync: OUT/refusals{r}.json
    dead             rank 1 exits after init; the others try an all-reduce: OUT/rank{r}.json
    absent           rank 1 stays alive but never calls the all-reduce: OUT/rank{r}.json
    fit              model.fit with AdasumOptimizer, no strategy, one replica per process
    replicas         model.fit under MirroredStrategy on 3 logical CPUs per process, AdasumOptimizer
                     across processes (mpirun only: the TF engine fixes the devices at its start)
    strategy         model.fit and evaluate under AdasumStrategy, every process given the same data
    batchnorm        BatchNormalization's moving statistics under AdasumStrategy
    from_function    AdasumStrategy.distribute_datasets_from_function: each process one input pipeline
    mixed_precision  mixed_float16 under AdasumStrategy, rank 1's share of the first batch overflowing
    resume           AdasumStrategy: k steps, save, restore, k more, against 2k at once
    writes           weights written between two fits (set_weights, EarlyStopping's restore)
    outer            AdasumStrategy(sync_every, outer_optimizer, combine, compression) for OUTER_CASES, one
                     replica per process: OUT/outer_{case}{r}.npz (the weights, then the outer
                     optimizer's variables); then Horovod's recipe with DistributedOptimizer(op=Adasum,
                     outer_optimizer=...): OUT/outer_horovod{r}.npz; AdasumCallback(outer_optimizer=...)
                     for CALLBACK_OUTER_CASES: OUT/outer_callback_{combine}_{compression}{r}.npz, and a
                     resume of the last where rank 0 alone loads: OUT/outer_callback_resumed{r}.npz;
                     then the mean of an odd count
                     of replicas past 256 (129 on rank 0, 128 on the others), per compression:
                     OUT/outer_mean_counts{r}.json
    threads          many short compiled all-reduces, then many short fits under AdasumStrategy: the
                     threads the process holds after each, OUT/threads{r}.json

Each rank's data comes from tests/workers/data.py, which the test also uses to build the oracle.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np
import tensorflow as tf

import tf_adasum
from tests.workers.data import (
    PIPELINE_BYTES,
    PROCESS_WRITES,
    lane_tensors,
    pipeline_one,
    pipeline_tensors,
    rank_tensors,
    replica_tensors,
    saved,
)
from tests.workers.dispatch import main
from tf_adasum.algorithm import agreement, vhdd

# A rank that dies of a signal (a SIGSEGV seen in about 1 of 30 runs of the weight-write checks) prints
# every thread's Python stack into the launch's log.
faulthandler.enable()


def collectives(out: Path) -> None:
    comm = tf_adasum.init()
    rank = comm.rank
    tensors = [tf.constant(x) for x in rank_tensors(rank)]
    results: dict[str, np.ndarray] = {}
    for i, t in enumerate(tf_adasum.allreduce(tensors)):
        results[f"adasum_eager_{i}"] = saved(t)
        results[f"dtype_{i}"] = np.array(t.dtype.name)
    # Again, eagerly: under the TF engine the same compiled function, its collectives' keys reused.
    for i, t in enumerate(tf_adasum.allreduce(tensors)):
        results[f"adasum_again_{i}"] = saved(t)
    in_graph = tf.function(lambda ts: tf_adasum.allreduce(ts))
    for i, t in enumerate(in_graph(tensors)):
        results[f"adasum_function_{i}"] = saved(t)
    # Nothing to combine, eagerly and compiled: every rank still meets the others' agreement.
    results["empty"] = np.array([len(tf_adasum.allreduce([])), len(in_graph([]))])
    results["sum"] = tf_adasum.allreduce(tf.constant([rank, 1], tf.int32), op=tf_adasum.Sum).numpy()
    results["average"] = tf_adasum.allreduce(tf.constant([float(rank)]), op=tf_adasum.Average).numpy()
    results["scalar_sum"] = tf_adasum.allreduce(tf.constant(2.5), op=tf_adasum.Sum).numpy()
    results["broadcast"] = tf_adasum.broadcast(tf.constant([10.0 * rank, 1.0]), root=comm.size - 1).numpy()
    # Several replicas per process: the tree over every replica of every process.
    for case in ("two", "three", "uneven"):
        local = [[tf.constant(x) for x in r] for r in replica_tensors(case, comm.size, rank)]
        for i, t in enumerate(tf_adasum.distributed.allreduce_replicas(local)):
            results[f"{case}_eager_{i}"] = saved(t)
        compiled = tf.function(lambda ts: tf_adasum.distributed.allreduce_replicas(ts))
        for i, t in enumerate(compiled(local)):
            results[f"{case}_function_{i}"] = saved(t)
    np.savez(out / f"rank{rank}.npz", **results)
    info = {
        "engine": comm.engine,
        # The eager Adasum calls' compiled functions (TF engine): one per signature, none under MPI.
        "compiled_syncs": len(tf_adasum.distributed._compiled_syncs),
        "size": comm.size,
        "local_rank": comm.local_rank,
    }
    (out / f"collectives{rank}.json").write_text(json.dumps(info))


def lanes(out: Path) -> None:
    comm = tf_adasum.init()
    tensors = [tf.constant(x) for x in lane_tensors(comm.rank)]
    results = {f"eager_{i}": saved(t) for i, t in enumerate(tf_adasum.allreduce(tensors))}
    in_graph = tf.function(lambda ts: tf_adasum.allreduce(ts))
    results |= {f"function_{i}": saved(t) for i, t in enumerate(in_graph(tensors))}
    # One exchange, eagerly, of unequal sizes: 3 MiB sent, the peer's first 2 MiB + 1 received.
    peer = comm.rank ^ 1
    if peer < comm.size:
        mine = tf.constant(lane_tensors(comm.rank)[0])
        size = 524289 if comm.rank < peer else 786433
        got = comm.exchange(peer, mine[: 786433 if comm.rank < peer else 524289], size, "lane check")
        results["exchanged"] = got.numpy()
    # One buffer alone: compiled, its agreement goes in its own all-gather where the algorithm is the
    # gather (agree_and_gather, in lanes at this size).
    single = tf.function(lambda t: tf_adasum.allreduce([t]))
    results["single"] = saved(single(tensors[0])[0])
    operations = single.get_concrete_function(tensors[0]).graph.get_operations()
    results["single_gathers"] = np.array(sum(op.type == "CollectiveGatherV2" for op in operations))
    # Rank 0 at its epoch end while the others run that traced sync again: every rank raises
    # UnevenDataError (raised by the traced sync's check as InvalidArgumentError, in a tf.function of
    # the script's own), and no collective of the sync is left pending (the next sync gives the same bits).
    try:
        if comm.rank == 0:
            agreement.agree_at_epoch_end(comm, 7)
        else:
            single(tensors[0])
        results["uneven"] = np.array("no error")
    except (tf_adasum.UnevenDataError, tf.errors.InvalidArgumentError) as error:
        results["uneven"] = np.array(str(error))
    results["after"] = saved(single(tensors[0])[0])
    np.savez(out / f"lanes{comm.rank}.npz", **results)


def pipeline(out: Path) -> None:
    comm = tf_adasum.init()
    vhdd.PIPELINE_BYTES = PIPELINE_BYTES  # so that these few MB go as a pipeline
    tensors = [tf.constant(x) for x in pipeline_tensors(comm.rank)]
    one = tf.constant(pipeline_one(comm.rank))
    results = {f"eager_{i}": saved(t) for i, t in enumerate(tf_adasum.allreduce(tensors))}
    results["one_eager"] = saved(tf_adasum.allreduce(one))
    pipelined = tf.function(lambda ts: tf_adasum.allreduce(ts))
    results |= {f"function_{i}": saved(t) for i, t in enumerate(pipelined(tensors))}
    one_in_parts = tf.function(lambda t: tf_adasum.allreduce(t))
    results["one_function"] = saved(one_in_parts(one))
    chunks = vhdd.PIPELINE_CHUNKS
    vhdd.PIPELINE_CHUNKS = 1  # the same syncs, traced again, as one VHDD per buffer, its gather whole
    whole = tf.function(lambda ts: tf_adasum.allreduce(ts))
    results |= {f"whole_{i}": saved(t) for i, t in enumerate(whole(tensors))}
    one_whole = tf.function(lambda t: tf_adasum.allreduce(t))
    results["one_whole"] = saved(one_whole(one))

    def tokens(function: Any, *args: Any) -> tuple[int, list[int], list[int]]:
        """The ordering tokens the traced sync's collectives take: how many, which pipeline steps',
        and how many collectives take each step's."""
        graph = function.get_concrete_function(*args).graph
        inside = {id(outer): inner.name for outer, inner in graph.captures}
        kinds = ("CollectiveGatherV2", "CollectiveReduceV2")
        taken = [op.inputs[4].name for op in graph.get_operations() if op.type in kinds]
        per_step = [
            sum(name in {inside.get(id(token.handle)) for token in lanes} for name in taken)
            for lanes in comm._stage_tokens
        ]
        return len(set(taken)), [s for s, n in enumerate(per_step) if n], per_step

    count, steps, _ = tokens(pipelined, tensors)
    results["tokens_pipelined"], results["steps_pipelined"] = np.array(count), np.array(steps)
    results["tokens_whole"] = np.array(tokens(whole, tensors)[0])
    count, steps, per_step = tokens(one_in_parts, one)
    results["one_tokens"], results["one_steps"] = np.array(count), np.array(steps)
    results["one_per_step"] = np.array(per_step)
    results["one_whole_tokens"] = np.array(tokens(one_whole, one)[0])
    results["stages"] = np.array(comm.pipeline_stages)

    # Lanes inside the pipeline's steps: with lanes from 32 KiB, each chunk's exchanges and gather levels
    # go as several collectives, each in its step's lane.
    vhdd.PIPELINE_CHUNKS = chunks
    comm.LANE_BYTES = 16 << 10
    in_lanes = tf.function(lambda ts: tf_adasum.allreduce(ts))
    results |= {f"lanes_{i}": saved(t) for i, t in enumerate(in_lanes(tensors))}
    count, steps, _ = tokens(in_lanes, tensors)
    results["tokens_lanes"], results["steps_lanes"] = np.array(count), np.array(steps)
    np.savez(out / f"pipeline{comm.rank}.npz", **results)


def refusals(out: Path) -> None:
    comm = tf_adasum.init()
    rank = comm.rank
    compiled_before = len(tf_adasum.distributed._compiled_syncs)
    # A rank whose tensor differs: every rank must raise, before any data moves.
    mismatched = [tf.ones([4, 6] if rank == 1 else [4, 5]), tf.ones([2])]
    try:
        tf_adasum.allreduce(mismatched)
        message = "no error"
    except ValueError as error:
        message = str(error)
    # A mismatch that has the ranks trace different algorithms (under the TF engine rank 1's tensor is
    # past the all-gather's size, so VHDD, three collectives; the others', one all-gather): every rank
    # raises, and the collectives after it still meet.
    big = [tf.ones([(1 << 20) + 16 if rank == 1 else 16])]
    try:
        tf_adasum.allreduce(big)
        drift = "no error"
    except ValueError as error:
        drift = str(error)
    # A rank with NaN in a bfloat16 tensor (a float32 one first): every rank raises the same error.
    nan = [tf.ones([3]), tf.constant([1.0, np.nan if rank == comm.size - 1 else 2.0], tf.bfloat16)]
    try:
        tf_adasum.allreduce(nan)
        nonfinite = "no error"
    except tf_adasum.NonFiniteUpdateError as error:
        nonfinite = str(error)
    # Rank 0's own replicas disagree: every process raises rank 0's error, none waits.
    local = [[tf.constant(x) for x in r] for r in replica_tensors("uneven", comm.size, rank)]
    if rank == 0:
        local.append([tf.zeros([1]) for _ in local[0]])
    try:
        tf_adasum.distributed.allreduce_replicas(local)
        replica_mismatch = "no error"
    except ValueError as error:
        replica_mismatch = str(error)
    # compression="fp16" with subtree results beyond float16's range: every process raises.
    local = [[tf.fill([3], 1e5)] for _ in replica_tensors("uneven", comm.size, rank)]
    try:
        tf_adasum.distributed.allreduce_replicas(local, compression="fp16")
        narrowed = "no error"
    except tf_adasum.NonFiniteUpdateError as error:
        narrowed = str(error)
    # NaN in the last replica of the last process: every process raises, none waits in the tree.
    local = [[tf.constant(x) for x in r] for r in replica_tensors("uneven", comm.size, rank)]
    if rank == comm.size - 1:
        local[-1][5] = tf.constant(np.full([320], np.nan), tf.bfloat16)
    try:
        tf_adasum.distributed.allreduce_replicas(local)
        replica_nonfinite = "no error"
    except tf_adasum.NonFiniteUpdateError as error:
        replica_nonfinite = str(error)
    compiled_syncs = len(tf_adasum.distributed._compiled_syncs) - compiled_before
    # Rank 0 at its epoch end while the others call eager Adasum: every rank raises UnevenDataError.
    try:
        if rank == 0:
            agreement.agree_at_epoch_end(comm, 7)
        else:
            tf_adasum.allreduce([tf.ones([5])])
        uneven = "no error"
    except tf_adasum.UnevenDataError as error:
        uneven = str(error)
    # Rank 0 at a mixed-precision check while the others call eager Adasum: every rank raises,
    # naming both kinds of check.
    try:
        if rank == 0:
            agreement.agree(comm, agreement.LOSS_SCALE, 0, "mixed-precision check")
        else:
            tf_adasum.allreduce([tf.ones([5])])
        different = "no error"
    except RuntimeError as error:
        different = str(error)
    info = {
        "drift": drift,
        "different": different,
        "uneven": uneven,
        "replica_nonfinite": replica_nonfinite,
        "replica_mismatch": replica_mismatch,
        "narrowed": narrowed,
        # The compiled functions these eager Adasum calls added (TF engine): one per new signature.
        "compiled_syncs": compiled_syncs,
        "mismatch": message,
        "nonfinite": nonfinite,
    }
    (out / f"refusals{rank}.json").write_text(json.dumps(info))


def missing_peer(out: Path, exits: bool) -> None:
    rank = int(
        os.environ.get(
            "OMPI_COMM_WORLD_RANK",
            json.loads(os.environ.get("TF_CONFIG", "{}")).get("task", {}).get("index", 0),
        )
    )
    start = time.monotonic()
    try:
        tf_adasum.init()
        if rank == 1:
            # Let rank 0 finish its half of the start-up exchange first, then leave or go silent.
            time.sleep(3.0)
            if exits:
                os._exit(0)  # leaves without a word, as a crashed worker would
            time.sleep(600)  # alive, but never arrives: the others must not wait for it forever
        time.sleep(5.0)
        start = time.monotonic()
        tf_adasum.allreduce([tf.ones([1000])])
        message = "no error"
    except tf_adasum.PeerError as error:  # wherever it shows, start-up included, it must name rank 1
        message = str(error)
    info = {"message": message, "seconds": time.monotonic() - start}
    (out / f"rank{rank}.json").write_text(json.dumps(info))
    sys.stdout.flush()
    os._exit(3)  # the job failed; do not wait in MPI_Finalize for the rank that left


def dead(out: Path) -> None:
    missing_peer(out, exits=True)


def absent(out: Path) -> None:
    missing_peer(out, exits=False)


def fit(out: Path) -> None:
    import keras

    from tests.support.training import build_linear, make_inner, problem

    comm = tf_adasum.init()
    x, y, _, _ = problem()
    local, steps = 4, 4
    # Replica r's shard of each global batch, as the simulation in test_training cuts it.
    rows = np.concatenate(
        [np.arange(s * local * comm.size, (s + 1) * local * comm.size) for s in range(steps)]
    )
    mine = rows.reshape(steps, comm.size, local)[:, comm.rank].reshape(-1)
    model = build_linear(
        tf.distribute.get_strategy(), lambda: tf_adasum.AdasumOptimizer(make_inner("sgd_momentum"))
    )
    # Every rank but 0 starts elsewhere: the optimizer must broadcast rank 0's weights before the first
    # step's gradient (Keras builds it only while it traces that step).
    model.set_weights([w + comm.rank for w in model.get_weights()])
    model.fit(x[mine], y[mine], batch_size=local, shuffle=False, verbose=0)
    assert isinstance(model.optimizer.inner, keras.optimizers.SGD)
    np.savez(out / f"fit{comm.rank}.npz", *model.get_weights())


def replicas(out: Path) -> None:
    """MirroredStrategy over three logical CPUs in each process, AdasumOptimizer across processes."""
    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 3
    )
    from tests.support.training import build_linear, make_inner, problem

    comm = tf_adasum.init()
    x, y, _, _ = problem()
    strategy = tf.distribute.MirroredStrategy(
        [d.name for d in tf.config.list_logical_devices("CPU")],
        cross_device_ops=tf.distribute.ReductionToOneDevice(),
    )
    local, steps, total = 2, 4, 3 * comm.size
    # Global replica 3q + j takes rows [2 * (3q + j), ...) of each global batch, as simulate() cuts it.
    batch = 3 * local
    mine = np.concatenate([s * local * total + comm.rank * batch + np.arange(batch) for s in range(steps)])
    for kind, sync_every in (("sgd_momentum", 1), ("adam", 2)):
        model = build_linear(
            strategy,
            lambda: tf_adasum.AdasumOptimizer(make_inner(kind), sync_every=sync_every),  # noqa: B023
        )
        model.fit(x[mine], y[mine], batch_size=batch, shuffle=False, verbose=0)
        components = [
            [c.numpy() for c in strategy.experimental_local_results(v.value)] for v in model.weights
        ]
        assert all(len(c) == 3 for c in components)
        np.savez(out / f"replicas_{kind}{comm.rank}.npz", *[np.stack(c) for c in components])


def strategy(out: Path) -> None:
    from tests.support.training import build_linear, make_inner, problem

    comm = tf_adasum.init()
    x, y, _, _ = problem()
    adasum = tf_adasum.AdasumStrategy(sync_every=2)
    model = build_linear(adasum, lambda: make_inner("adam"))
    # Every rank starts elsewhere: the strategy must start all from rank 0's weights.
    model.set_weights([w + comm.rank for w in model.get_weights()])
    # The same global batches everywhere: the strategy hands each process its share.
    history = model.fit(x[:32], y[:32], batch_size=8, epochs=1, shuffle=False, verbose=0)
    evaluated = model.evaluate(x[:32], y[:32], batch_size=8, verbose=0)
    np.savez(out / f"strategy{comm.rank}.npz", *model.get_weights())
    info = {"loss": float(history.history["loss"][-1]), "evaluate": float(evaluated)}
    (out / f"strategy{comm.rank}.json").write_text(json.dumps(info))


# (outer optimizer, sync_every, combine, compression): tests/test_outer_optimizer.py's cases across
# processes.
OUTER_CASES = [
    ("nesterov", 4, "adasum", "none"),
    ("adam", 1, "adasum", "none"),
    ("nesterov", 4, "mean", "none"),
    ("nesterov", 4, "adasum", "bf16"),
    ("nesterov", 4, "adasum", "fp16"),
    ("nesterov", 4, "mean", "bf16"),
]


# AdasumCallback(outer_optimizer=...)'s cases in the `outer` mode: (combine, compression).
CALLBACK_OUTER_CASES = [("adasum", "none"), ("mean", "none"), ("adasum", "bf16")]


def outer(out: Path) -> None:
    from tests.support.training import OUTERS, Outer, build_linear, make_inner, problem

    comm = tf_adasum.init()
    x, y, _, _ = problem()
    for kind, sync_every, combine, compression in OUTER_CASES:
        adasum = tf_adasum.AdasumStrategy(
            sync_every=sync_every,
            outer_optimizer=Outer(*OUTERS[kind]).keras(),
            combine=combine,
            compression=compression,
        )
        model = build_linear(adasum, lambda: make_inner("sgd_momentum"))
        model.set_weights([w + comm.rank for w in model.get_weights()])  # all start from rank 0's
        rows = 2 * comm.size * 8  # 8 global batches, 2 rows per process
        model.fit(x[:rows], y[:rows], batch_size=2 * comm.size, shuffle=False, verbose=0)
        state = [v.numpy() for v in model.optimizer.outer_optimizer.variables]
        name = f"outer_{kind}_{sync_every}_{combine}_{compression}"
        np.savez(out / f"{name}{comm.rank}.npz", *model.get_weights(), *state)
    # Horovod's recipe with the one extension: no strategy, each process reads its own rows.
    import keras

    import tf_adasum.keras as hvd

    kind, sync_every = "nesterov", 4
    optimizer = hvd.DistributedOptimizer(
        make_inner("sgd_momentum"),
        op=hvd.Adasum,
        backward_passes_per_step=sync_every,
        outer_optimizer=Outer(*OUTERS[kind]).keras(),
    )
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.set_weights([w + comm.rank for w in problem()[2:]])  # the first step takes rank 0's
    model.compile(optimizer=optimizer, loss="mse")
    mine = np.concatenate(
        [
            np.arange(s * 2 * comm.size + 2 * comm.rank, s * 2 * comm.size + 2 * comm.rank + 2)
            for s in range(8)
        ]
    )
    model.fit(x[mine], y[mine], batch_size=2, shuffle=False, verbose=0)
    state = [v.numpy() for v in model.optimizer.outer_optimizer.variables]
    np.savez(out / f"outer_horovod{comm.rank}.npz", *model.get_weights(), *state)
    # A plain fit with AdasumCallback(sync_every=4, outer_optimizer=Nesterov), each process its own rows,
    # as above; then a resume where rank 0 alone loads the weights and outer state (Horovod's): the
    # others take root's outer state at the first batch.
    for combine, compression in CALLBACK_OUTER_CASES:
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        model.set_weights([w + comm.rank for w in problem()[2:]])  # the first batch takes rank 0's
        model.compile(optimizer=make_inner("sgd_momentum"), loss="mse")
        callback = tf_adasum.AdasumCallback(
            4, outer_optimizer=Outer(*OUTERS["nesterov"]).keras(), combine=combine, compression=compression
        )
        model.fit(x[mine], y[mine], batch_size=2, shuffle=False, verbose=0, callbacks=[callback])
        state = [v.numpy() for v in callback.outer_optimizer.variables]
        np.savez(out / f"outer_callback_{combine}_{compression}{comm.rank}.npz", *model.get_weights(), *state)
    if comm.rank == 0:
        model.save_weights(out / "outer_callback.weights.h5")
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer=make_inner("sgd_momentum"), loss="mse")
    callback = tf_adasum.AdasumCallback(4, outer_optimizer=Outer(*OUTERS["nesterov"]).keras())
    if comm.rank == 0:
        callback.set_model(model)
        model.load_weights(out / "outer_callback.weights.h5")
    model.fit(x[mine], y[mine], batch_size=2, shuffle=False, verbose=0, callbacks=[callback])
    state = [v.numpy() for v in callback.outer_optimizer.variables]
    np.savez(out / f"outer_callback_resumed{comm.rank}.npz", *model.get_weights(), *state)
    # combine="mean" over an odd count of replicas past 256, which bfloat16 cannot hold: rank 0 holds 129
    # replicas, every other rank 128, and each rank's deltas sum to 1 (one replica's delta is 1, the
    # others' 0), so the mean is size / (129 + 128 * (size - 1)), whatever the wire narrows.
    from tf_adasum.training.model_sync import mean_over_every_replica

    count = 129 if comm.rank == 0 else 128
    per_replica = [[tf.fill([4], 1.0 if j == 0 else 0.0)] for j in range(count)]
    means = {
        c: mean_over_every_replica(per_replica, ["w"], c)[0].numpy().tolist()
        for c in ("none", "bf16", "fp16")
    }
    (out / f"outer_mean_counts{comm.rank}.json").write_text(json.dumps(means))


def batchnorm(out: Path) -> None:
    """BatchNorm: its moving statistics are averaged over processes, so every weight agrees."""
    import keras

    from tests.support.training import problem

    comm = tf_adasum.init()
    x, y, _, _ = problem()
    adasum = tf_adasum.AdasumStrategy(sync_every=2)
    with adasum.scope():
        bn = keras.Sequential([keras.Input((3,)), keras.layers.BatchNormalization(), keras.layers.Dense(2)])
        bn.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    bn.fit(x[:32] * (1 + comm.rank), y[:32], batch_size=8, shuffle=False, verbose=0)
    np.savez(out / f"batchnorm{comm.rank}.npz", *bn.get_weights())


def from_function(out: Path) -> None:
    """distribute_datasets_from_function: each process is one input pipeline, and shards by it."""
    from tests.support.training import build_linear, make_inner, problem

    comm = tf_adasum.init()
    x, y, _, _ = problem()
    adasum = tf_adasum.AdasumStrategy(sync_every=2)
    contexts = []

    def dataset_fn(context: tf.distribute.InputContext) -> tf.data.Dataset:
        contexts.append(
            [context.num_input_pipelines, context.input_pipeline_id, context.num_replicas_in_sync]
        )
        rows = tf.data.Dataset.from_tensor_slices((x[:32], y[:32]))
        return rows.shard(context.num_input_pipelines, context.input_pipeline_id).batch(
            context.get_per_replica_batch_size(8)
        )

    sharded = build_linear(adasum, lambda: make_inner("adam"))
    sharded.fit(adasum.distribute_datasets_from_function(dataset_fn), epochs=1, verbose=0)
    np.savez(out / f"from_function{comm.rank}.npz", *sharded.get_weights())
    (out / f"contexts{comm.rank}.json").write_text(json.dumps(contexts))


def writes(out: Path) -> None:
    """Weights written between two fits, on two processes: the new weights, then Adasum of what follows."""
    from tests.support.training import fit_write_fit

    rank = tf_adasum.init().rank
    for how, kind, sync_every in PROCESS_WRITES:
        model, start, written, steps, at = fit_write_fit(
            tf_adasum.AdasumStrategy(sync_every=sync_every), how, kind, 2
        )
        np.savez(out / f"writes_{how}{rank}.npz", *model.get_weights())
        np.savez(out / f"writes_{how}_run{rank}.npz", *start, *written)
        (out / f"writes_{how}_run{rank}.json").write_text(json.dumps({"steps": steps, "at": at}))


def mixed_precision(out: Path) -> None:
    """mixed_float16 with rank 1's share of the first batch overflowing: skipped on both processes."""
    import keras

    from tests.support.training import build_linear, make_inner, problem

    rank = tf_adasum.init().rank
    x, y, _, _ = problem()
    results = {}
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        for sync_every in (1, 2):
            adasum = tf_adasum.AdasumStrategy(sync_every=sync_every)
            model = build_linear(adasum, lambda: make_inner("sgd_momentum"))
            start = model.get_weights()
            xs, ys = x[: 8 * (1 + sync_every)].copy(), y[: 8 * (1 + sync_every)].copy()
            xs[4:8] *= 3e3  # rank 1's half of the first global batch overflows float16
            model.fit(xs[:8], ys[:8], batch_size=8, shuffle=False, verbose=0)
            skipped = {
                "scale": float(model.optimizer.dynamic_scale.numpy()),
                "iterations": int(model.optimizer.iterations.numpy()),
                "unchanged": all(
                    np.array_equal(a, b) for a, b in zip(model.get_weights(), start, strict=True)
                ),
            }
            model.fit(xs[8:], ys[8:], batch_size=8, shuffle=False, verbose=0)
            results[sync_every] = {"skipped": skipped, "iterations": int(model.optimizer.iterations.numpy())}
            np.savez(out / f"mixed{sync_every}_{rank}.npz", *model.get_weights())
    finally:
        keras.mixed_precision.set_global_policy("float32")
    (out / f"mixed{rank}.json").write_text(json.dumps(results))


def resume(out: Path) -> None:
    """k steps, a checkpoint of this process's own state, a fresh model, k more: as 2k steps at once."""
    import keras
    import tensorflow as tf

    from tests.support.training import StopAfter, build_linear, make_inner, problem

    comm = tf_adasum.init()
    x, y, _, _ = problem()
    strategy = tf_adasum.AdasumStrategy()
    results = {}
    for kind in ("sgd_momentum", "adam"):
        whole = build_linear(strategy, lambda kind=kind: make_inner(kind))
        whole.fit(x[:32], y[:32], batch_size=8, shuffle=False, verbose=0)
        for how in ("checkpoint", "save_weights", "backup_and_restore"):
            before = build_linear(strategy, lambda kind=kind: make_inner(kind))
            after = build_linear(strategy, lambda kind=kind: make_inner(kind))
            path = out / f"{kind}_{how}_rank{comm.rank}"  # every process saves its own state
            if how == "backup_and_restore":
                backup = keras.callbacks.BackupAndRestore(str(path), save_freq=2)
                try:
                    before.fit(
                        x[:32],
                        y[:32],
                        batch_size=8,
                        shuffle=False,
                        verbose=0,
                        callbacks=[backup, StopAfter(3)],
                    )
                except RuntimeError:
                    pass
                after.fit(x[16:32], y[16:32], batch_size=8, shuffle=False, verbose=0, callbacks=[backup])
            else:
                before.fit(x[:16], y[:16], batch_size=8, shuffle=False, verbose=0)
                with strategy.scope():
                    after.optimizer.build(after.trainable_variables)
                if how == "checkpoint":
                    saved = tf.train.Checkpoint(model=before, optimizer=before.optimizer).save(path)
                    tf.train.Checkpoint(model=after, optimizer=after.optimizer).restore(saved)
                else:
                    before.save_weights(f"{path}.weights.h5")
                    after.load_weights(f"{path}.weights.h5")
                after.fit(x[16:32], y[16:32], batch_size=8, shuffle=False, verbose=0)
            results[f"{kind}_{how}"] = all(
                np.array_equal(a, b) for a, b in zip(after.get_weights(), whole.get_weights(), strict=True)
            )
    (out / f"resume{comm.rank}.json").write_text(json.dumps(results))


def threads(out: Path) -> None:
    """What a long run leaves behind, fast: TensorFlow parked a thread for the whole timeout on every
    collective given one, and tf_adasum's iterator release fell behind a loop of short fits."""
    import keras

    comm = tf_adasum.init()
    x = tf.ones([16])
    step = tf.function(lambda x: tf_adasum.allreduce([x, 2 * x], op=tf_adasum.Adasum))
    for _ in range(300):
        step(x)
    after_collectives = len(os.listdir("/proc/self/task"))
    adasum = tf_adasum.AdasumStrategy()
    with adasum.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
    data = np.ones((96, 3), np.float32), np.ones((96, 2), np.float32)
    for _ in range(60):  # each fit leaves an iterator part read, as a resumed epoch's is
        model.fit(*data, batch_size=12, epochs=1, steps_per_epoch=3, verbose=0)
    info = {"after_collectives": after_collectives, "after_fits": len(os.listdir("/proc/self/task"))}
    (out / f"threads{comm.rank}.json").write_text(json.dumps(info))


MODES = {
    "lanes": lanes,
    "pipeline": pipeline,
    "collectives": collectives,
    "refusals": refusals,
    "dead": dead,
    "absent": absent,
    "fit": fit,
    "replicas": replicas,
    "strategy": strategy,
    "batchnorm": batchnorm,
    "from_function": from_function,
    "mixed_precision": mixed_precision,
    "resume": resume,
    "writes": writes,
    "threads": threads,
    "outer": outer,
}

if __name__ == "__main__":
    main(MODES)
