"""Horovod's collectives (horovod/tensorflow/mpi_ops.py and horovod/tensorflow/__init__.py's allreduce):
all-reduce, reduce-scatter, broadcast, all-gather, all-to-all and the in-place broadcast, grouped where
Horovod groups them; eagerly and inside tf.function, in program order on every engine."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from tf_adasum import distributed
from tf_adasum._horovod.arguments import reduce_op, unsupported
from tf_adasum._horovod.compression import Compression
from tf_adasum.algorithm import agreement
from tf_adasum.algorithm.tensor_lists import dense, first_mismatch, tensor_specs
from tf_adasum.comm import engine
from tf_adasum.comm.base import Communicator
from tf_adasum.common.variables import tf_variable
from tf_adasum.distributed import Average, Sum


def _scaled(tensor: tf.Tensor, factor: float) -> tf.Tensor:
    """tensor * factor; integer tensors are scaled in float64 and cast back, as Horovod scales them."""
    if factor == 1.0:
        return tensor
    if tensor.dtype.is_floating:
        return tensor * tf.cast(factor, tensor.dtype)
    return tf.cast(tf.cast(tensor, tf.float64) * factor, tensor.dtype)


def grouped_allreduce(
    tensors: Sequence[Any],
    average: bool | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
    ignore_name_scope: bool = False,
    name: str | None = None,
    names: Sequence[str] | None = None,
) -> list[tf.Tensor]:
    """Reduces a list of tensors over all processes in one fused call: Average (default), Sum or Adasum.

    Tensors of one dtype travel in one buffer; Adasum is still per tensor. prescale_factor multiplies
    each tensor before the reduction, postscale_factor the result.
    """
    where = "grouped_allreduce"
    unsupported(where, device_dense=(device_dense, ""), device_sparse=(device_sparse, ""))
    unsupported(where, process_set=(process_set, None))
    chosen = reduce_op(where, average, op)
    compressed = [compression.compress(tf.convert_to_tensor(dense(t))) for t in tensors]
    items = [c for c, _ in compressed]
    items = [_scaled(t, prescale_factor) for t in items]
    reduced = distributed.allreduce(items, op=chosen, names=names) if items else []
    reduced = [_scaled(t, postscale_factor) for t in reduced]
    return [compression.decompress(t, ctx) for t, (_, ctx) in zip(reduced, compressed, strict=True)]


def allreduce(
    tensor: Any,
    average: bool | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    name: str | None = None,
    process_set: Any = None,
    ignore_name_scope: bool = False,
) -> tf.Tensor:
    """Reduces a tensor over all processes: Average (the default), Sum, or Adasum. Returns a tensor."""
    return grouped_allreduce(
        [tensor],
        average=average,
        device_dense=device_dense,
        device_sparse=device_sparse,
        compression=compression,
        op=op,
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
        process_set=process_set,
    )[0]


def reducescatter(
    tensor: Any,
    device_dense: str = "",
    compression: Any = Compression.none,
    op: Any = Average,
    name: str | None = None,
    process_set: Any = None,
    ignore_name_scope: bool = False,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> tf.Tensor:
    """This process's share of the first axis of the tensor reduced over all processes (Sum or Average).

    As in Horovod, rank r gets rows [r * n // size + min(r, n % size), ...): when the first dimension n
    does not divide by the number of processes, the lower ranks get one row more. Implemented as an
    all-reduce, then this rank's slice: the bandwidth of an all-reduce, not of a reduce-scatter.
    """
    return _reducescatter(
        "reducescatter",
        [tensor],
        device_dense,
        compression,
        op,
        process_set,
        prescale_factor,
        postscale_factor,
    )[0]


def grouped_reducescatter(
    tensors: Sequence[Any],
    device_dense: str = "",
    compression: Any = Compression.none,
    op: Any = Average,
    process_set: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> list[tf.Tensor]:
    """reducescatter of each tensor, all reduced in one fused all-reduce per dtype (Horovod's)."""
    return _reducescatter(
        "grouped_reducescatter",
        tensors,
        device_dense,
        compression,
        op,
        process_set,
        prescale_factor,
        postscale_factor,
    )


def _reducescatter(
    where: str,
    tensors: Sequence[Any],
    device_dense: str,
    compression: Any,
    op: Any,
    process_set: Any,
    prescale_factor: float,
    postscale_factor: float,
) -> list[tf.Tensor]:
    chosen = distributed.ReduceOp(op)
    if chosen not in (Sum, Average):
        raise NotImplementedError(
            f"{where}(op={chosen.name.title()}) is not supported (nor by Horovod, whose reducescatter "
            "takes only Sum and Average): use Sum or Average"
        )
    if not tensors:
        return []
    reduced = grouped_allreduce(
        tensors,
        device_dense=device_dense,
        compression=compression,
        op=chosen,
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
        process_set=process_set,
    )
    # Checked after the all-reduce, which has checked that every rank passed the same shapes: so a
    # scalar raises here on every rank, not on one while the others wait for it.
    for i, t in enumerate(reduced):
        if t.shape.rank == 0:
            raise ValueError(
                f"{where}: {_which(i, len(reduced))}is a scalar; a reduce-scatter splits the first "
                "dimension, so it needs tensors of rank 1 or more"
            )
    return [_my_rows(t) for t in reduced]


def _which(index: int, count: int) -> str:
    """'tensor 2 of 3 ' for messages about one of several tensors; nothing for a single one."""
    return f"tensor {index} of {count} " if count > 1 else "the tensor "


def _my_rows(reduced: tf.Tensor) -> tf.Tensor:
    """This rank's rows of a reduced tensor: Horovod's split, the extra rows on the lower ranks."""
    n, r, p = tf.shape(reduced)[0], engine.rank(), engine.size()
    base, extra = n // p, n % p
    start = r * base + tf.minimum(r, extra)
    rows = base + tf.cast(r < extra, n.dtype)
    return reduced[start : start + rows]


def broadcast(
    tensor: Any,
    root_rank: int,
    name: str | None = None,
    ignore_name_scope: bool = False,
    process_set: Any = None,
) -> tf.Tensor:
    """Rank `root_rank`'s tensor, on every process."""
    unsupported("broadcast", process_set=(process_set, None))
    return distributed.broadcast(tf.convert_to_tensor(tensor), root=root_rank)


def allgather(
    tensor: Any, name: str | None = None, ignore_name_scope: bool = False, process_set: Any = None
) -> tf.Tensor:
    """Every process's tensor concatenated along the first axis, in rank order; eagerly or compiled.

    As in Horovod, the first dimension may differ between processes; the others must agree.
    """
    unsupported("allgather", process_set=(process_set, None))
    return _allgather("allgather", [tensor])[0]


def grouped_allgather(
    tensors: Sequence[Any], name: str | None = None, ignore_name_scope: bool = False, process_set: Any = None
) -> list[tf.Tensor]:
    """allgather of each tensor (Horovod's): one round for all of their first dimensions, then one
    all-gather per tensor. Each tensor's first dimension may differ between processes."""
    unsupported("grouped_allgather", process_set=(process_set, None))
    return _allgather("grouped_allgather", tensors)


def _check_all_but_first_dimension(
    comm: Communicator, where: str, values: Sequence[tf.Tensor], problem: str | None = None
) -> None:
    """Raises on every rank if some rank found a problem with its own arguments, or if the ranks'
    tensors differ in count, dtype or any dimension but the first. One metadata exchange, when Python
    runs (while a tf.function is traced), so that a rank with bad input does not leave the others
    waiting in the collective."""
    specs = [(None if s is None else [None, *s[1:]] if s else s, d) for s, d in tensor_specs(values)]
    everyone = agreement.gather_objects(comm, (problem, specs), f"{where} metadata check")
    for rank_, (found, _) in enumerate(everyone):
        if found is not None:
            raise ValueError(f"{where}: on rank {rank_}, {found}")
    mismatch = first_mismatch([s for _, s in everyone], "rank")
    if mismatch is not None:
        raise ValueError(f"{where}: {mismatch}; only the first dimension (None here) may differ")


def _rank_problem(where: str, values: Sequence[tf.Tensor]) -> str | None:
    """What is wrong with tensors that must have a first dimension, or None."""
    for i, v in enumerate(values):
        if v.shape.rank is None:
            return f"{_which(i, len(values))}has an unknown rank; {where} needs it known when traced"
        if v.shape.rank == 0:
            return f"{_which(i, len(values))}is a scalar; {where} needs tensors of rank 1 or more"
    return None


def _allgather(where: str, tensors: Sequence[Any]) -> list[tf.Tensor]:
    values = [tf.convert_to_tensor(t) for t in tensors]
    comm = engine.init()
    if not values:
        return []
    _check_all_but_first_dimension(comm, where, values, _rank_problem(where, values))
    if comm.size == 1:
        return values
    # Every tensor's first dimension on every rank, in one gather; then each tensor padded to its longest.
    (firsts,) = agreement.announce(
        comm, agreement.ALLGATHER, [tf.stack([tf.shape(v, out_type=tf.int64)[0] for v in values])], where
    )
    rows = comm.allgather(firsts)
    longest = tf.reduce_max(rows, axis=0)
    out = []
    for i, v in enumerate(values):
        padding = [[0, longest[i] - tf.shape(v, out_type=tf.int64)[0]]] + [[0, 0]] * (v.shape.rank - 1)
        (padded,) = agreement.announce(comm, agreement.ALLGATHER, [tf.pad(v, padding)], where)
        gathered = comm.allgather(padded)
        out.append(tf.boolean_mask(gathered, tf.sequence_mask(rows[:, i], longest[i])))
    return out


def alltoall(
    tensor: Any,
    splits: Any = None,
    name: str | None = None,
    ignore_name_scope: bool = False,
    process_set: Any = None,
) -> Any:
    """Sends rows of `tensor` to every process and returns the rows every process sent here (Horovod's).

    Rows are cut along the first dimension, in rank order: the first splits[0] go to rank 0, the next
    splits[1] to rank 1, and so on (rows past their sum are not sent). Without splits the first
    dimension is cut into equal parts, one per process, and must divide by their number. The other
    dimensions and the dtype must agree between processes. Implemented as an all-gather of the
    tensors, padded to the longest: the bandwidth of an all-gather, not of an all-to-all.

    Args:
        tensor: a tensor of rank 1 or more.
        splits: optional integer vector of one count per process.

    Returns:
        The received rows, concatenated in the order of the ranks that sent them; with `splits`, also
        received_splits, the int32 counts of rows received from each rank (Horovod's pair).

    Raises:
        ValueError: on every rank, when some rank's splits are not one non-negative count per process
            adding up to at most its rows, its rows do not divide evenly without splits, or the ranks'
            tensors differ in dtype or other dimensions (inside tf.function the run-time checks raise
            InvalidArgumentError with the same message).
    """
    where = "alltoall"
    unsupported(where, process_set=(process_set, None))
    value = tf.convert_to_tensor(tensor)
    comm = engine.init()
    size = comm.size
    counts = None if splits is None else tf.convert_to_tensor(splits)
    problem = _rank_problem(where, [value])
    if counts is not None and problem is None:
        if not counts.dtype.is_integer:
            problem = f"splits has dtype {counts.dtype.name}; expected integers"
        elif counts.shape.rank != 1 or counts.shape[0] not in (None, size):
            problem = f"splits has shape {counts.shape}; expected [{size}], one count per process"
    _check_all_but_first_dimension(comm, where, [value], problem)
    first = tf.shape(value, out_type=tf.int64)[0]
    sent = tf.fill([size], first // size) if counts is None else tf.cast(counts, tf.int64)
    # Every rank's (rows, splits given, splits), so that every rank checks every rank's.
    mine = tf.concat([tf.stack([first, tf.constant(int(counts is not None), tf.int64)]), sent], 0)
    (mine,) = agreement.announce(comm, agreement.ALLGATHER, [mine], where)
    table = _host_check(_check_splits, comm.allgather(mine))
    rows, matrix = table[:, 0], table[:, 2:]
    longest = tf.reduce_max(rows)
    padding = [[0, longest - first]] + [[0, 0]] * (value.shape.rank - 1)
    (padded,) = agreement.announce(comm, agreement.ALLGATHER, [tf.pad(value, padding)], where)
    gathered = comm.allgather(padded)
    # From each rank s: the rows it sends here, which start after those it sends to lower ranks.
    received = matrix[:, comm.rank]
    starts = tf.reduce_sum(matrix[:, : comm.rank], axis=1)
    position = tf.range(longest)[tf.newaxis, :]
    keep = (position >= starts[:, tf.newaxis]) & (position < (starts + received)[:, tf.newaxis])
    output = tf.boolean_mask(gathered, keep)
    return output if counts is None else (output, tf.cast(received, tf.int32))


def _check_splits(table: np.ndarray) -> np.ndarray:
    """Raises ValueError naming the first rank whose alltoall splits do not fit its tensor."""
    size = table.shape[0]
    for r, (rows, given, *sent) in enumerate(table.tolist()):
        if not given and rows % size:
            raise ValueError(
                f"alltoall: rank {r}'s tensor has {rows} rows, which do not split evenly over {size} "
                "processes; pass splits"
            )
        if min(sent) < 0:
            raise ValueError(f"alltoall: rank {r}'s splits {sent} hold a negative count")
        if sum(sent) > rows:
            raise ValueError(
                f"alltoall: rank {r}'s splits {sent} add up to {sum(sent)} rows, more than its tensor's "
                f"{rows}"
            )
    return table


def _host_check(check: Callable[[np.ndarray], np.ndarray], table: tf.Tensor) -> tf.Tensor:
    """check(table) now, eagerly; inside a tf.function, as an op whose output later work depends on."""
    if tf.executing_eagerly():
        check(table.numpy())
        return table
    checked = tf.numpy_function(check, [table], table.dtype, stateful=True)
    checked.set_shape(table.shape)
    return checked


def broadcast_(
    variables: Sequence[Any], root_rank: int, name: str | None = None, process_set: Any = None
) -> list[tf.Tensor]:
    """Assigns rank `root_rank`'s values to `variables` on every process; returns their new values.

    Horovod's in-place broadcast: one fused broadcast per dtype, then an assign to each variable
    (tf_adasum holds the received values in a buffer before assigning them, which Horovod avoids).
    """
    where = "broadcast_"
    unsupported(where, process_set=(process_set, None))
    held = [tf_variable(v) for v in variables]
    for i, v in enumerate(held):
        if not hasattr(v, "assign"):
            raise TypeError(
                f"{where} assigns in place, so it takes variables, but {_which(i, len(held))}is a "
                f"{type(v).__name__}: use broadcast(tensor, root_rank) for tensors"
            )
    if not held:
        return []
    values = distributed.broadcast(list(held), root=root_rank)
    for variable, value in zip(held, values, strict=True):
        variable.assign(value)
    return [tf.identity(v) for v in held]


def join() -> tf.Tensor:
    """Not supported: tf_adasum refuses uneven data instead of joining (see docs/failures.md)."""
    raise NotImplementedError(
        "hvd.join() is not supported by tf_adasum: a rank that ran out of data would have to keep "
        "contributing to every collective, which Adasum cannot do honestly. Give every rank the same "
        "number of batches (equal shards, drop_remainder=True, or a fixed number of steps); a rank that "
        "ends early makes every rank raise tf_adasum.UnevenDataError"
    )
