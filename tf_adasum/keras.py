"""`import tf_adasum.keras as hvd`: the horovod.tensorflow.keras API, on tf_adasum, for Keras 3.

Everything a Horovod Keras script that uses Adasum touches, with Horovod's names and signatures, so that
the import line is the only change. The difference that matters:

- `DistributedOptimizer(opt, op=hvd.Adasum)` is Adasum *after* the optimizer, as in the paper (Figure 3):
  each process steps with its own optimizer state, and the model deltas are combined with Adasum every
  `backward_passes_per_step` steps. Horovod's TensorFlow version combines the gradients before the
  optimizer instead (and its "after" variant never communicates), which makes Adam's or momentum's
  state see Adasum-combined gradients rather than each worker's own.
- `op=hvd.Average` and `op=hvd.Sum` all-reduce the gradients before the optimizer, as Horovod does.

The functions are tf_adasum.tensorflow's (Horovod's Keras module sits on its TensorFlow module the same
way), with Horovod's Keras signatures: they return tensors, eagerly and inside tf.function. An argument
that tf_adasum does not implement raises NotImplementedError naming it; `name` is accepted and has no effect.
"""

from __future__ import annotations

from typing import Any

import keras as _keras
import tensorflow as tf

from tf_adasum import _compat, callbacks
from tf_adasum import tensorflow as _tf
from tf_adasum._horovod.arguments import unsupported
from tf_adasum._horovod.compression import check_compressor
from tf_adasum._horovod.keras2_optimizer import load_keras_2_model, saved_by_keras_2
from tf_adasum.tensorflow import (
    Adasum,
    Average,
    Compression,
    ProcessSet,
    Sum,
    add_process_set,
    broadcast_global_variables,
    broadcast_variables,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    elastic,
    global_process_set,
    gloo_built,
    gloo_enabled,
    init,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    remove_process_set,
    rocm_built,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)
from tf_adasum.training.optimizer import WrappedOptimizer

__all__ = [
    "Adasum",
    "Average",
    "Compression",
    "DistributedOptimizer",
    "PartialDistributedOptimizer",
    "ProcessSet",
    "Sum",
    "add_process_set",
    "allgather",
    "allreduce",
    "broadcast",
    "broadcast_global_variables",
    "broadcast_variables",
    "callbacks",
    "ccl_built",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "elastic",
    "global_process_set",
    "gloo_built",
    "gloo_enabled",
    "init",
    "is_initialized",
    "load_model",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "rank",
    "reducescatter",
    "remove_process_set",
    "rocm_built",
    "shutdown",
    "size",
    "start_timeline",
    "stop_timeline",
]


def allreduce(
    value: Any,
    name: str | None = None,
    average: bool | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    op: Any = None,
    compression: Any = Compression.none,
) -> tf.Tensor:
    """Reduces a value over all processes: Average (the default), Sum, or Adasum. Returns a tensor."""
    return _tf.allreduce(
        value,
        average=average,
        compression=compression,
        op=op,
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
    )


def broadcast(value: Any, root_rank: int, name: str | None = None) -> tf.Tensor:
    """Rank `root_rank`'s value, on every process, as a tensor."""
    return _tf.broadcast(value, root_rank)


def allgather(value: Any, name: str | None = None) -> tf.Tensor:
    """Every process's value concatenated along the first axis, in rank order, as a tensor.

    As in Horovod, the first dimension may differ between processes; the others must agree.
    """
    return _tf.allgather(value)


