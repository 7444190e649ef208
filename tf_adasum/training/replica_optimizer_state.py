"""Every local replica's copy of an AdasumOptimizer's inner optimizer state, in checkpoints.

Under a strategy with several local replicas, each replica steps with its own optimizer state (momentum,
Adam moments), kept in the components of mirrored variables. Keras and tf.train.Checkpoint save a
mirrored variable's first component and restore it to all, which would give every replica replica 0's
state on resume. ReplicaState saves them all, stacked, and puts each back where it was; Keras's own
saving reaches it through AdasumOptimizer.save_own_variables, tf.train.Checkpoint through
checkpoint_node.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import tensorflow as tf

from tf_adasum import _compat
from tf_adasum.common.variables import replica_values


class ReplicaState:
    """Every local replica's copy of the inner optimizer's state, for checkpoints.

    Under a strategy with several local replicas, each replica steps with its own optimizer state
    (momentum, Adam moments), kept in the components of mirrored variables. Keras and tf.train.Checkpoint
    save a mirrored variable's first component and restore it to all, which would give every replica
    replica 0's state on resume. This object saves them all, stacked, and puts each back where it was.
    Restored into a different number of replicas, every replica keeps replica 0's state, with a warning.
    """

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer
        self.pending: list[np.ndarray] | None = None

    def gather(self) -> list[np.ndarray]:
        return [
            np.stack([c.numpy() for c in replica_values(v)]) for v in self.optimizer.inner_optimizer.variables
        ]

    def spread(self, stacked: list[np.ndarray]) -> None:
        """Puts each replica's saved state back; before the optimizer is built, once it is."""
        inner = self.optimizer.inner_optimizer
        if not inner.built:  # tf.train.Checkpoint restores into optimizers that are built later
            self.pending = stacked
            return
        variables = inner.variables
        if len(stacked) != len(variables):
            warnings.warn(
                f"the checkpoint holds {len(stacked)} per-replica optimizer variables but {inner.name!r} "
                f"has {len(variables)}; every replica keeps the restored values",
                stacklevel=2,
            )
            return
        saved, here = len(stacked[0]) if stacked else 0, len(replica_values(variables[0])) if variables else 0
        if saved != here:
            warnings.warn(
                f"the checkpoint holds the optimizer state of {saved} replicas but this strategy has {here}: "
                "every replica starts from replica 0's state",
                stacklevel=2,
            )
            return
        for variable, values in zip(variables, stacked, strict=True):
            for component, value in zip(replica_values(variable), values, strict=True):
                component.assign(value)

    def checkpoint_node(self) -> Any:
        """This state as a node of tf.train.Checkpoint's object graph: one string tensor, each of its
        elements one inner variable's replicas, stacked, as a serialized tensor.

        Tensors, not Python state, so that tf.saved_model.save, which traces the save, can write it;
        SavedModels leave it out (they load as generic objects, without replicas). It must be restored
        after the inner optimizer's own variables: the restore of a mirrored variable puts its first
        replica's value into every replica, and this must come after it. TensorFlow restores an object
        graph breadth first, so the node hangs three levels down a chain of empty nodes: deeper than the
        inner optimizer's variables (optimizer/inner_optimizer/_variables/N), whether the chain hangs
        from the AdasumOptimizer or from the plain optimizer it wraps (strategy.adasum_optimizer_for).
        """
        node = _compat.tensors_checkpoint(self._save_tensors, self._restore_tensors)
        for _ in range(3):
            node = _compat.checkpoints_only(node, "then")
        return node

    _KEY = "per_replica"

    def _save_tensors(self) -> dict[str, tf.Tensor]:
        stacked = [
            tf.io.serialize_tensor(tf.stack([tf.identity(c) for c in replica_values(v)]))
            for v in self.optimizer.inner_optimizer.variables
        ]
        return {self._KEY: tf.stack(stacked) if stacked else tf.constant([], tf.string)}

    def _restore_tensors(self, restored: dict[str, tf.Tensor]) -> Any:
        if not tf.executing_eagerly():  # a restore traced into a graph: nothing to spread from here
            warnings.warn(
                "tf_adasum: a graph-mode restore cannot spread every replica's optimizer state; every "
                "replica keeps replica 0's",
                stacklevel=2,
            )
            return tf.no_op()
        self.spread([_compat.parse_tensor(p) for p in restored[self._KEY].numpy().tolist()])
        return None
