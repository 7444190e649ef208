"""Horovod's DistributedOptimizer for a tf_keras (Keras 2) optimizer, one process per worker.

As Horovod does for Keras 2, the result is an optimizer of a subclass of the given optimizer's own class,
made from its config, so that `model.compile`, checkpoints and callbacks see the optimizer they know. Its
apply_gradients:

- op=Adasum: the paper's Adasum after the optimizer, as under Keras 3. The optimizer steps on this
  process's gradients with its own state (momentum, Adam's moments), then the step's deltas,
  `w_after - w_before`, are combined with the contract tree over every process, and every process holds
  `w_before + adasum(deltas)`.
- op=Average or Sum: the gradients are all-reduced before the optimizer, as Horovod does.

A non-finite update raises NonFiniteUpdateError on every process (the agreement before Adasum).
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from tf_adasum import distributed
from tf_adasum._horovod.mpi_ops import grouped_allreduce
from tf_adasum.distributed import Adasum, Average, Sum


def _step_then_adasum(self: Any, grads_and_vars: Any, *args: Any, **kwargs: Any) -> Any:
    pairs = list(grads_and_vars)
    synced = [v for g, v in pairs if g is not None]
    before = [tf.identity(v) for v in synced]  # read before the step: tf.function keeps program order
    iteration = super(type(self), self).apply_gradients(pairs, *args, **kwargs)
    deltas = [v - b for v, b in zip(synced, before, strict=True)]
    if deltas:
        combined = grouped_allreduce(deltas, op=Adasum, compression=self._tf_adasum_compression)
        for variable, start, delta in zip(synced, before, combined, strict=True):
            variable.assign(start + delta)
    return iteration


def _allreduce_then_step(self: Any, grads_and_vars: Any, *args: Any, **kwargs: Any) -> Any:
    pairs = list(grads_and_vars)
    present = [i for i, (g, _) in enumerate(pairs) if g is not None]
    if present:
        op = self._tf_adasum_op
        reduced = grouped_allreduce(
            [pairs[i][0] for i in present], op=op, compression=self._tf_adasum_compression
        )
        for i, g in zip(present, reduced, strict=True):
            pairs[i] = (g, pairs[i][1])
    return super(type(self), self).apply_gradients(pairs, *args, **kwargs)


def _register_local_var(self: Any, var: Any) -> None:
    raise NotImplementedError(
        "register_local_var on a tf_keras (Keras 2) optimizer: local variables are served under Keras 3 "
        "(keras.optimizers.*); with tf_keras every variable is combined"
    )


def keras_2_distributed_optimizer(
    optimizer: Any, op: distributed.ReduceOp, compression: Any, name: str | None
) -> Any:
    """`optimizer` (a tf_keras optimizer) remade as one whose apply_gradients runs Adasum after the step
    (op=Adasum) or all-reduces the gradients before it (Average, Sum)."""
    if op not in (Adasum, Average, Sum):
        raise ValueError(f"DistributedOptimizer: op must be Adasum, Average or Sum, got {op}")
    cls = type(optimizer)
    apply = _step_then_adasum if op is Adasum else _allreduce_then_step
    distributed_class: Any = type(
        cls.__name__,
        (cls,),
        {
            "apply_gradients": apply,
            "register_local_var": _register_local_var,
            # BroadcastGlobalVariablesCallback: each process's optimizer state is its own under Adasum.
            "_tf_adasum_state_per_process": op is Adasum,
            "__module__": cls.__module__,
        },
    )
    config = optimizer.get_config()
    if name is not None:
        config["name"] = name
    distributed_optimizer = distributed_class.from_config(config)
    distributed_optimizer._tf_adasum_op = op
    distributed_optimizer._tf_adasum_compression = compression
    return distributed_optimizer
