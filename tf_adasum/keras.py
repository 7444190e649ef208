"""`import tf_adasum.keras as hvd`: the horovod.tensorflow.keras API, on tf_adasum, for Keras 3.

Everything a Horovod Keras script that uses Adasum touches, with Horovod's names and signatures, so that
the import line is the only change. The difference that matters:

- `DistributedOptimizer(opt, op=hvd.Adasum)` is Adasum *after* the optimizer, as in the paper (Figure 3):
  each process steps with its own optimizer state, and the model deltas are combined with Adasum every
  `backward_passes_per_step` steps. Horovod's TensorFlow version combines the gradients before the
  optimizer instead (and its "after" variant never communicates), which makes Adam's or momentum's
  state see Adasum-combined gradients rather than each worker's own.
- `op=hvd.Average` and `op=hvd.Sum` all-reduce the gradients before the optimizer, as Horovod does.

An argument that tf_adasum does not implement raises an error that names it; nothing is ignored.
"""

from __future__ import annotations

from typing import Any

import keras as _keras
import tensorflow as tf

from tf_adasum import agreement, callbacks, distributed, shared_state, sync
from tf_adasum.distributed import (
    Adasum,
    Average,
    Sum,
    cross_rank,
    cross_size,
    is_initialized,
    local_rank,
    local_size,
    rank,
    shutdown,
    size,
)
from tf_adasum.optimizer import AdasumOptimizer, AllreduceOptimizer

__all__ = [
    "Adasum",
    "Average",
    "Compression",
    "DistributedOptimizer",
    "Sum",
    "allgather",
    "allreduce",
    "broadcast",
    "broadcast_variables",
    "callbacks",
    "cross_rank",
    "cross_size",
    "init",
    "is_initialized",
    "load_model",
    "local_rank",
    "local_size",
    "rank",
    "shutdown",
    "size",
]


class _Compressor:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"Compression.{self.name}"


class Compression:
    """Horovod's gradient compression: `none`, or `fp16` (float32/float64 travel as float16)."""

    none = _Compressor("none")
    fp16 = _Compressor("fp16")


def init(comm: Any = None, process_sets: Any = None) -> None:
    """Starts the engine this process was launched for (mpirun, horovodrun, tf_adasum.run, TF_CONFIG)."""
    _unsupported("init", comm=(comm, None), process_sets=(process_sets, None))
    distributed.init()


def _unsupported(where: str, **arguments: tuple[Any, Any]) -> None:
    """Raises naming every argument whose value differs from the one default that tf_adasum implements."""
    for name, (value, default) in arguments.items():
        same = value is default if default is None or isinstance(default, _Compressor) else value == default
        if not same:
            raise NotImplementedError(
                f"{where}({name}={value!r}) is not supported by tf_adasum; only {name}={default!r} is"
            )


def _reduce_op(where: str, average: bool | None, op: Any) -> distributed.ReduceOp:
    if op is not None and average is not None:
        raise ValueError(f"{where}: pass op or average, not both (got op={op!r}, average={average!r})")
    if op is not None:
        return distributed.ReduceOp(op)
    return Sum if average is False else Average


def _value(result: Any) -> Any:
    # Horovod's Keras functions return values, not tensors, when called eagerly.
    return result.numpy() if tf.executing_eagerly() and hasattr(result, "numpy") else result


def allreduce(
    value: Any,
    name: str | None = None,
    average: bool | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    op: Any = None,
    compression: Any = Compression.none,
) -> Any:
    """Reduces a value over all processes: Average (the default), Sum, or Adasum."""
    _unsupported(
        "allreduce",
        prescale_factor=(prescale_factor, 1.0),
        postscale_factor=(postscale_factor, 1.0),
        compression=(compression, Compression.none),
    )
    reduce_op = _reduce_op("allreduce", average, op)
    return _value(distributed.allreduce(tf.convert_to_tensor(value), op=reduce_op))


def broadcast(value: Any, root_rank: int, name: str | None = None) -> Any:
    """Rank `root_rank`'s value, on every process."""
    return _value(distributed.broadcast(tf.convert_to_tensor(value), root=root_rank))


def broadcast_variables(variables: Any, root_rank: int) -> None:
    """Assigns rank `root_rank`'s values to `variables` on every process."""
    shared_state.broadcast_variables(list(variables), root_rank)


