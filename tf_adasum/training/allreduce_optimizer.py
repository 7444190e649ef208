"""AllreduceOptimizer: Horovod's gradient all-reduce before the optimizer steps (op=Average or Sum).

tf_adasum.keras.DistributedOptimizer and tf_adasum.tensorflow.DistributedOptimizer return it for
op=Average and op=Sum; with op=Adasum they return an AdasumOptimizer instead, which combines the updates
after the optimizer.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from tf_adasum import _compat, distributed
from tf_adasum.algorithm import agreement
from tf_adasum.algorithm.compression import check_compression
from tf_adasum.algorithm.tensor_lists import dense
from tf_adasum.common.variables import variable_name
from tf_adasum.training import model_sync, optimizer_options
from tf_adasum.training.optimizer import WrappedOptimizer


@keras.saving.register_keras_serializable(package="tf_adasum")
class AllreduceOptimizer(WrappedOptimizer):
    """Sums or averages the gradients over processes before the inner optimizer steps, as Horovod does.

    This is what `tf_adasum.keras.DistributedOptimizer(op=Average)` (or `op=Sum`) returns: one process
    per worker, no tf.distribute strategy. For Adasum use AdasumOptimizer, which combines the updates
    after the optimizer instead.

    Args:
        inner: any Keras 3 optimizer.
        op: tf_adasum.Average or tf_adasum.Sum.
        name: optional name; default "allreduce_<inner name>".
        compression: "none", or "fp16" ("bf16") to send float32/float64 gradients as float16
            (bfloat16).
        backward_passes_per_step: Horovod's gradient accumulation: each process sums its gradients
            over this many steps, then they are all-reduced once and the inner optimizer steps; in
            between the weights stay as they are and only the iteration count moves, as in Horovod.
        average_aggregated_gradients: divide the accumulated gradients by backward_passes_per_step
            (Horovod's flag; its default, False, applies their sum).
        groups: Horovod's grouping of the all-reduce: a number of groups, or a list of lists of
            variables; each group is one fused call, so that in a traced step each starts as soon as its
            gradients exist (tf_adasum.distributed.gradient_groups). None: one call, or buckets of
            $TF_ADASUM_BUCKET_MB in a traced step. A saved optimizer keeps an integer `groups` only.
    """

    def __init__(
        self,
        inner: keras.optimizers.Optimizer,
        op: Any = distributed.Average,
        name: str | None = None,
        compression: str = "none",
        backward_passes_per_step: int = 1,
        average_aggregated_gradients: bool = False,
        scale_local_gradients: bool = True,
        groups: Any = None,
    ) -> None:
        op = distributed.ReduceOp(op)
        # Mixed precision's skip decision must be global: one rank skipping would average other steps.
        _compat.require("LossScaleOptimizer.check_finite")
        if op is distributed.Adasum:
            raise ValueError("AllreduceOptimizer sums or averages gradients; for Adasum use AdasumOptimizer")
        super().__init__(inner, name=name or f"allreduce_{getattr(inner, 'name', 'optimizer')}")
        self.op = op
        self.compression = check_compression(compression)
        self.backward_passes_per_step = model_sync.check_positive_integer(
            "backward_passes_per_step", backward_passes_per_step
        )
        accumulation = getattr(inner, "gradient_accumulation_steps", None)
        if self.backward_passes_per_step > 1 and accumulation:
            raise ValueError(
                f"AllreduceOptimizer(backward_passes_per_step={self.backward_passes_per_step}) accumulates "
                f"the gradients itself, and optimizer {inner.name!r} has gradient_accumulation_steps="
                f"{accumulation} too: use one of the two"
            )
        self.average_aggregated_gradients = bool(average_aggregated_gradients)
        self.scale_local_gradients = bool(scale_local_gradients)
        self.groups = groups
        distributed.gradient_groups([], [], groups, "AllreduceOptimizer")  # the argument's checks, now

    def build(self, var_list: list[Any]) -> None:
        self.inner_optimizer.build(var_list)
        # Each process's gradients summed since the last all-reduce (backward_passes_per_step > 1).
        self._accumulated = (
            [self.add_variable_from_reference(v, name="accumulated_gradient") for v in var_list]
            if self.backward_passes_per_step > 1
            else []
        )
        super().build(var_list)

    def apply(self, grads: list[Any], trainable_variables: list[Any] | None = None) -> None:
        context = tf.distribute.get_replica_context()
        if context is not None and context.num_replicas_in_sync > 1:
            raise ValueError(
                f"AllreduceOptimizer runs one replica per process, but this step has "
                f"{context.num_replicas_in_sync} replicas: start one process per device instead of a "
                "tf.distribute strategy"
            )
        if self.backward_passes_per_step > 1:
            self._accumulate_then_apply(grads, trainable_variables)
            return
        self._reduce_then_apply(grads, trainable_variables)

    def _reduce_then_apply(self, grads: list[Any], trainable_variables: list[Any] | None) -> None:
        comm = distributed.init()
        if comm.size > 1:
            # A rank that ran out of data meets this sync at its epoch end: both raise, neither waits.
            checked = agreement.agree(comm, agreement.SYNC, -1, "gradient allreduce")
            with tf.control_dependencies([checked]):
                grads = [None if g is None else tf.identity(dense(g)) for g in grads]
            variables = list(trainable_variables) if trainable_variables is not None else None
            local = [variables is not None and self.is_local(v) for v in (variables or [None] * len(grads))]
            present = [i for i, g in enumerate(grads) if g is not None and not local[i]]
            names = [variable_name(variables[i]) for i in present] if variables is not None else []
            groups = distributed.gradient_groups(
                [grads[i] for i in present],
                [variables[i] for i in present] if variables is not None else None,
                self.groups,
                "AllreduceOptimizer",
            )
            reduced = distributed.allreduce_grouped(
                [grads[i] for i in present], self.op, self.compression, names, groups
            )
            grads = list(grads)
            for i, g in zip(present, reduced, strict=True):
                grads[i] = g
            if self.scale_local_gradients:  # Horovod's: a local gradient divided by the number of workers
                grads = [g / comm.size if g is not None and local[i] else g for i, g in enumerate(grads)]
        with self._stepping():
            self.inner_optimizer.apply(grads, trainable_variables)

    def _accumulate_then_apply(self, grads: list[Any], trainable_variables: list[Any] | None) -> None:
        """Horovod's LocalGradientAggregationHelper: the gradients are summed into the accumulators;
        every backward_passes_per_step-th pass they are all-reduced once (divided by the count with
        average_aggregated_gradients), the inner optimizer steps on them and they are cleared; on the
        other passes only the iteration count moves."""
        if not self.built:
            with tf.init_scope():
                self.build(list(trainable_variables or []))
        variables = (
            list(trainable_variables)
            if trainable_variables is not None
            else _compat.trainable_variables_of(self)
        )
        optimizer_options.accumulate_then_step(
            [self._accumulated[_compat.variable_index(self, v)] for v in variables],
            grads,
            self.inner_optimizer.iterations,
            self.backward_passes_per_step,
            self.average_aggregated_gradients,
            lambda summed: self._reduce_then_apply(summed, variables),
        )

    def get_config(self) -> dict[str, Any]:
        return {
            **self._config(),
            "op": self.op.value,
            "compression": self.compression,
            "backward_passes_per_step": self.backward_passes_per_step,
            "average_aggregated_gradients": self.average_aggregated_gradients,
            "scale_local_gradients": self.scale_local_gradients,
            "groups": self.groups if isinstance(self.groups, int) else None,
        }
