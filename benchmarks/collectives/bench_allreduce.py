"""Adasum all-reduce against the same engine's plain sum all-reduce of the same data.

Usage:
    mpirun -np P python benchmarks/collectives/bench_allreduce.py [--repeats 10]          # MPI engine
    python -m tf_adasum.run -np P benchmarks/collectives/bench_allreduce.py [--repeats 10]  # TF engine
    python -m tf_adasum.run -np 2 benchmarks/collectives/bench_allreduce.py --devices-per-process 2

Every timed call waits for its results as np.asarray does, without the copy that .numpy() makes
(0.8 ms for 16 MB here), which MPI.Allreduce into a numpy buffer does not pay either.

Rank 0 prints one JSON line per case: 1, 4, 16 and 64 MB of float32 in one tensor, and a
ResNet-50-like list of 161 tensors (25.6M float32). Figures, all measured in this run:
    adasum_ms    tf_adasum.allreduce(op=Adasum), called eagerly, median over repeats
    compiled_ms  the same call inside a tf.function, as in a compiled train step
    sum_ms       the engine's own sum all-reduce of the same bytes: MPI.Allreduce on one numpy buffer
                 (MPI); MultiWorkerMirroredStrategy's all-reduce of the same tensors (TF)
    ratio        adasum_ms / sum_ms (compiled_ratio: compiled_ms / sum_ms)
    horovod_ms   hvd.allreduce(op=hvd.Adasum) of the same data, when Horovod with MPI is importable
                 and the number of ranks is a power of two (Horovod's Adasum refuses others)
    sent_mb      (MPI) the most any rank sent in one Adasum call: exchanges and block sums
    bound_mb     2 (P - 1) / P times the data, what each rank must send in a bandwidth-optimal
                 all-reduce (reduce-scatter then all-gather)
    replicas_ms  with --local-replicas L: Adasum over L replicas in every process (the sync of a
                 MirroredStrategy per process), and replicas_per_adasum, its ratio to adasum_ms
    vhdd_ms, gather_ms, and *_compiled_ms   with --algorithms: the same, each algorithm forced
                 (TF_ADASUM_ALGORITHM)
    fill_ms, agree_ms, vhdd_host_ms   with --phases (MPI, one-tensor cases): the parts of the eager
                 call timed alone, each after a barrier: the fused buffer's fill and norms, the
                 agreement's all-gather, and the algorithm on a host buffer

With --devices-per-process D (D > 1), each process holds D logical CPUs under one AdasumStrategy, and
each case times instead the strategy's compiled sync of every replica's deltas (what fit runs after
the local step), per replica the case's data:
    adasum_ms    local_reduction="adasum": the tree over every replica of every process
    mean_ms      local_reduction="mean": the process's replicas averaged by the strategy's cross-device
                 ops, then the tree over the processes
    sum_ms       as above, the engine's sum all-reduce of one replica's data per process (what
                 MultiWorkerMirroredStrategy's loop pays across processes, with one device each)
    ratio, mean_ratio   adasum_ms / sum_ms and mean_ms / sum_ms

For the cost table in benchmarks/README.md: --megabytes 1 4 16 64 256 at 2, 3 and 4 ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Run as `python benchmarks/collectives/bench_allreduce.py`: benchmarks/ (common.py) on the path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf
from common import median_ms, resnet50_shapes

# Imported by main(), after --devices-per-process's logical CPUs: under tf_adasum.run the import
# starts TensorFlow's collective runtime, which fixes the devices.
tf_adasum: Any = None


def engine_sum(comm: Any, tensors: list[tf.Tensor]) -> tuple[Callable[[], Any], Callable[[], None]]:
    """The engine's plain sum all-reduce of the same data, and a barrier."""
    if comm.engine == "mpi":
        from mpi4py import MPI

        flat = np.concatenate([t.numpy().reshape(-1) for t in tensors])
        out = np.empty_like(flat)
        return (lambda: MPI.COMM_WORLD.Allreduce(flat, out, op=MPI.SUM)), MPI.COMM_WORLD.Barrier
    strategy = comm.strategy

    @tf.function
    def mwms_sum() -> Any:
        def replica_fn() -> Any:
            ctx = tf.distribute.get_replica_context()
            return ctx.all_reduce(tf.distribute.ReduceOp.SUM, tensors)

        return strategy.run(replica_fn)

    def barrier() -> None:
        tf_adasum.allreduce(tf.zeros([1]), op=tf_adasum.Sum).numpy()

    return (lambda: [np.asarray(t) for t in tf.nest.flatten(mwms_sum())]), barrier


