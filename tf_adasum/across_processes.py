"""Adasum of tensor lists across processes: agree, fuse by dtype, run the algorithm, take the tensors out.

adasum() is what tf_adasum.allreduce(op=Adasum) runs with one replica per process; tree_over_replicas()
is the tree over every replica of every process when the processes hold several (AdasumStrategy or a
MirroredStrategy per process, through distributed.allreduce_replicas).

Every sync starts with the agreement (agreement.py): every rank learns that all ranks are at this
sync with finite tensors (and, given a fingerprint, the same shapes) before any data moves. Then the
tensors of each dtype are fused into one buffer (fusion.py) and combined by the algorithm that
vhdd.algorithm() chooses for its size.

Three paths run the same arithmetic:
- eagerly under a HostCommunicator (MPI): the buffer is a fresh TensorFlow tensor filled through a
  numpy view, measuring the norms on the way, and the algorithm runs in place in its memory;
- inside tf.function under a HostCommunicator: the whole sync (fusing, agreement, algorithm for every
  dtype) is one host call (_host_graph), so no TensorFlow op copies the data in between;
- otherwise (the TF engine), TensorFlow ops: concat, the agreement collective, the algorithm's
  collectives, in the graph.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from tf_adasum import agreement, compression, fusion, timeline
from tf_adasum.comm.base import Communicator, HostCommunicator
from tf_adasum.errors import NonFiniteUpdateError
from tf_adasum.tensor_lists import indices_by_dtype
from tf_adasum.tree import Span, fill_nodes, pair_on_left_device, roots_within
from tf_adasum.vhdd import Algorithm, algorithm, host_threads, tree_of_rows


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
        return _adasum(comm, tensors, names, metadata, first)


def _adasum(
    comm: Communicator, tensors: Sequence[tf.Tensor], names: Sequence[str] | None, metadata: int, first: bool
) -> list[tf.Tensor]:
    indices = indices_by_dtype(tensors)
    eager = tf.executing_eagerly()
    if isinstance(comm, HostCommunicator):
        if not eager:
            return _host_graph(comm, tensors, indices, names, metadata)
        threads = host_threads(comm)
        groups = [fusion.fuse_host(tensors, index, threads) for index in indices]
    else:
        groups = [fusion.fuse(tensors, index) for index in indices]

    measured = [group.norms for group in groups if group.norms is not None]
    code: tf.Tensor | int
    if len(measured) == len(groups):  # the copies measured the norms: no second pass over the data
        code = agreement.first_nonfinite_of_norms(indices, measured)
    else:
        code = agreement.first_nonfinite_in_buffers(
            [(index, group.buffer, group.starts) for index, group in zip(indices, groups, strict=True)]
        )
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
        chosen = algorithm(comm, group.nbytes)
        if isinstance(comm, HostCommunicator) and group.view is not None:
            # Into the fresh tensor's memory, from the fused copy in it or from the input itself.
            chosen.on_host(comm, group.view, group.starts, host_threads(comm), group.source)
            combined = buffer
        elif isinstance(comm, HostCommunicator):  # eagerly, where TensorFlow gives no writable view
            body = _host_body(comm, group.starts, chosen)
            combined = comm.host_call(body, [buffer], [buffer.dtype], [buffer.shape])[0]
        else:
            combined = chosen.on_tensors(comm, buffer, group.starts)
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


def _host_body(comm: HostCommunicator, starts: Sequence[int], chosen: Algorithm) -> Any:
    """The host algorithm as a host call's body: on a writable copy of its input."""

    def run(x: np.ndarray) -> list[np.ndarray]:
        buf = np.array(x)
        chosen.on_host(comm, buf, starts, host_threads(comm), None)
        return [buf]

    return run


