"""The collectives users call: allreduce (Adasum, Sum, Average), broadcast, allreduce_replicas.

init, rank, size and the rest of the engine's lifecycle are engine.py's; they are re-exported here,
where tf_adasum.distributed has always offered them.
"""

from __future__ import annotations

import collections
import enum
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from tf_adasum import timeline
from tf_adasum.algorithm import agreement, fused_adasum, fusion
from tf_adasum.algorithm.compression import narrowed, widened
from tf_adasum.algorithm.tensor_lists import as_tensor_list, check_float_tensors, indices_by_dtype
from tf_adasum.algorithm.tree import adasum_tree
from tf_adasum.comm.base import Communicator
from tf_adasum.comm.engine import (
    cross_rank,
    cross_size,
    detect_engine,
    init,
    is_initialized,
    launched_for_the_tf_engine,
    local_rank,
    local_size,
    rank,
    shutdown,
    size,
)
from tf_adasum.common import errors, settings
from tf_adasum.common.variables import tf_variable

__all__ = [
    "Adasum",
    "Average",
    "Max",
    "Min",
    "Product",
    "ReduceOp",
    "Sum",
    "allreduce",
    "allreduce_compressed",
    "allreduce_grouped",
    "allreduce_replicas",
    "broadcast",
    "cross_rank",
    "cross_size",
    "detect_engine",
    "init",
    "is_initialized",
    "launched_for_the_tf_engine",
    "local_rank",
    "local_size",
    "rank",
    "shutdown",
    "size",
]


class ReduceOp(enum.Enum):
    ADASUM = "adasum"
    SUM = "sum"
    AVERAGE = "average"
    MIN = "min"
    MAX = "max"
    PRODUCT = "product"


Adasum, Sum, Average = ReduceOp.ADASUM, ReduceOp.SUM, ReduceOp.AVERAGE
Min, Max, Product = ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT


