"""Adasum of tensor lists across processes: agree, fuse by dtype, run the algorithm, take the tensors out.

adasum() is what tf_adasum.allreduce(op=Adasum) runs with one replica per process; tree_over_replicas()
is the tree over every replica of every process when the processes hold several (AdasumStrategy or a
MirroredStrategy per process, through distributed.allreduce_replicas).

Every sync starts with the agreement (agreement.py): every rank learns that all ranks are at this
sync with finite tensors (and, given a fingerprint, the same shapes) before any data moves. Then the
tensors of each dtype are fused into one buffer (fusion.py) and combined by the algorithm that
vhdd.algorithm() chooses for its size.

How the fused groups are combined is the engine's to say (Communicator.adasum_groups): with
TensorFlow ops where its collectives are TensorFlow ops (in_graph.py), on host memory where its
transport is host code (on_host.py). Both run the same arithmetic, and give the same bits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from tf_adasum import timeline
from tf_adasum.algorithm import compression, fusion
from tf_adasum.algorithm.tensor_lists import indices_by_dtype
from tf_adasum.algorithm.tree import Span, fill_nodes, pair_on_left_device, roots_within
from tf_adasum.comm.base import Communicator
from tf_adasum.common.errors import NonFiniteUpdateError


def adasum(
    comm: Communicator,
    tensors: Sequence[tf.Tensor],
    names: Sequence[str] | None = None,
    metadata: int = 0,
    first: bool = True,
) -> list[tf.Tensor]:
    """Adasum of every rank's tensors by the contract tree; tensors of each dtype are fused.

    First every rank agrees (agreement.py) that all ranks are at this sync with finite tensors, and,
    given `metadata` (agreement.fingerprint of the tensors), with the same shapes and dtypes;
    otherwise every rank raises the same error before any data moves. Compiled under the TF engine,
    where one buffer goes by the all-gather and this is the sync's first collective (`first`), the
    codes travel in that all-gather and are checked before the tree uses the data: one collective
    (_gather_with_the_codes).
    """
    if comm.size == 1:
        return list(tensors)
    if tf.executing_eagerly():  # a compiled sync is marked where it is called, or in its host call
        timeline.mark_cycle("adasum sync", tensors=len(tensors))
    # The bytes only for a timeline being written: off, the phase stays one check.
    nbytes = (
        sum(int(t.shape.num_elements() or 0) * t.dtype.size for t in tensors) if timeline.active() else None
    )
    with timeline.ops_phase("adasum sync", tensors=len(tensors), bytes=nbytes):
        return comm.adasum_groups(tensors, indices_by_dtype(tensors), names, metadata, first)


def _finite(x: tf.Tensor, what: str) -> tf.Tensor:
    """x, after raising NonFiniteUpdateError if it holds NaN or Inf (eagerly, or as a graph check)."""

    def check(values: np.ndarray) -> np.ndarray:
        if not np.all(np.isfinite(values.astype(np.float32))):
            raise NonFiniteUpdateError(f"{what}; every rank stops at this step")
        return values

    if tf.executing_eagerly():
        check(np.asarray(x))
        return x
    checked = tf.numpy_function(check, [x], x.dtype, stateful=True)
    checked.set_shape(x.shape)
    return checked


def tree_over_replicas(
    comm: Communicator,
    per_replica: Sequence[Sequence[tf.Tensor]],
    counts: Sequence[int],
    compressed: str = "none",
) -> list[tf.Tensor]:
    """The contract tree over every replica of every process, for any numbers of replicas per process.

    Process q holds the leaves [counts[0] + ... + counts[q-1], ... + counts[q]) of the tree over
    sum(counts) replicas. Each process combines the nodes it can alone (tree.roots_within: where the
    tree splits inside a process, it holds two or more such roots), every process gathers every
    process's roots, and every process combines the rest of the tree from the gathered copies, with the
    same ops in the same order: the same bits on every process, and (without compression) the same
    bits as adasum_tree over all the replicas in one process. Each process receives every other's
    roots whole, so this moves more than VHDD; distributed.allreduce_replicas takes VHDD when every
    process holds the same power-of-two number of replicas, where the tree splits only between
    processes.

    Args:
        comm: the communicator.
        per_replica: this process's replicas' tensors, counts[comm.rank] lists, already checked to match
            every other process's and to be finite (no agreement runs here).
        counts: every process's number of replicas, in rank order.
        compressed: "fp16" ("bf16"): float32 and float64 roots cross processes as float16 (bfloat16).
    """
    total = sum(counts)
    firsts = np.cumsum([0, *counts]).tolist()
    roots = [roots_within(total, firsts[q], firsts[q + 1]) for q in range(comm.size)]
    lo = firsts[comm.rank]
    mine = fill_nodes(
        {(lo + j, lo + j + 1): list(r) for j, r in enumerate(per_replica)}, total, pair_on_left_device
    )
    sent = [mine[span] for span in roots[comm.rank]]
    tensors = sent[0]
    width = max(len(r) for r in roots)
    values: dict[Span, list[Any]] = {span: [None] * len(tensors) for spans in roots for span in spans}
    n = len(tensors)
    rows = sent + [[tf.zeros_like(t) for t in tensors]] * (width - len(sent))  # the same width everywhere
    flat = [t for row in rows for t in row]
    for index in indices_by_dtype(tensors):
        # All roots in one buffer, one after another: one copy in, one all-gather, and every root's
        # tensors come back out as views of what arrived.
        fused = fusion.fuse(flat, [k * n + i for k in range(width) for i in index])
        buffer = fused.buffer
        narrow = compressed != "none" and compression.narrows(buffer.dtype)
        wire = compression.WIRE_DTYPES.get(compressed)
        gathered = comm.allgather_buffer(tf.cast(buffer, wire) if narrow else buffer)
        if narrow and compressed == "fp16":  # a subtree result beyond float16's range; every process
            # sees the same data (bfloat16 has float32's range)
            gathered = _finite(gathered, "compression='fp16': a subtree result overflows float16")
        gathered = tf.reshape(tf.cast(gathered, buffer.dtype) if narrow else gathered, [-1])
        parts = tf.split(gathered, comm.size * width)  # each root's stretch is aligned: views
        one_root = (fused.starts[: len(index) + 1], fused.pads[: len(index)], fused.shapes[: len(index)])
        for q, spans in enumerate(roots):
            for k, span in enumerate(spans):
                for i, t in zip(index, fusion.unfuse(parts[q * width + k], *one_root), strict=True):
                    values[span][i] = t
    return fill_nodes(values, total, pair_on_left_device)[(0, total)]
