"""Adasum of fused buffers with TensorFlow ops: the path of an engine whose collectives are TensorFlow
ops (the TF engine). The buffers are made by concatenation, the agreement is a collective in the graph,
and the algorithm's exchanges and block sums are collectives too; compiled, where one buffer goes by
the all-gather, the agreement's codes ride in that all-gather (one collective for both).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from tf_adasum.algorithm import agreement, fusion
from tf_adasum.algorithm.vhdd import algorithm, tree_of_rows
from tf_adasum.comm.base import Communicator


def adasum_groups(
    comm: Communicator,
    tensors: Sequence[tf.Tensor],
    indices: list[list[int]],
    names: Sequence[str] | None,
    metadata: int,
    first: bool,
) -> list[tf.Tensor]:
    """Adasum of `tensors` across comm's ranks, the tensors of each dtype (`indices`) fused into one
    buffer: agree, then combine each buffer by the algorithm its size calls for (see
    fused_adasum.adasum)."""
    groups = [fusion.fuse(tensors, index) for index in indices]
    code: tf.Tensor | int
    if groups:
        code = agreement.first_nonfinite_in_buffers(
            [(index, group.buffer, group.starts) for index, group in zip(indices, groups, strict=True)]
        )
    else:  # nothing to combine: the agreement still runs, so every rank meets at this sync
        code = agreement.first_nonfinite_of_norms(indices, [])
    eager = tf.executing_eagerly()
    if not eager and first and comm.codes_in_gathers:
        if len(groups) == 1 and groups[0].starts[-1] and algorithm(comm, groups[0].nbytes).name == "gather":
            return _gather_with_the_codes(comm, tensors, indices[0], groups[0], code, names, metadata)
        agreement.traced_sync(None)
    checked = agreement.agree(comm, agreement.SYNC, code, "adasum sync", len(tensors), names, metadata)
    out: list[Any] = [None] * len(tensors)
    for index, group in zip(indices, groups, strict=True):
        buffer = group.buffer
        if not eager:  # eagerly, agree() has already raised or passed
            with tf.control_dependencies([checked]):
                buffer = tf.identity(buffer)
        combined = algorithm(comm, group.nbytes).on_tensors(comm, buffer, group.starts)
        for i, tensor in zip(index, group.unfuse(combined), strict=True):
            out[i] = tensor
    return out


def _gather_with_the_codes(
    comm: Communicator,
    tensors: Sequence[tf.Tensor],
    index: list[int],
    group: fusion.Fused,
    code: tf.Tensor | int,
    names: Sequence[str] | None,
    metadata: int,
) -> list[tf.Tensor]:
    """A compiled sync whose one buffer goes by the all-gather, where the engine carries codes in it:
    the agreement and the data in one collective. The codes are checked before the tree reads the
    data, so a NaN or a rank at its epoch end raises the agreement's error on every rank, not the
    kernels'. A rank at its epoch end issues this same collective (agreement.agree_at_epoch_end)."""
    agreement.traced_sync((group.buffer.dtype, group.starts[-1]))
    codes = agreement.codes_tensor(agreement.SYNC, code, metadata)
    table, rows = comm.agree_and_gather(codes, group.buffer, "adasum sync")
    with tf.control_dependencies([agreement.checked_table(table, len(tensors), names)]):
        rows = tf.identity(rows)
    out: list[Any] = [None] * len(tensors)
    for i, tensor in zip(index, group.unfuse(tree_of_rows(comm, rows, group.starts)), strict=True):
        out[i] = tensor
    return out
