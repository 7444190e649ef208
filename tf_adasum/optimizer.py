"""AdasumOptimizer: every replica steps on its own, then the model deltas are combined with Adasum.

This is the paper's "Adasum after the optimizer update" (arXiv 2006.02924, Figure 3):

1. Each replica runs the inner optimizer on its own gradient, with its own optimizer state. The inner
   optimizer's cross-replica gradient sum is switched off; Keras's own update path
   (`extended.update` with per-replica gradients) then steps each replica's copy of every variable
   and of every slot on its device, so momentum and Adam moments stay per replica.
2. Every `sync_every` steps the deltas since the last sync, `w_replica - w_anchor`, are combined with
   the contract tree over this process's replicas and, across processes, with tf_adasum.allreduce;
   every replica then holds `w_anchor + adasum(deltas)`, bitwise identical.

Under a strategy Keras scales each replica's loss by 1/N so that summed gradients average; the
gradients are multiplied back by N, so each local step is exactly a single-worker step on that
replica's batch.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from tf_adasum import distributed
from tf_adasum.tree import adasum_tree


def _tf_variable(variable: Any) -> Any:
    """The TensorFlow (possibly distributed) variable behind a Keras variable."""
    return variable.value if isinstance(variable, keras.Variable) else variable


def _local_values(distribution: tf.distribute.Strategy, variable: Any) -> list[Any]:
    """The per-replica components of a variable on this process (one for a plain variable)."""
    return list(distribution.experimental_local_results(_tf_variable(variable)))


@keras.saving.register_keras_serializable(package="tf_adasum")
class AdasumOptimizer(keras.optimizers.Optimizer):
    """Wraps a Keras optimizer so that replicas step locally and their deltas are combined with Adasum.

    Args:
        inner: any Keras 3 optimizer (SGD with momentum, Adam, AdamW, Lamb, ...). Its learning-rate
            schedule, clipping and weight decay apply in each local step.
        sync_every: how many local steps each replica takes between two Adasum combinations.
        name: optional name; default "adasum_<inner name>".

    Raises:
        TypeError: `inner` is not a Keras optimizer.
        ValueError: `sync_every` is not a positive integer, or `inner` is already an AdasumOptimizer.

    Example:
        >>> model.compile(optimizer=tf_adasum.AdasumOptimizer(keras.optimizers.Adam(1e-3)), loss=...)
    """

    def __init__(
        self, inner: keras.optimizers.Optimizer, sync_every: int = 1, name: str | None = None
    ) -> None:
        if isinstance(inner, AdasumOptimizer):
            raise ValueError("the inner optimizer is already an AdasumOptimizer")
        if not isinstance(inner, keras.optimizers.Optimizer):
            raise TypeError(
                f"AdasumOptimizer wraps a Keras optimizer (keras.optimizers.Adam(...), ...), got "
                f"{type(inner).__module__}.{type(inner).__name__}"
            )
        if not isinstance(sync_every, int) or isinstance(sync_every, bool) or sync_every < 1:
            raise ValueError(f"sync_every must be a positive integer, got {sync_every!r}")
        super().__init__(learning_rate=0.0, name=name or f"adasum_{inner.name}")
        self.inner = inner
        self.sync_every = sync_every
        # Each replica must step on its own gradient: no cross-replica sum inside the inner optimizer.
        inner._all_reduce_sum_gradients = lambda grads_and_vars: list(grads_and_vars)

    def build(self, var_list: list[Any]) -> None:
        current = tf.distribute.get_strategy()
        for optimizer in (self, self.inner):
            if optimizer._distribution_strategy is not current:
                raise ValueError(
                    f"optimizer {optimizer.name!r} was created under "
                    f"{type(optimizer._distribution_strategy).__name__} but is being built under "
                    f"{type(current).__name__}: create the model and its optimizer "
                    "inside the same strategy.scope()"
                )
        comm = distributed.init()
        if comm.size > 1 and var_list:
            # Every process starts from rank 0's weights, as MultiWorkerMirroredStrategy and Horovod's
            # broadcast callback arrange; otherwise each would keep its own random initialisation.
            start = distributed.broadcast([_tf_variable(v) for v in var_list], root=0)
            for variable, value in zip(var_list, start, strict=True):
                variable.assign(value)
        self.inner.build(var_list)
        # The weights as of the last sync; deltas are measured from here.
        self._anchors = [
            self.add_variable_from_reference(v, name="adasum_anchor", initializer=_value_of(v))
            for v in var_list
        ]
        super().build(var_list)

    @property
    def learning_rate(self) -> Any:
        return self.inner.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate: Any) -> None:
        self.inner.learning_rate = learning_rate

    @property
    def iterations(self) -> Any:
        return self.inner.iterations

    def scale_loss(self, loss: Any) -> Any:
        return self.inner.scale_loss(loss)

    def finalize_variable_values(self, var_list: list[Any]) -> None:
        self.inner.finalize_variable_values(var_list)

    def apply(self, grads: list[Any], trainable_variables: list[Any] | None = None) -> None:
        context = tf.distribute.get_replica_context()
        if context is None:
            raise ValueError(
                "AdasumOptimizer.apply must run in a replica context (model.fit or strategy.run)"
            )
        if not self.built:
            self.build(list(trainable_variables) if trainable_variables is not None else [])
        replicas = context.num_replicas_in_sync
        if replicas > 1:  # undo Keras's 1/N loss scaling: each local step is a single-worker step
            grads = [None if g is None else g * tf.cast(replicas, g.dtype) for g in grads]
        self.inner.apply(grads, trainable_variables)
        variables = (
            list(trainable_variables) if trainable_variables is not None else self.inner._trainable_variables
        )
        context.merge_call(self._sync_if_due, args=(variables,))

    def _sync_if_due(self, distribution: tf.distribute.Strategy, variables: list[Any]) -> None:
        # In cross-replica context: a cond here may contain the collectives of the sync.
        if self.sync_every == 1:
            self._sync(distribution, variables)
            return
        due = tf.equal(tf.math.floormod(self.inner.iterations, self.sync_every), 0)
        tf.cond(due, lambda: self._sync(distribution, variables), lambda: tf.constant(False))

    def _sync(self, distribution: tf.distribute.Strategy, variables: list[Any]) -> tf.Tensor:
        anchors = [self._anchors[self._get_variable_index(v)] for v in variables]
        per_variable = [_local_values(distribution, v) for v in variables]
        anchor_values = [_local_values(distribution, a)[0] for a in anchors]
        replicas = len(per_variable[0]) if per_variable else 0
        per_replica = [
            [
                tf.identity(values[r]) - anchor
                for values, anchor in zip(per_variable, anchor_values, strict=True)
            ]
            for r in range(replicas)
        ]
        delta = adasum_tree(per_replica) if replicas > 1 else per_replica[0]
        comm = distributed.init()
        if comm.size > 1:
            delta = distributed.allreduce(delta, op=distributed.Adasum)
        for variable, anchor, anchor_value, d in zip(variables, anchors, anchor_values, delta, strict=True):
            synced = anchor_value + d
            for target in (variable, anchor):
                distribution.extended.update(
                    _tf_variable(target), lambda var, new: var.assign(new), args=(synced,), group=False
                )
        return tf.constant(True)

    def get_config(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "inner": keras.saving.serialize_keras_object(self.inner),
            "sync_every": self.sync_every,
        }

    @classmethod
    def from_config(cls, config: dict[str, Any], custom_objects: Any = None) -> AdasumOptimizer:
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(config.pop("inner"), custom_objects=custom_objects)
        return cls(inner, **config)


def _value_of(variable: Any) -> Any:
    """An initializer that copies the variable's current value."""

    def initializer(shape: Any, dtype: Any) -> Any:
        return tf.cast(tf.identity(_tf_variable(variable)), dtype)

    return initializer
