"""Adasum of fused buffers on host memory: the path of an engine whose transport is host code (MPI, a
HostCommunicator). Eagerly, each buffer is a fresh TensorFlow tensor filled through a numpy view,
measuring the norms on the way, and the algorithm runs in place in its memory; inside tf.function the
whole sync (fusing, agreement, algorithm for every dtype) is one host call, so no TensorFlow op copies
the data in between.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from tf_adasum import timeline
from tf_adasum.algorithm import agreement, fusion
from tf_adasum.algorithm.vhdd import Algorithm, algorithm, host_threads
from tf_adasum.comm.base import HostCommunicator


def adasum_groups(
    comm: HostCommunicator,
    tensors: Sequence[tf.Tensor],
    indices: list[list[int]],
    names: Sequence[str] | None,
    metadata: int,
    first: bool,
) -> list[tf.Tensor]:
    """Adasum of `tensors` across comm's ranks, the tensors of each dtype (`indices`) fused into one
    buffer (see fused_adasum.adasum); `first` does not change the host path."""
    if not tf.executing_eagerly():
        return _host_graph(comm, tensors, indices, names, metadata)
    threads = host_threads(comm)
    groups = [fusion.fuse_host(tensors, index, threads) for index in indices]
    measured = [group.norms for group in groups if group.norms is not None]
    code: tf.Tensor | int
    if len(measured) == len(groups):  # the copies measured the norms: no second pass over the data
        code = agreement.first_nonfinite_of_norms(indices, measured)
    else:
        code = agreement.first_nonfinite_in_buffers(
            [(index, group.buffer, group.starts) for index, group in zip(indices, groups, strict=True)]
        )
    agreement.agree(comm, agreement.SYNC, code, "adasum sync", len(tensors), names, metadata)
    out: list[Any] = [None] * len(tensors)
    for index, group in zip(indices, groups, strict=True):
        chosen = algorithm(comm, group.nbytes)
        if group.view is not None:
            # Into the fresh tensor's memory, from the fused copy in it or from the input itself.
            chosen.on_host(comm, group.view, group.starts, threads, group.source)
            combined = group.buffer
        else:  # where TensorFlow gives no writable view
            body = _host_body(comm, group.starts, chosen)
            combined = comm.host_call(body, [group.buffer], [group.buffer.dtype], [group.buffer.shape])[0]
        for i, tensor in zip(index, group.unfuse(combined), strict=True):
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


def allgather_buffer(comm: HostCommunicator, buffer: tf.Tensor) -> tf.Tensor:
    """comm.allgather of a 1-D buffer, on Adasum's own communicator and, eagerly, received straight into
    a fresh TensorFlow tensor."""
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
