"""Keras state every process must share: weights broadcast, logs and BatchNorm averaged, batches agreed.

AdasumOptimizer, AdasumStrategy, the callbacks and the Horovod APIs all keep the processes' Keras state
in step through these: the same weights at the start (broadcast_variables), the same logs and
moving statistics after a step (average_logs, average_state_over_processes, reduce_over_processes),
and the same number of batches per epoch (check_equal_steps, agree_at_epoch_end).
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tf_adasum import _compat, distributed
from tf_adasum.algorithm import agreement
from tf_adasum.common.errors import UnevenDataError
from tf_adasum.common.variables import replica_values, tf_variable


def broadcast_variables(variables: Sequence[Any], root: int) -> None:
    """Assigns rank `root`'s values to `variables` on every process (a no-op in a world of one).

    Args:
        variables: Keras or TensorFlow variables, the same list on every process.
        root: the rank whose values everyone takes.
    """
    comm = distributed.init()
    variables = list(variables)
    if comm.size == 1 or not variables:
        return
    if not 0 <= root < comm.size:
        raise ValueError(f"root rank {root} is not a rank of this job of {comm.size} processes")
    values = distributed.broadcast([tf_variable(v) for v in variables], root=root)
    for variable, value in zip(variables, values, strict=True):
        variable.assign(value)


def _without(variables: Sequence[Any], local: Sequence[Any]) -> list[Any]:
    """`variables`, less those in `local` (a worker's own: Horovod's local variables), by identity."""
    mine = {id(tf_variable(v)) for v in local}
    return [v for v in variables if id(tf_variable(v)) not in mine]


def broadcast_model_and_optimizer(
    model: keras.Model, root: int, local: Sequence[Any] = (), state_per_process: bool = False
) -> None:
    """Every process takes rank `root`'s model variables, and its optimizer state where no other
    process has its own.

    Horovod broadcasts the optimizer state too, which is the same on every process when gradients are
    averaged before the optimizer. With Adasum after the optimizer each process's optimizer state is its
    own, and a run resumed from per-process checkpoints (BackupAndRestore) must keep it. So, by the
    optimizers' steps:
    - all at 0 (a fresh start): root's state is broadcast;
    - root's past 0 and every other at 0 (Horovod's resume: rank 0 loaded the checkpoint, the others
      built new models): root's state is broadcast, and every process resumes from it;
    - all at the same step: each keeps its own;
    - otherwise: ValueError.
    An optimizer Keras has not built yet (fit without a strategy builds it in the first step's trace)
    is built here first, so that every process has state to send or receive.

    Variables in `local` (Horovod's local_variables, each worker's own) are not broadcast.
    `state_per_process` says that each process's optimizer state is its own (Adasum after the
    optimizer): a resume from root's alone then warns on the others that theirs is root's now.

    Raises:
        ValueError: the processes' optimizers are at different steps, and not only root's is past 0.
    """
    broadcast_variables(_without(model.variables, local), root)
    optimizer = model.optimizer
    if optimizer is None:
        return
    _compat.build_optimizer(optimizer, model.trainable_variables)
    steps = agreement.gather_objects(
        distributed.init(), int(optimizer.iterations.numpy()), "optimizer step check"
    )
    others = steps[:root] + steps[root + 1 :]
    if not any(others):  # a fresh start or root's resume (the local variables' slots too, harmlessly)
        broadcast_variables(_compat.optimizer_variables(optimizer), root)
        if steps[root] and state_per_process and distributed.init().rank != root:
            warnings.warn(
                f"this process resumes from rank {root}'s checkpoint at step {steps[root]}, and its "
                f"optimizer state is now rank {root}'s: under Adasum each process's own was not saved "
                "there. For a bitwise resume save a checkpoint per rank (a path with hvd.rank() in it) "
                "and load each rank's own",
                stacklevel=2,
            )
    elif len(set(steps)) > 1:
        raise ValueError(
            f"the processes' optimizers are at different steps ({agreement.per_rank(steps)}): resume every "
            f"process from a checkpoint of the same step, or only rank {root} (the others then take its "
            "state)"
        )


def average_logs(logs: Any, weights: Sequence[float] | None = None) -> Any:
    """The mean over processes of every floating scalar in `logs`, in one collective.

    Works on Keras's logs both inside a compiled step (tensors) and between steps (Python floats or
    numpy scalars); other entries pass through. Returns logs of the same structure and types.
    `weights` (one per rank, summing to 1) weighs each process's value, where processes hold different
    numbers of replicas; None is the plain mean.
    """
    comm = distributed.init()
    if comm.size == 1:
        return logs
    flat = tf.nest.flatten(logs)
    index = [i for i, v in enumerate(flat) if _is_float_scalar(v)]
    if not index:
        return logs
    values = tf.stack([tf.cast(flat[i], tf.float64) for i in index])
    mean = _mean_over_processes(comm, values, weights)
    for j, i in enumerate(index):
        if isinstance(flat[i], tf.Tensor):
            flat[i] = tf.cast(mean[j], flat[i].dtype)
        else:
            flat[i] = type(flat[i])(mean[j].numpy())
    return tf.nest.pack_sequence_as(logs, flat)


def _mean_over_processes(comm: Any, values: Any, weights: Sequence[float] | None) -> Any:
    """The mean over processes of a tensor (or list of them), each process's weighed by
    weights[rank] where given."""
    if weights is None:
        return distributed.allreduce(values, op=distributed.Average)
    share = weights[comm.rank]
    scaled = tf.nest.map_structure(lambda v: v * tf.cast(share, v.dtype), values)
    return distributed.allreduce(scaled, op=distributed.Sum)


def reduce_over_processes(value: Any, mean: bool, weights: Sequence[float] | None = None) -> Any:
    """The sum over processes of a tensor (or a nest of them, in one collective per kind), or with
    `mean` its mean (each process's weighed by weights[rank] where given); floating dtypes are added
    in float64."""
    comm = distributed.init()
    if comm.size == 1:
        return value
    flat = tf.nest.flatten(value)
    wide = [tf.cast(v, tf.float64) if v.dtype.is_floating else v for v in flat]
    floats = [i for i, w in enumerate(wide) if w.dtype.is_floating]
    others = [i for i, w in enumerate(wide) if not w.dtype.is_floating]
    totals: list[Any] = [None] * len(wide)
    if floats:
        part = [wide[i] for i in floats]
        summed = (
            _mean_over_processes(comm, part, weights)
            if mean
            else distributed.allreduce(part, op=distributed.Sum)
        )
        for i, total in zip(floats, summed, strict=True):
            totals[i] = total
    if others:
        part = [wide[i] for i in others]
        summed = distributed.allreduce(part, op=distributed.Average if mean else distributed.Sum)
        for i, total in zip(others, summed, strict=True):
            totals[i] = total
    cast = [tf.cast(t, v.dtype) for t, v in zip(totals, flat, strict=True)]
    return tf.nest.pack_sequence_as(value, cast)


def average_state_over_processes(variables: Sequence[Any], weights: Sequence[float] | None = None) -> None:
    """Assigns to each floating variable, on every replica, its mean over every replica of every process
    (BatchNorm's moving statistics), each process's weighed by weights[rank] where given.

    AdasumStrategy runs this after every train step across processes, in cross-replica context, so
    that every process (and every replica) holds the same model. Within one process Keras 3 leaves
    these variables per replica under MirroredStrategy (aggregation NONE: each replica's moving
    statistics follow its own batches); across processes they are averaged here, which for an
    exponential moving average is the update by the mean of every replica's batch moments.
    """
    comm = distributed.init()
    state = [v for v in variables if v.dtype in ("float16", "bfloat16", "float32", "float64")]
    if not state or comm.size == 1:
        return

    def local_mean(variable: Any) -> tf.Tensor:
        parts = [tf.identity(part) for part in replica_values(variable)]
        return parts[0] if len(parts) == 1 else tf.reduce_mean(tf.stack(parts), axis=0)

    means = _mean_over_processes(comm, [local_mean(v) for v in state], weights)
    for variable, mean in zip(state, means, strict=True):
        variable.assign(mean)


def _is_float_scalar(value: Any) -> bool:
    if isinstance(value, tf.Tensor):
        return value.dtype.is_floating and value.shape.rank == 0
    return isinstance(value, (float, np.floating))


def check_equal_steps(params: dict[str, Any]) -> None:
    """Raises UnevenDataError on every process if `fit` will run different numbers of batches per epoch.

    Catches uneven shards before the first step when Keras knows the count (arrays, datasets of known
    size, or steps_per_epoch). Datasets of unknown size are checked at the end of each epoch.
    """
    comm = distributed.init()
    if comm.size == 1:
        return
    steps = agreement.gather_objects(comm, params.get("steps"), "steps-per-epoch check")
    if any(s is not None for s in steps) and len(set(steps)) > 1:
        raise UnevenDataError(
            f"the ranks would run different numbers of batches per epoch ({agreement.per_rank(steps)}): "
            f"{agreement.UNEVEN_DATA_ADVICE}"
        )


# The last epoch whose end each model's processes agreed on: several callbacks may ask, once counts.
_epochs_agreed: weakref.WeakKeyDictionary[keras.Model, int] = weakref.WeakKeyDictionary()


def forget_agreed_epochs(model: keras.Model) -> None:
    """A new fit counts its epochs from its initial epoch again."""
    _epochs_agreed.pop(model, None)


def agree_at_epoch_end(model: keras.Model, epoch: int, batches: int) -> None:
    """Every process checks that all ended this epoch after the same number of batches.

    A process that ran out of data meets the others' next model sync here, so every rank raises
    UnevenDataError instead of waiting for a peer that will never come.
    """
    comm = distributed.init()
    if comm.size == 1 or _epochs_agreed.get(model) == epoch:
        return
    _epochs_agreed[model] = epoch
    agreement.agree_at_epoch_end(comm, batches)