def adasum_times(tensors: list[tf.Tensor], repeats: int, barrier: Callable[[], None]) -> tuple[float, float]:
    """Median ms of tf_adasum.allreduce(op=Adasum) called eagerly, and inside a tf.function (traced
    here, so under the algorithm chosen now)."""
    eager = median_ms(lambda: [np.asarray(x) for x in tf_adasum.allreduce(tensors)], repeats, before=barrier)
    compiled = tf.function(lambda ts: tf_adasum.allreduce(ts))
    compiled(tensors)
    inside = median_ms(lambda: [np.asarray(x) for x in compiled(tensors)], repeats, before=barrier)
    return eager, inside


def horovod_adasum() -> Callable[[list[tf.Tensor]], Any] | None:
    """hvd.allreduce(op=hvd.Adasum) over a list, if Horovod with MPI is importable."""
    try:
        import horovod.tensorflow as hvd
    except ImportError:
        return None
    hvd.init()
    if not hvd.mpi_enabled() or hvd.size() & (hvd.size() - 1):  # Horovod's Adasum: powers of two only
        return None
    return lambda tensors: [np.asarray(hvd.allreduce(t, op=hvd.Adasum)) for t in tensors]


def phase_times(
    comm: Any, tensors: list[tf.Tensor], repeats: int, barrier: Callable[[], None]
) -> dict[str, float]:
    """(MPI) Each part of an eager Adasum call timed alone, as the call runs it: the fused buffer's
    fill and norms (fusion.fuse_host), the agreement (one all-gather of three int64 codes), and the
    algorithm in place on a host buffer, level by level; Python's share is what the call costs above
    their sum."""
    from tf_adasum.algorithm import agreement, fusion, vhdd
    from tf_adasum.algorithm.tensor_lists import indices_by_dtype

    (index,) = indices_by_dtype(tensors)
    threads = vhdd.host_threads(comm)
    fill = median_ms(lambda: fusion.fuse_host(tensors, index, threads), repeats, before=barrier)
    codes = agreement.codes_row(agreement.SYNC, -1, 1)
    agree = median_ms(lambda: comm.agree_host(codes, "bench agreement"), repeats, before=barrier)
    group = fusion.fuse_host(tensors, index, threads)
    chosen = vhdd.algorithm(comm, group.nbytes)
    # As the call runs it: reading this rank's values from the input (or the filled buffer), writing
    # the result into a buffer of its own.
    source = group.source if group.source is not None else np.array(group.view)
    out = np.empty_like(source)
    algorithm = median_ms(
        lambda: chosen.on_host(comm, out, group.starts, threads, source), repeats, before=barrier
    )
    row = {"fill_ms": round(fill, 2), "agree_ms": round(agree, 2)}
    return row | {f"{chosen.name}_host_ms": round(algorithm, 2)}


def strategy_sync_ms(
    comm: Any, shapes: list[tuple[int, ...]], per_process: int, mode: str, repeats: int, barrier: Any
) -> float:
    """Median ms of AdasumStrategy's compiled sync over `per_process` local replicas, each with its own
    random deltas of `shapes`, in local_reduction `mode`."""
    from tf_adasum.training import model_sync

    mine = [
        d.name
        for d in tf.config.list_logical_devices("CPU")
        if "/task:" not in d.name or f"/task:{comm.rank}/" in d.name
    ][:per_process]
    strategy = tf_adasum.AdasumStrategy(devices=mine, local_reduction=mode)
    rng = np.random.default_rng(comm.rank)
    with strategy.scope():
        variables = [tf.Variable(tf.zeros(s)) for s in shapes]
        anchors = [tf.Variable(tf.zeros(s)) for s in shapes]
    for v in variables:
        for component in v.values:
            component.assign(rng.standard_normal(v.shape).astype(np.float32))

    @tf.function
    def step() -> tf.Tensor:
        return model_sync.sync_deltas(strategy, variables, anchors)

    with strategy.scope():
        return median_ms(lambda: step().numpy(), repeats, before=barrier)


