"""Adasum all-reduce against the same engine's plain sum all-reduce of the same data.

Usage:
    mpirun -np P python benchmarks/bench_allreduce.py [--repeats 10]          # MPI engine
    python -m tf_adasum.run -np P benchmarks/bench_allreduce.py [--repeats 10]  # TF engine

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

For the cost table in benchmarks/README.md: --megabytes 1 4 16 64 256 at 2, 3 and 4 ranks.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf
from common import median_ms, resnet50_shapes

import tf_adasum


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

    return (lambda: [t.numpy() for t in tf.nest.flatten(mwms_sum())]), barrier


def adasum_times(tensors: list[tf.Tensor], repeats: int, barrier: Callable[[], None]) -> tuple[float, float]:
    """Median ms of tf_adasum.allreduce(op=Adasum) called eagerly, and inside a tf.function (traced
    here, so under the algorithm chosen now)."""
    eager = median_ms(lambda: [x.numpy() for x in tf_adasum.allreduce(tensors)], repeats, before=barrier)
    compiled = tf.function(lambda ts: tf_adasum.allreduce(ts))
    compiled(tensors)
    inside = median_ms(lambda: [x.numpy() for x in compiled(tensors)], repeats, before=barrier)
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
    return lambda tensors: [hvd.allreduce(t, op=hvd.Adasum).numpy() for t in tensors]


def main() -> None:
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
        "--no-horovod",
        action="store_true",
        help="leave Horovod out: its background thread slows other MPI traffic in its process",
    )
    args = parser.parse_args()
    comm = tf_adasum.init()
    rng = np.random.default_rng(comm.rank)
    cases = [(f"single_{mb}MB", [(mb * 2**18,)]) for mb in args.megabytes]
    cases.append(("resnet50_161_tensors", resnet50_shapes()))
    horovod = horovod_adasum() if comm.engine == "mpi" and not args.no_horovod else None
    for name, shapes in cases:
        tensors = [tf.constant(rng.standard_normal(s).astype(np.float32)) for s in shapes]
        sum_fn, barrier = engine_sum(comm, tensors)
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
        if args.local_replicas:
            local = [[t * (1.0 + r) for t in tensors] for r in range(args.local_replicas)]
            replicas_ms = median_ms(
                lambda local=local: [x.numpy() for x in tf_adasum.distributed.allreduce_replicas(local)],
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