# Library code runs as plain Python inside a tf.function: its branches depend only on static facts.
@tf.autograph.experimental.do_not_convert
def allreduce(tensors: Any, op: ReduceOp = Adasum, names: Sequence[str] | None = None) -> Any:
    """Reduces tensors over all processes; every rank gets bitwise identical results.

    Args:
        tensors: a tensor or a list of tensors, the same count, shapes and dtypes on every rank.
        op: tf_adasum.Adasum (per tensor, by the contract tree; floating dtypes only), tf_adasum.Sum
            or tf_adasum.Average (any numeric dtype; integer averages round toward negative infinity),
            or elementwise Min, Max or Product (any numeric dtype).
        names: optional names of the tensors, used in error messages.

    Returns:
        The reduced tensors, in the structure of `tensors`.

    Raises:
        ValueError: tensors differ across ranks (on every rank, naming tensor and ranks).
        TypeError: a non-floating tensor with op=Adasum.
        NonFiniteUpdateError: op=Adasum, and some rank's tensors hold NaN or Inf (on every rank,
            naming the rank and the tensor).
        UnevenDataError: op=Adasum, and some rank ended its epoch instead of calling this.
        PeerError: a peer died or did not answer within TF_ADASUM_TIMEOUT_SECONDS.

    Examples:
        >>> tf_adasum.init()
        >>> grads = tf_adasum.allreduce(grads, op=tf_adasum.Adasum)
    """
    comm = init()
    op = ReduceOp(op)
    what = f"allreduce(op={op.name.title()})"
    items, single = as_tensor_list(what, tensors)
    if op is Adasum:
        check_float_tensors(what, items, one_dtype=False)
    if op is Adasum and tf.executing_eagerly() and comm.size > 1:
        # Eagerly the shapes are checked by fingerprint in the sync's agreement, with no round of
        # their own; how they differ is gathered only when they do.
        metadata = agreement.fingerprint(items)
        try:
            if items and comm.compiles_eager_syncs:
                out = _compiled_adasum(comm, items, names, metadata)
            else:
                out = fused_adasum.adasum(comm, items, names, metadata)
        except agreement.MetadataDiffers:
            agreement.check_same_on_all_ranks(comm, items, what, names)
            raise
    elif op is Adasum:  # traced: the check runs once, at trace time
        agreement.check_same_on_all_ranks(comm, items, what, names)
        out = fused_adasum.adasum(comm, items, names)
    else:
        agreement.check_same_on_all_ranks(comm, items, what, names)
        reduction = "sum" if op is Average else op.value
        out = _fused(comm, items, lambda buffer: comm.allreduce(buffer, reduction), agreement.ALLREDUCE, what)
        if op is Average:
            out = [t / comm.size if t.dtype.is_floating else t // comm.size for t in out]
    return out[0] if single else out


def _bytes(tensor: tf.Tensor) -> int:
    return int(tensor.shape.num_elements() or 0) * tensor.dtype.size


# The compiled eager syncs, by (communicator, forced algorithm, the tensors' specs, their names), the
# least recently used first; past this many the oldest goes (its keys are its signature's, so a later
# trace of it gets the same keys).
_compiled_syncs: collections.OrderedDict[Any, Any] = collections.OrderedDict()
COMPILED_SYNCS = 64


def _compiled_adasum(
    comm: Communicator, items: Sequence[tf.Tensor], names: Sequence[str] | None, metadata: int
) -> list[tf.Tensor]:
    """Eager Adasum as one compiled function per signature (engines whose collectives are TensorFlow
    ops): no per-op dispatch, and the same agreement first as the eager path, whose fixed key meets
    every rank's call whatever its shapes. The codes do not ride in the data's all-gather here: that
    collective's key is its layout's, so ranks with different shapes would not meet in it.

    The algorithm is chosen when the function is traced, so a forced one ($TF_ADASUM_ALGORITHM) is part
    of the signature, and of the number its collectives' keys come from."""
    forced = settings.forced_algorithm()
    specs = tuple((t.dtype, tuple(t.shape)) for t in items)
    key = (id(comm), forced, specs, tuple(names or ()))
    sync = _compiled_syncs.get(key)
    if sync is None:
        signature = metadata ^ zlib.crc32(forced.encode()) if forced else metadata

        def body(*tensors: tf.Tensor) -> list[tf.Tensor]:
            with comm.instance_keys_of(signature):
                return fused_adasum.adasum(comm, list(tensors), names, metadata, first=False)

        sync = tf.function(body, input_signature=[tf.TensorSpec(s, d) for d, s in specs], autograph=False)
        _compiled_syncs[key] = sync
        while len(_compiled_syncs) > COMPILED_SYNCS:
            _compiled_syncs.popitem(last=False)
    _compiled_syncs.move_to_end(key)
    try:
        # One event for the whole sync: its phases are ops of the compiled function, named after them
        # for TensorBoard's profiler, and Python does not see them run (tf_adasum/timeline.py).
        timeline.mark_cycle("adasum sync", tensors=len(items))
        with timeline.phase(
            "adasum sync (compiled)", tensors=len(items), bytes=sum(_bytes(t) for t in items)
        ):
            return list(sync(*items))
    except tf.errors.OpError as error:
        if "MetadataDiffers" in error.message:  # raised by the agreement, on every rank
            raise agreement.MetadataDiffers(error.message) from error
        if isinstance(error, errors.LOST_PEER):  # as the eager path's collectives tell it
            raise comm.peer_error(error, "allreduce(op=Adasum)") from error
        translated = errors.translate(error, comm)
        if translated is None:
            raise
        raise translated from error


def allreduce_compressed(
    tensors: list[Any], op: ReduceOp, compression: str, names: Sequence[str]
) -> list[Any]:
    """allreduce; with compression "fp16" ("bf16"), float32 and float64 tensors travel as float16
    (bfloat16)."""
    if compression == "none":
        return allreduce(tensors, op=op, names=names)
    return widened(allreduce(narrowed(tensors, compression), op=op, names=names), tensors)


def gradient_groups(
    gradients: Sequence[Any], variables: Sequence[Any] | None, groups: Any, what: str
) -> list[list[int]]:
    """Which gradients travel together, in the order the calls go out: Horovod's `groups`, else buckets.

    - `groups` a positive int: the gradients split into that many consecutive groups (Horovod's rule);
    - a list of lists of variables: each inner list one group, every other gradient a group of its own;
    - None or 0: in a traced step, buckets of about $TF_ADASUM_BUCKET_MB from the last gradient back
      (0, the default: one group); eagerly one group, since every gradient already exists.

    The groups go out last first: the backward pass makes the last layers' gradients first, and in a
    tf.function each group's call starts as soon as its own gradients exist, while the earlier layers'
    are still being computed. With Adasum every tensor keeps its own coefficients, so how tensors are
    grouped changes no bit of the result.
    """
    count = len(gradients)
    if isinstance(groups, bool) or not (groups is None or isinstance(groups, int | list | tuple)):
        raise ValueError(
            f"{what}: groups must be None, a number of groups or a list of lists of variables, got {groups!r}"
        )
    if isinstance(groups, int) and groups < 0:
        raise ValueError(f"{what}: groups={groups}; expected a number of groups, 0 or more")
    if isinstance(groups, list | tuple):
        if variables is None:
            raise ValueError(f"{what}: groups of variables need the variables the gradients belong to")
        where = {id(tf_variable(v)): i for i, v in enumerate(variables)}
        taken: dict[int, int] = {}
        out: list[list[int]] = []
        for g, group in enumerate(groups):
            if not isinstance(group, list | tuple):
                raise ValueError(
                    f"{what}: groups[{g}] is a {type(group).__name__}; expected a list of variables"
                )
            members = []
            for variable in group:
                i = where.get(id(tf_variable(variable)))
                if i is None:
                    continue  # a variable without a gradient here (Horovod skips it too)
                if i in taken:
                    raise ValueError(
                        f"{what}: variable {getattr(variable, 'name', variable)!r} is in groups "
                        f"{taken[i]} and {g}; each variable belongs to one group"
                    )
                taken[i] = g
                members.append(i)
            if members:
                out.append(sorted(members))
        out += [[i] for i in range(count) if i not in taken]
        return out[::-1]
    if count == 0:
        return []
    if groups:
        parts = np.array_split(np.arange(count), min(groups, count))
        return [part.tolist() for part in reversed(parts)]
    limit = settings.bucket_bytes()
    if not limit or tf.executing_eagerly() or count < 2:
        return [list(range(count))]
    out, current, size = [], [], 0
    for i in reversed(range(count)):
        current.append(i)
        size += _bytes(gradients[i])
        if size >= limit:
            out.append(sorted(current))
            current, size = [], 0
    return [*out, sorted(current)] if current else out


def allreduce_grouped(
    tensors: list[Any],
    op: ReduceOp,
    compression: str,
    names: Sequence[str],
    groups: list[list[int]],
) -> list[Any]:
    """allreduce_compressed of each group in turn (gradient_groups' order): one fused call per group."""
    out: list[Any] = [None] * len(tensors)
    with agreement.one_step_of_syncs():  # the first group's sync is where an epoch end meets this step
        for index in groups:
            reduced = allreduce_compressed(
                [tensors[i] for i in index], op, compression, [names[i] for i in index]
            )
            for i, tensor in zip(index, reduced, strict=True):
                out[i] = tensor
    return out


# As allreduce: plain Python inside a tf.function.
@tf.autograph.experimental.do_not_convert
def allreduce_replicas(
    per_replica: Sequence[Sequence[Any]], names: Sequence[str] | None = None, compression: str = "none"
) -> list[tf.Tensor]:
    """Adasum over every replica of every process: the contract tree over all of them, in rank order.

    Args:
        per_replica: per_replica[j] is this process's replica j's list of tensors. Every replica of
            every process has the same tensors (shapes and dtypes); processes may hold different
            numbers of replicas. Process 0's replicas are the tree's first leaves, then process 1's...
        names: optional names of the tensors, used in error messages.
        compression: "fp16" ("bf16"): float32 and float64 tensors cross processes as float16
            (bfloat16).

    Returns:
        The combined tensors, bitwise identical on every process.

    When every process holds the same power-of-two number L of replicas, the tree over all P*L
    replicas is the tree over the processes of each process's tree over its own L (the fold and every
    level pair whole processes), so each process combines its own and VHDD combines the processes.
    Otherwise the tree splits inside processes: fused_adasum.tree_over_replicas.

    Raises:
        As allreduce(op=Adasum); a replica's NaN or Inf is reported by every process.
    """
    comm = init()
    local = [[tf.convert_to_tensor(t) for t in r] for r in per_replica]
    if comm.size == 1:
        # Checked before the tree, whose kernels would stop at the first bad pair naming neither the
        # replica nor the variable.
        return adasum_tree(agreement.finite_replicas(local, names) if len(local) > 1 else local)
    # One metadata round for all of it, so that every process raises the same error.
    counts = agreement.check_replicas_everywhere(comm, local, names)
    if max(counts) > 1:
        # A NaN would stop one process inside its own part of the tree and leave the others waiting:
        # every process checks all of its replicas first, and all raise the same error.
        code = agreement.first_nonfinite_in_replicas(local)
        checked = agreement.agree(comm, agreement.SYNC, code, "adasum sync", len(local[0]), names)
        if not tf.executing_eagerly():
            agreement.traced_sync(None)  # this sync's first collective: where an epoch end meets it
            with tf.control_dependencies([checked]):
                local = [[tf.identity(t) for t in r] for r in local]
    if len(set(counts)) == 1 and counts[0] & (counts[0] - 1) == 0:
        combined = adasum_tree(local) if len(local) > 1 else local[0]
        first = max(counts) == 1
        if compression == "none":
            return fused_adasum.adasum(comm, combined, names, first=first)
        narrow = narrowed(combined, compression)
        return widened(fused_adasum.adasum(comm, narrow, names, first=first), combined)
    return fused_adasum.tree_over_replicas(comm, local, counts, compression)


@tf.autograph.experimental.do_not_convert
def broadcast(tensors: Any, root: int = 0) -> Any:
    """Root's tensors on every rank, in the structure of `tensors`."""
    comm = init()
    items, single = as_tensor_list("broadcast", tensors)
    if not 0 <= root < comm.size:
        raise ValueError(f"root rank {root} is not a rank of this job of {comm.size} processes")
    agreement.check_same_on_all_ranks(comm, items, "broadcast")
    out = _fused(
        comm, items, lambda buffer: comm.broadcast(buffer, root), agreement.BROADCAST, "broadcast", root
    )
    return out[0] if single else out


def _fused(
    comm: Communicator,
    items: Sequence[tf.Tensor],
    collective: Any,
    kind: int,
    what: str,
    value: int = 0,
) -> list[tf.Tensor]:
    """collective(buffer) on one fused buffer per dtype, each announced (agreement.announce): one
    collective for a model's variables or gradients instead of one per tensor. A tensor whose shape is
    known only when the graph runs travels alone."""
    if comm.size == 1:
        return list(items)
    out: list[Any] = [None] * len(items)
    known = [i for i, t in enumerate(items) if t.shape.is_fully_defined()]
    groups = [[known[j] for j in index] for index in indices_by_dtype([items[i] for i in known])]
    for index in groups + [[i] for i in range(len(items)) if i not in set(known)]:
        if len(index) == 1:
            (tensor,) = agreement.announce(comm, kind, [items[index[0]]], what, value)
            out[index[0]] = collective(tensor)
            continue
        fused = fusion.fuse(items, index)
        (buffer,) = agreement.announce(comm, kind, [fused.buffer], what, value)
        for i, tensor in zip(index, fused.unfuse(collective(buffer)), strict=True):
            out[i] = tensor
    return out