def allgather(value: Any, name: str | None = None) -> Any:
    """Every process's value concatenated along the first axis, in rank order.

    As in Horovod, the first dimension may differ between processes; the others must agree.
    """
    tensor = tf.convert_to_tensor(value)
    comm = distributed.init()
    if tensor.shape.rank == 0:
        raise ValueError("allgather needs a tensor of rank 1 or more, got a scalar")
    rows = comm.allgather(tf.shape(tensor, out_type=tf.int64)[:1])[:, 0]
    longest = int(tf.reduce_max(rows))
    padded = tf.pad(tensor, [[0, longest - int(tensor.shape[0])]] + [[0, 0]] * (tensor.shape.rank - 1))
    agreement.check_same_on_all_ranks(comm, [padded], "allgather")
    gathered = comm.allgather(padded)
    parts = [gathered[r, : int(rows[r])] for r in range(comm.size)]
    return _value(tf.concat(parts, 0))


def DistributedOptimizer(
    optimizer: _keras.optimizers.Optimizer,
    name: str | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    sparse_as_dense: bool = False,
    gradient_predivide_factor: float = 1.0,
    op: Any = Average,
    backward_passes_per_step: int = 1,
    average_aggregated_gradients: bool = False,
    num_groups: int = 0,
    groups: Any = None,
    process_set: Any = None,
    scale_local_gradients: bool = True,
) -> _keras.optimizers.Optimizer:
    """Horovod's DistributedOptimizer for Keras 3.

    Args:
        optimizer: the Keras optimizer to wrap.
        name: optional name of the wrapper.
        compression: Compression.none or Compression.fp16.
        sparse_as_dense: sparse (IndexedSlices) gradients are always made dense by tf_adasum; either
            value gives the same result.
        op: Average or Sum all-reduce the gradients before the optimizer; Adasum combines the model
            deltas after it (the paper's method), every `backward_passes_per_step` local steps.
        backward_passes_per_step: with op=Adasum, the local steps between two syncs (each local step
            applies its own gradient); with Average/Sum only 1 is supported.
        average_aggregated_gradients: only False, or True with backward_passes_per_step=1 (where it
            has no effect), is supported.
        device_dense, device_sparse, gradient_predivide_factor, num_groups, groups, process_set,
        scale_local_gradients: only their defaults are supported; anything else raises.

    Returns:
        An AdasumOptimizer (op=Adasum) or AllreduceOptimizer (op=Average/Sum) around `optimizer`.

    Raises:
        NotImplementedError: an argument that tf_adasum does not implement, named.
        ValueError: an unknown op, or a bad backward_passes_per_step.
    """
    _unsupported(
        "DistributedOptimizer",
        device_dense=(device_dense, ""),
        device_sparse=(device_sparse, ""),
        gradient_predivide_factor=(gradient_predivide_factor, 1.0),
        num_groups=(num_groups, 0),
        groups=(groups, None),
        process_set=(process_set, None),
        scale_local_gradients=(scale_local_gradients, True),
    )
    if compression not in (Compression.none, Compression.fp16):
        raise NotImplementedError(
            f"DistributedOptimizer(compression={compression!r}) is not supported by tf_adasum; use "
            "Compression.none or Compression.fp16"
        )
    del sparse_as_dense  # both values give dense reductions here (see Args)
    reduce_op = distributed.ReduceOp(op)
    sync.check_positive_integer("backward_passes_per_step", backward_passes_per_step)
    if average_aggregated_gradients and backward_passes_per_step > 1:
        raise NotImplementedError(
            "DistributedOptimizer(average_aggregated_gradients=True, backward_passes_per_step>1) is not "
            "supported by tf_adasum"
        )
    distributed.init()
    if reduce_op is Adasum:
        return AdasumOptimizer(
            optimizer, sync_every=backward_passes_per_step, name=name, compression=compression.name
        )
    if backward_passes_per_step != 1:
        raise NotImplementedError(
            f"DistributedOptimizer(op={reduce_op.name.title()}, backward_passes_per_step="
            f"{backward_passes_per_step}) is not supported by tf_adasum; only op=Adasum takes local steps"
        )
    return AllreduceOptimizer(optimizer, op=reduce_op, name=name, compression=compression.name)


def load_model(
    filepath: Any, custom_optimizers: Any = None, custom_objects: Any = None, compression: Any = None
) -> Any:
    """keras.models.load_model; tf_adasum's optimizers are registered, so nothing needs wrapping."""
    _unsupported("load_model", custom_optimizers=(custom_optimizers, None), compression=(compression, None))
    return _keras.models.load_model(filepath, custom_objects=custom_objects)
