"""What keeping MPI host calls in program order costs: a compiled step of k small collectives, with the
ordering token (MPICommunicator.host_call, as tf_adasum runs them) and without it, chained instead by
data (each call takes the one before's output, through a plain tf.numpy_function): the same order,
with no variable read and written per call.

Usage:
    mpirun -np 2 python benchmarks/micro/bench_host_calls.py [--calls 1 4 16] [--repeats 300]

Rank 0 prints one JSON line per k: the median step time with the token and with the data chain, the
token's cost per host call, and the ratio, all measured in this run. Each collective averages 8
float32 over the ranks, so the figure is the fixed cost of a host call, not bandwidth. A data chain
orders only calls that feed each other, which a real step's collectives (gradients, then a broadcast
of variables) do not; it is the cheapest way to run them in sequence, so the difference is the
token's own cost.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

# Run as `python benchmarks/micro/bench_host_calls.py`: benchmarks/ (common.py) on the path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf
from common import median_ms

import tf_adasum


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--repeats", type=int, default=300)
    args = parser.parse_args()
    comm = tf_adasum.init("mpi")
    from mpi4py import MPI

    def averaged(a: np.ndarray) -> list[np.ndarray]:
        out = np.empty_like(a)
        MPI.COMM_WORLD.Allreduce(a, out, op=MPI.SUM)
        return [out / np.float32(comm.size)]

    x = tf.ones([8])
    for k in args.calls:

        @tf.function
        def with_token(x: tf.Tensor, k: int = k) -> tf.Tensor:
            outs = [comm.host_call(averaged, [x], [tf.float32], [[8]])[0] for _ in range(k)]
            return tf.add_n(outs)

        @tf.function
        def data_chain(x: tf.Tensor, k: int = k) -> tf.Tensor:
            outs, y = [], x
            for _ in range(k):
                y = tf.numpy_function(lambda a: averaged(a)[0], [y], tf.float32, stateful=True)
                outs.append(y)
            return tf.add_n(outs)

        barrier = MPI.COMM_WORLD.Barrier
        token_ms = median_ms(lambda f=with_token: f(x).numpy(), args.repeats, before=barrier)
        chain_ms = median_ms(lambda f=data_chain: f(x).numpy(), args.repeats, before=barrier)
        row = {"host_calls": k, "ranks": comm.size, "with_token_ms": round(token_ms, 4)}
        row |= {"data_chain_ms": round(chain_ms, 4), "ratio": round(token_ms / chain_ms, 3)}
        row |= {"token_us_per_call": round(1e3 * (token_ms - chain_ms) / k, 1)}
        if comm.rank == 0:
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