def reducescatter(value: Any, name: str | None = None, op: Any = Average) -> tf.Tensor:
    """This process's share of the first axis of the value reduced over all processes (Sum or Average);
    see tf_adasum.tensorflow.reducescatter."""
    return _tf.reducescatter(value, op=op)


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
    outer_optimizer: Any = None,
) -> _keras.optimizers.Optimizer:
    """Horovod's Keras DistributedOptimizer: tf_adasum.tensorflow.DistributedOptimizer, with the Keras
    module's argument order (and tf_adasum's outer_optimizer, for op=Adasum: see there).

    Returns:
        An AdasumOptimizer (op=Adasum: Adasum after the optimizer, every `backward_passes_per_step`
        local steps) or an AllreduceOptimizer (op=Average/Sum: the gradients all-reduced before it).
    """
    return _tf.DistributedOptimizer(
        optimizer,
        name=name,
        device_dense=device_dense,
        device_sparse=device_sparse,
        compression=compression,
        sparse_as_dense=sparse_as_dense,
        backward_passes_per_step=backward_passes_per_step,
        op=op,
        gradient_predivide_factor=gradient_predivide_factor,
        average_aggregated_gradients=average_aggregated_gradients,
        num_groups=num_groups,
        groups=groups,
        process_set=process_set,
        scale_local_gradients=scale_local_gradients,
        outer_optimizer=outer_optimizer,
    )


def PartialDistributedOptimizer(
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
    local_layers: Any = None,
    scale_local_gradients: bool = True,
) -> _keras.optimizers.Optimizer:
    """Horovod's PartialDistributedOptimizer (horovod.keras): every variable of `local_layers` stays this
    worker's own; see tf_adasum.tensorflow.PartialDistributedOptimizer."""
    return _tf.PartialDistributedOptimizer(
        optimizer,
        name=name,
        device_dense=device_dense,
        device_sparse=device_sparse,
        compression=compression,
        sparse_as_dense=sparse_as_dense,
        backward_passes_per_step=backward_passes_per_step,
        op=op,
        gradient_predivide_factor=gradient_predivide_factor,
        average_aggregated_gradients=average_aggregated_gradients,
        num_groups=num_groups,
        groups=groups,
        process_set=process_set,
        local_layers=local_layers,
        scale_local_gradients=scale_local_gradients,
    )


def load_model(
    filepath: Any,
    custom_optimizers: Any = None,
    custom_objects: Any = None,
    compression: Any = Compression.none,
    legacy_opts: bool = False,
    op: Any = None,
) -> Any:
    """Horovod's load_model: keras.models.load_model, with tf_adasum's optimizers registered.

    A file tf_keras (Keras 2) wrote (told from the file) is loaded by tf_keras, and its optimizer comes
    back as DistributedOptimizer(op=op) of the saved class, with the state tf_keras restores; `op`
    defaults to Average, Horovod's default (tf_keras calls no factory of `custom_objects` for its own
    optimizers, so `op=hvd.Adasum` is how to resume Adasum). `op` is for such files only: a Keras 3
    file brings its own optimizer back.

    A model saved with tf_adasum's DistributedOptimizer comes back with it. `custom_optimizers` (optimizer
    classes) are made known to the loader; `custom_objects` may map an optimizer's name to Horovod's
    factory idiom (`lambda **kwargs: hvd.DistributedOptimizer(MyOptimizer(**kwargs))`). `compression`
    (Compression.none, Horovod's default, or Compression.fp16) is set on the loaded tf_adasum optimizer.
    """
    unsupported("load_model", legacy_opts=(legacy_opts, False))
    check_compressor("load_model", compression)
    objects = dict(custom_objects or {})
    for cls in custom_optimizers or []:
        objects.setdefault(cls.__name__, cls)
    if saved_by_keras_2(filepath):
        return load_keras_2_model(filepath, objects, compression, Average if op is None else op)
    if op is not None:
        raise ValueError(
            f"load_model: op= is for files tf_keras (Keras 2) wrote; {filepath} is a Keras 3 file, whose "
            "optimizer comes back as it was saved"
        )
    model = _keras.models.load_model(filepath, custom_objects=objects)
    stepping = _compat.loss_scale_inner(getattr(model, "optimizer", None))
    if isinstance(stepping, WrappedOptimizer):
        stepping.compression = compression.name
    return model