def _host_graph(
    comm: HostCommunicator,
    tensors: Sequence[tf.Tensor],
    indices: list[list[int]],
    names: Sequence[str] | None,
    metadata: int,
) -> list[tf.Tensor]:
    """adasum() inside a tf.function under a HostCommunicator: one host call for all of it. It fuses the
    inputs (measuring their norms on the way), agrees with the other ranks, and runs the algorithm for
    every dtype, with no TensorFlow op copying the data in between."""
    layouts = [fusion.layout(tensors, index) for index in indices]
    threads = host_threads(comm)

    def run(*arrays: np.ndarray) -> list[np.ndarray]:
        timeline.mark_cycle("adasum sync", tensors=len(tensors))
        with timeline.phase("adasum sync", tensors=len(tensors), bytes=sum(a.nbytes for a in arrays)):
            buffers, norms, in_place, first = [], [], [], 0
            for index, (sizes, starts, pads) in zip(indices, layouts, strict=True):
                sources = arrays[first : first + len(index)]
                first += len(index)
                buffers.append(np.empty(int(starts[-1]), sources[0].dtype))
                with timeline.phase("copy in", tensors=len(index), bytes=buffers[-1].nbytes):
                    measured, source = fusion.fill_or_read_host(
                        sources, buffers[-1], starts, sizes, pads, threads
                    )
                norms.append(measured)
                in_place.append(source)
            code = agreement.first_nonfinite_of_norms(indices, norms)
            table = comm.agree_host(agreement.codes_row(agreement.SYNC, code, metadata), "adasum sync")
            agreement.raise_unless_agreed(table, len(tensors), names)
            for buf, (_, starts, _), source in zip(buffers, layouts, in_place, strict=True):
                algorithm(comm, buf.nbytes).on_host(comm, buf, starts.tolist(), threads, source)
            return buffers

    inputs = [tensors[i] for index in indices for i in index]
    dtypes = [tensors[index[0]].dtype for index in indices]
    # With nothing to combine the agreement still runs: the host call writes the ordering token.
    combined = comm.host_call(run, inputs, dtypes, [[int(starts[-1])] for _, starts, _ in layouts])
    out: list[Any] = [None] * len(tensors)
    for index, buffer, (_, starts, pads) in zip(indices, combined, layouts, strict=True):
        shapes = [tensors[i].shape for i in index]
        for i, tensor in zip(index, fusion.unfuse(buffer, starts.tolist(), pads, shapes), strict=True):
            out[i] = tensor
    return out


def _allgather(comm: Communicator, buffer: tf.Tensor) -> tf.Tensor:
    """comm.allgather of a 1-D buffer; under a HostCommunicator (MPI), on Adasum's own communicator and,
    eagerly, received straight into a fresh TensorFlow tensor."""
    if not isinstance(comm, HostCommunicator):
        return comm.allgather(buffer)
    shape = [comm.size, int(buffer.shape[0])]
    if tf.executing_eagerly():
        out, view = fusion.fresh(shape, buffer.dtype)
        if view is not None:
            comm.allgather_host(np.asarray(buffer), view, "adasum gather")
            return out

    def run(x: np.ndarray) -> list[np.ndarray]:
        rows = np.empty(shape, x.dtype)
        comm.allgather_host(x, rows, "adasum gather")
        return [rows]

    return comm.host_call(run, [buffer], [buffer.dtype], [shape])[0]


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
    comm: Communicator, per_replica: Sequence[Sequence[tf.Tensor]], counts: Sequence[int], fp16: bool = False
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
        fp16: float32 and float64 roots cross processes as float16 (compression="fp16").
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
        narrow = fp16 and compression.narrows(buffer.dtype)
        gathered = _allgather(comm, tf.cast(buffer, tf.float16) if narrow else buffer)
        if narrow:  # a subtree result beyond float16's range; every process sees the same data
            gathered = _finite(gathered, "compression='fp16': a subtree result overflows float16")
        gathered = tf.reshape(tf.cast(gathered, buffer.dtype) if narrow else gathered, [-1])
        parts = tf.split(gathered, comm.size * width)  # each root's stretch is aligned: views
        one_root = (fused.starts[: len(index) + 1], fused.pads[: len(index)], fused.shapes[: len(index)])
        for q, spans in enumerate(roots):
            for k, span in enumerate(spans):
                for i, t in zip(index, fusion.unfuse(parts[q * width + k], *one_root), strict=True):
                    values[span][i] = t
    return fill_nodes(values, total, pair_on_left_device)[(0, total)]