def main() -> None:
    global tf_adasum
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--megabytes", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument(
        "--algorithms", nargs="*", default=[], choices=["vhdd", "gather"], help="also time each one forced"
    )
    parser.add_argument("--local-replicas", type=int, default=0, help="also time allreduce_replicas")
    parser.add_argument(
        "--phases", action="store_true", help="(MPI) also time the fill, agreement and algorithm alone"
    )
    parser.add_argument(
        "--no-horovod",
        action="store_true",
        help="leave Horovod out: its background thread slows other MPI traffic in its process",
    )
    parser.add_argument(
        "--devices-per-process",
        type=int,
        default=1,
        help="D > 1: AdasumStrategy over D logical CPUs per process, both local_reduction modes",
    )
    args = parser.parse_args()
    if args.devices_per_process > 1:
        tf.config.set_logical_device_configuration(
            tf.config.list_physical_devices("CPU")[0],
            [tf.config.LogicalDeviceConfiguration()] * args.devices_per_process,
        )
    import tf_adasum

    comm = tf_adasum.init()
    rng = np.random.default_rng(comm.rank)
    cases = [(f"single_{mb}MB", [(mb * 2**18,)]) for mb in args.megabytes]
    cases.append(("resnet50_161_tensors", resnet50_shapes()))
    horovod = horovod_adasum() if comm.engine == "mpi" and not args.no_horovod else None
    for name, shapes in cases:
        tensors = [tf.constant(rng.standard_normal(s).astype(np.float32)) for s in shapes]
        sum_fn, barrier = engine_sum(comm, tensors)
        if args.devices_per_process > 1:
            row = {"case": name, "engine": comm.engine, "ranks": comm.size}
            row |= {"devices_per_process": args.devices_per_process, "tensors": len(shapes)}
            row |= {"megabytes": round(4 * sum(int(np.prod(s)) for s in shapes) / 2**20, 1)}
            sum_ms = median_ms(sum_fn, args.repeats, before=barrier)
            for mode in ("adasum", "mean"):
                key = "adasum_ms" if mode == "adasum" else "mean_ms"
                ms = strategy_sync_ms(comm, shapes, args.devices_per_process, mode, args.repeats, barrier)
                row[key] = round(ms, 2)
            row |= {"sum_ms": round(sum_ms, 2), "ratio": round(row["adasum_ms"] / sum_ms, 2)}
            row["mean_ratio"] = round(row["mean_ms"] / sum_ms, 2)
            if comm.rank == 0:
                print(json.dumps(row), flush=True)
            continue
        adasum_ms, compiled_ms = adasum_times(tensors, args.repeats, barrier)
        sum_ms = median_ms(sum_fn, args.repeats, before=barrier)
        sent = None
        if comm.engine == "mpi":
            from mpi4py import MPI

            before = comm.bytes_sent
            tf_adasum.allreduce(tensors)
            sent = MPI.COMM_WORLD.allreduce(comm.bytes_sent - before, op=MPI.MAX)
        row = {"case": name, "engine": comm.engine, "ranks": comm.size, "tensors": len(shapes)}
        row |= {"megabytes": round(4 * sum(int(np.prod(s)) for s in shapes) / 2**20, 1)}
        row |= {
            "adasum_ms": round(adasum_ms, 2),
            "sum_ms": round(sum_ms, 2),
            "ratio": round(adasum_ms / sum_ms, 2),
            "compiled_ms": round(compiled_ms, 2),
            "compiled_ratio": round(compiled_ms / sum_ms, 2),
        }
        for forced in args.algorithms:
            os.environ["TF_ADASUM_ALGORITHM"] = forced
            eager, compiled = adasum_times(tensors, args.repeats, barrier)
            del os.environ["TF_ADASUM_ALGORITHM"]
            row |= {f"{forced}_ms": round(eager, 2), f"{forced}_compiled_ms": round(compiled, 2)}
        if args.phases and comm.engine == "mpi" and len(shapes) == 1:
            row |= phase_times(comm, tensors, args.repeats, barrier)
        if args.local_replicas:
            local = [[t * (1.0 + r) for t in tensors] for r in range(args.local_replicas)]
            replicas_ms = median_ms(
                lambda local=local: [np.asarray(x) for x in tf_adasum.distributed.allreduce_replicas(local)],
                args.repeats,
                before=barrier,
            )
            row |= {
                "replicas_ms": round(replicas_ms, 2),
                "replicas_per_adasum": round(replicas_ms / adasum_ms, 2),
            }
        if sent is not None:
            size = 4 * sum(int(np.prod(s)) for s in shapes)
            row |= {
                "sent_mb": round(sent / 2**20, 2),
                "bound_mb": round(2 * (comm.size - 1) / comm.size * size / 2**20, 2),
            }
        if horovod is not None:
            row["horovod_ms"] = round(
                median_ms(lambda t=tensors: horovod(t), args.repeats, before=barrier), 2
            )
        if comm.rank == 0:
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
