"""The worker of tests/test_matrix.py, run under tf_adasum.run by the Python of a fresh venv that holds
only TensorFlow, Keras, mpi4py, Open MPI, pytest and the installed wheel:
`python -m tests.workers.matrix OUT MODE[,MODE...]` (tests/workers/dispatch.py). The test copies tests/
beside the venv.

Modes:
    allreduce  a 2-process Adasum all-reduce: the package it imports must be the wheel's, and the result
               the numpy oracle's tree, equal on both ranks (OUT/rank{r}.bin)
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import tensorflow as tf

import tf_adasum
from tests.support import oracle
from tests.workers.dispatch import main

SHAPES = [(1031,), (33, 7), (4,)]


def rank_tensors(rank: int) -> list[np.ndarray]:
    rng = np.random.default_rng(100 + rank)
    return [rng.standard_normal(shape) * (1 + rank) for shape in SHAPES]


def allreduce(out: Path) -> None:
    assert "site-packages" in tf_adasum.__file__, f"tf_adasum comes from {tf_adasum.__file__}, not the wheel"
    tf_adasum.init()
    rank, size = tf_adasum.rank(), tf_adasum.size()
    got = tf_adasum.allreduce([tf.constant(t) for t in rank_tensors(rank)], op=tf_adasum.Adasum)
    want = oracle.tree([rank_tensors(r) for r in range(size)])
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g.numpy(), w, rtol=1e-12, atol=1e-12)
    digest = b"".join(g.numpy().tobytes() for g in got)
    (out / f"rank{rank}.bin").write_bytes(digest)
    print(f"rank {rank} of {size}: Adasum all-reduce equals the oracle, cpu path {tf_adasum.ops.cpu_path()}")


MODES = {"allreduce": allreduce}

if __name__ == "__main__":
    main(MODES)
