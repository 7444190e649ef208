"""AdasumOptimizer: every replica steps on its own, then the model deltas are combined with Adasum.

This is the paper's "Adasum after the optimizer update" (arXiv 2006.02924, Figure 3):

1. Each replica runs the inner optimizer on its own gradient, with its own optimizer state. The inner
   optimizer's cross-replica gradient sum is switched off; Keras's own update path
   (`extended.update` with per-replica gradients) then steps each replica's copy of every variable
   and of every slot on its device, so momentum and Adam moments stay per replica.
2. Every `sync_every` steps the deltas since the last sync, `w_replica - w_anchor`, are combined with
   the contract tree over every replica of every process (distributed.allreduce_replicas); every
   replica then holds `w_anchor + adasum(deltas)`, bitwise identical.

Under a strategy Keras scales each replica's loss by 1/N so that summed gradients average; the
gradients are multiplied back by N, so each local step is exactly a single-worker step on that
replica's batch.
"""

from __future__ import annotations

import io
import warnings
import weakref
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from keras.optimizers import LossScaleOptimizer

from tf_adasum import _compat, agreement, distributed
from tf_adasum.callbacks import broadcast_variables, syncs_in_apply, tf_variable
from tf_adasum.tree import squared_norms

COMPRESSIONS = ("none", "fp16")


def _local_values(distribution: tf.distribute.Strategy, variable: Any) -> list[Any]:
    """The per-replica components of a variable on this process (one for a plain variable)."""
    return list(distribution.experimental_local_results(tf_variable(variable)))


def _dense(gradient: Any) -> Any:
    """Keras 3 under TensorFlow gives embeddings IndexedSlices gradients; every reduction here is dense."""
    return tf.convert_to_tensor(gradient) if isinstance(gradient, tf.IndexedSlices) else gradient


def positive_integer(name: str, value: Any) -> int:
    """Returns value if it is a positive int (not a bool), else raises ValueError naming it."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def check_sync_every(sync_every: Any) -> int:
    """The one check of `sync_every` for AdasumOptimizer, AdasumStrategy and AdasumCallback."""
    return positive_integer("sync_every", sync_every)


def _check_compression(compression: str) -> str:
    if compression not in COMPRESSIONS:
        raise ValueError(f"compression must be one of {COMPRESSIONS}, got {compression!r}")
    return compression


class SyncStats:
    """Per variable, at the last sync: the sum over every replica of |d_i|^2, and |adasum(d_1..d_n)|^2.

    Their ratio is the orthogonality OrthogonalityMonitor reports: 1 when the replicas' updates were
    orthogonal (Adasum adds them), 1/n when they were equal (Adasum returns one of them). Recorded only
    while a monitor asks (enable_sync_stats), at the cost of one norm pass over each delta and over the
    result, and across processes one all-reduce of one float64 per variable; the updates are not
    reduced a second time.
    """

    def __init__(self, variables: list[Any]) -> None:
        n = len(variables)
        self.names = [getattr(v, "path", None) or v.name for v in variables]
        # Created under the model's strategy: assigned once per sync, in cross-replica context.
        self.deltas_sq = tf.Variable(tf.zeros([n], tf.float64), trainable=False, name="adasum_deltas_sq")
        self.combined_sq = tf.Variable(tf.zeros([n], tf.float64), trainable=False, name="adasum_combined_sq")
        self.syncs = tf.Variable(tf.constant(0, tf.int64), trainable=False, name="adasum_syncs")

    def record(self, deltas_sq: tf.Tensor, combined_sq: tf.Tensor) -> None:
        self.deltas_sq.assign(deltas_sq)
        self.combined_sq.assign(combined_sq)
        self.syncs.assign_add(1)


_STATS: weakref.WeakKeyDictionary[Any, SyncStats] = weakref.WeakKeyDictionary()


def enable_sync_stats(optimizer: Any, stats: SyncStats | None) -> None:
    """Makes the syncs of `optimizer` (an AdasumOptimizer, or one AdasumCallback extends) record stats.

    Takes effect in train functions traced from now on; None stops the recording.
    """
    if stats is None:
        _STATS.pop(optimizer, None)
    else:
        _STATS[optimizer] = stats


def sync_stats(optimizer: Any) -> SyncStats | None:
    return _STATS.get(optimizer)


def sync_deltas(
    distribution: tf.distribute.Strategy,
    variables: list[Any],
    anchors: list[Any],
    compression: str = "none",
    stats: SyncStats | None = None,
) -> tf.Tensor:
    """Replaces every replica's weights by `anchor + Adasum(w_replica - anchor)`, and moves the anchors.

    The deltas since the last sync are combined with the contract tree over every replica of every
    process (distributed.allreduce_replicas); every replica and every process then holds the same
    weights, bitwise. Runs in cross-replica context (or with no strategy). With `stats`, also
    records the squared norms OrthogonalityMonitor reads.
    """
    per_variable = [_local_values(distribution, v) for v in variables]
    anchor_values = [_local_values(distribution, a)[0] for a in anchors]
    replicas = len(per_variable[0]) if per_variable else 0
    per_replica = [
        [tf.identity(values[r]) - anchor for values, anchor in zip(per_variable, anchor_values, strict=True)]
        for r in range(replicas)
    ]
    names = [getattr(v, "path", None) or v.name for v in variables]
    delta = distributed.allreduce_replicas(per_replica, names, compression)
    deltas_sq = tf.add_n([squared_norms(d) for d in per_replica]) if stats is not None else None
    if distributed.init().size > 1:
        if deltas_sq is not None:
            deltas_sq = distributed.allreduce(deltas_sq, op=distributed.Sum)
    if stats is not None:
        stats.record(deltas_sq, squared_norms(delta))
    for variable, anchor, anchor_value, d in zip(variables, anchors, anchor_values, delta, strict=True):
        synced = anchor_value + d
        for target in (variable, anchor):
            distribution.extended.update(
                tf_variable(target), lambda var, new: var.assign(new), args=(synced,), group=False
            )
    return tf.constant(True)


def sync_if_due(
    distribution: tf.distribute.Strategy,
    variables: list[Any],
    anchors: list[Any],
    iterations: Any,
    sync_every: int,
    compression: str = "none",
    stats: SyncStats | None = None,
) -> None:
    """sync_deltas after every `sync_every`-th optimizer step (`iterations`, already incremented)."""
    # In cross-replica context: a cond here may contain the collectives of the sync.
    if sync_every == 1:
        sync_deltas(distribution, variables, anchors, compression, stats)
        return
    due = tf.equal(tf.math.floormod(iterations, sync_every), 0)
    tf.cond(
        due,
        lambda: sync_deltas(distribution, variables, anchors, compression, stats),
        lambda: tf.constant(False),
    )


def finite_everywhere(finite: tf.Tensor) -> tf.Tensor:
    """True when the gradients were finite on every replica of every process (a boolean scalar).

    Mixed precision's LossScaleOptimizer asks this (see _compat.install_global_loss_scale_finiteness)
    when it wraps a tf_adasum optimizer, whose replicas keep their own gradients: a step is skipped
    everywhere, and the loss scale halved everywhere, when any replica overflowed. Across processes
    the answer travels in the agreement collective (kind LOSS_SCALE), so a rank that has ended its
    epoch meets it and both raise UnevenDataError instead of waiting.
    """
    finite = tf.convert_to_tensor(finite)
    context = tf.distribute.get_replica_context()
    if context is not None and context.num_replicas_in_sync > 1:
        overflowed = context.all_reduce(
            tf.distribute.ReduceOp.SUM, tf.cast(tf.logical_not(finite), tf.float32)
        )
        finite = tf.equal(overflowed, 0.0)
    comm = distributed.init()
    if comm.size == 1:
        return finite
    # (LOSS_SCALE, 1) marks this rank's overflow; (LOSS_SCALE, 0) its finite gradients.
    code = tf.where(finite, tf.constant(0, tf.int64), tf.constant(1, tf.int64))
    table = agreement.agree(comm, agreement.LOSS_SCALE, code, "mixed-precision finiteness check")
    return tf.reduce_all(tf.equal(table[:, 1], 0))


class WrappedOptimizer(keras.optimizers.Optimizer):
    """What AdasumOptimizer and AllreduceOptimizer share: an inner Keras optimizer that does the steps.

    The learning rate, the iteration count, loss scaling and finalisation are the inner optimizer's,
    so schedules and callbacks that read or set them see the optimizer the user configured.
    """

    def __init__(self, inner: keras.optimizers.Optimizer, name: str) -> None:
        if isinstance(inner, WrappedOptimizer):
            raise ValueError(f"the inner optimizer is already a {type(inner).__name__}")
        if not isinstance(inner, keras.optimizers.Optimizer):
            raise TypeError(
                f"{type(self).__name__} wraps a Keras optimizer (keras.optimizers.Adam(...), ...), got "
                f"{type(inner).__module__}.{type(inner).__name__}"
            )
        if isinstance(inner, LossScaleOptimizer):
            raise ValueError(
                f"{type(self).__name__} wraps the optimizer that steps, and LossScaleOptimizer wraps it: "
                f"LossScaleOptimizer({type(self).__name__}(optimizer)). Under the mixed_float16 policy "
                "compile() does that for you: pass the plain optimizer"
            )
        _compat.require_tensorflow_backend(type(self).__name__)
        super().__init__(learning_rate=0.0, name=name)
        self.inner_optimizer = inner
        # tf.train.Checkpoint names children by attribute; checkpoints from before the rename say "inner".
        self._track_trackable(inner, name="inner", overwrite=True)

    @property
    def inner(self) -> keras.optimizers.Optimizer:
        """The wrapped optimizer (an alias of inner_optimizer, as in Keras's LossScaleOptimizer)."""
        return self.inner_optimizer

    @property
    def variables(self) -> list[Any]:
        """This optimizer's own variables, then the inner optimizer's, as LossScaleOptimizer has them."""
        return self._variables + self.inner_optimizer.variables

    @property
    def learning_rate(self) -> Any:
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate: Any) -> None:
        self.inner_optimizer.learning_rate = learning_rate

    @property
    def iterations(self) -> Any:
        return self.inner_optimizer.iterations

    def scale_loss(self, loss: Any) -> Any:
        return self.inner_optimizer.scale_loss(loss)

    def finalize_variable_values(self, var_list: list[Any]) -> None:
        self.inner_optimizer.finalize_variable_values(var_list)

    def load_own_variables(self, store: Any) -> None:
        own = len(self._variables)
        if len(store.keys()) == own != len(self.variables):
            # Saved before `variables` listed the inner optimizer's too: this optimizer's own only.
            for i, variable in enumerate(self._variables):
                variable.assign(store[str(i)])
            return
        super().load_own_variables(store)

    def _config(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
        }

    @classmethod
    def from_config(cls, config: dict[str, Any], custom_objects: Any = None) -> Any:
        config = dict(config)
        serialized = config.pop("inner_optimizer") if "inner_optimizer" in config else config.pop("inner")
        inner = keras.saving.deserialize_keras_object(serialized, custom_objects=custom_objects)
        return cls(inner, **config)


def _components(variable: Any) -> tuple[Any, ...]:
    """Every local replica's copy of a variable (one for a plain variable)."""
    value = tf_variable(variable)
    return tuple(getattr(value, "values", (value,)))


class ReplicaState:
    """Every local replica's copy of the inner optimizer's state, for checkpoints.

    Under a strategy with several local replicas, each replica steps with its own optimizer state
    (momentum, Adam moments), kept in the components of mirrored variables. Keras and tf.train.Checkpoint
    save a mirrored variable's first component and restore it to all, which would give every replica
    replica 0's state on resume. This object saves them all, stacked, and puts each back where it was.
    Restored into a different number of replicas, every replica keeps replica 0's state, with a warning.
    """

    def __init__(self, optimizer: AdasumOptimizer) -> None:
        self.optimizer = optimizer
        self.pending: list[np.ndarray] | None = None

    def gather(self) -> list[np.ndarray]:
        return [
            np.stack([c.numpy() for c in _components(v)]) for v in self.optimizer.inner_optimizer.variables
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
        saved, here = len(stacked[0]) if stacked else 0, len(_components(variables[0])) if variables else 0
        if saved != here:
            warnings.warn(
                f"the checkpoint holds the optimizer state of {saved} replicas but this strategy has {here}: "
                "every replica starts from replica 0's state",
                stacklevel=2,
            )
            return
        for variable, values in zip(variables, stacked, strict=True):
            for component, value in zip(_components(variable), values, strict=True):
                component.assign(value)


class _ReplicaStateCheckpoint(tf.train.experimental.PythonState):
    """ReplicaState for tf.train.Checkpoint: one string of all replicas' state."""

    def __init__(self, state: ReplicaState) -> None:
        self._state = state

    def serialize(self) -> bytes:
        buffer = io.BytesIO()
        np.savez(buffer, *self._state.gather())
        return buffer.getvalue()

    def deserialize(self, string_value: bytes) -> None:
        with np.load(io.BytesIO(string_value)) as arrays:
            self._state.spread([arrays[f"arr_{i}"] for i in range(len(arrays.files))])


@keras.saving.register_keras_serializable(package="tf_adasum")
class AdasumOptimizer(WrappedOptimizer):
    """Wraps a Keras optimizer so that replicas step locally and their deltas are combined with Adasum.

    Args:
        inner: any Keras 3 optimizer (SGD with momentum, Adam, AdamW, Lamb, ...). Its learning-rate
            schedule, clipping and weight decay apply in each local step.
        sync_every: how many local steps each replica takes between two Adasum combinations.
        name: optional name; default "adasum_<inner name>".
        root: across processes, the rank whose initial weights every process starts from.
        compression: "none", or "fp16" to send float32/float64 deltas across processes as float16.

    Raises:
        TypeError: `inner` is not a Keras optimizer.
        ValueError: `sync_every` is not a positive integer, or `inner` is already wrapped.

    Example:
        >>> model.compile(optimizer=tf_adasum.AdasumOptimizer(keras.optimizers.Adam(1e-3)), loss=...)
    """

    def __init__(
        self,
        inner: keras.optimizers.Optimizer,
        sync_every: int = 1,
        name: str | None = None,
        root: int = 0,
        compression: str = "none",
    ) -> None:
        if isinstance(inner, AdasumOptimizer):
            raise ValueError("the inner optimizer is already an AdasumOptimizer")
        _compat.require()
        super().__init__(inner, name=name or f"adasum_{getattr(inner, 'name', 'optimizer')}")
        self.sync_every = check_sync_every(sync_every)
        self.root = root
        self.compression = _check_compression(compression)
        # Each replica must step on its own gradient: no cross-replica sum inside the inner optimizer.
        _compat.disable_gradient_sum(inner)
        self._replica_state = ReplicaState(self)
        # tf.train.Checkpoint saves this child with the optimizer: every replica's state, not the first.
        self.replica_state = _ReplicaStateCheckpoint(self._replica_state)

    def build(self, var_list: list[Any]) -> None:
        current = tf.distribute.get_strategy()
        for optimizer in (self, self.inner_optimizer):
            created_under = _compat.strategy_of(optimizer)
            if created_under is not current:
                raise ValueError(
                    f"optimizer {optimizer.name!r} was created under "
                    f"{type(created_under).__name__} but is being built under "
                    f"{type(current).__name__}: create the model and its optimizer "
                    "inside the same strategy.scope()"
                )
        # Every process starts from root's weights, as MultiWorkerMirroredStrategy and Horovod's
        # broadcast callback arrange; otherwise each would keep its own random initialisation.
        broadcast_variables(var_list, self.root)
        self.inner_optimizer.build(var_list)  # restores deferred by tf.train.Checkpoint happen in here
        if self._replica_state.pending is not None:
            stacked, self._replica_state.pending = self._replica_state.pending, None
            self._replica_state.spread(stacked)
        # The weights as of the last sync; deltas are measured from here.
        self._anchors = [
            self.add_variable_from_reference(v, name="adasum_anchor", initializer=_value_of(v))
            for v in var_list
        ]
        super().build(var_list)

    def apply(self, grads: list[Any], trainable_variables: list[Any] | None = None) -> None:
        context = tf.distribute.get_replica_context()
        if context is None:
            raise ValueError(
                "AdasumOptimizer.apply must run in a replica context (model.fit or strategy.run)"
            )
        if not self.built:
            self.build(list(trainable_variables) if trainable_variables is not None else [])
        replicas = context.num_replicas_in_sync
        grads = [None if g is None else _dense(g) for g in grads]
        if replicas > 1:  # undo Keras's 1/N loss scaling: each local step is a single-worker step
            grads = [None if g is None else g * tf.cast(replicas, g.dtype) for g in grads]
        self.inner_optimizer.apply(grads, trainable_variables)
        variables = (
            list(trainable_variables) if trainable_variables is not None else self._trainable_variables
        )
        anchors = [self._anchors[self._get_variable_index(v)] for v in variables]
        context.merge_call(
            sync_if_due,
            args=(
                variables,
                anchors,
                self.inner_optimizer.iterations,
                self.sync_every,
                self.compression,
                sync_stats(self),
            ),
        )

    _REPLICA_KEY = "replicas_of_inner_"

    def save_own_variables(self, store: Any) -> None:
        super().save_own_variables(store)
        for i, stacked in enumerate(self._replica_state.gather()):
            store[f"{self._REPLICA_KEY}{i}"] = stacked

    def load_own_variables(self, store: Any) -> None:
        keys = list(store.keys())
        own = {k: store[k] for k in keys if not k.startswith(self._REPLICA_KEY)}
        count = len(keys) - len(own)
        super().load_own_variables(own)
        if not count:
            return
        stacked = [np.asarray(store[f"{self._REPLICA_KEY}{i}"]) for i in range(count)]
        # Keras loads this optimizer's variables before those of its child, the inner optimizer, which
        # would then put its first replica's values into every replica: spread them after that load.
        inner, load_inner = self.inner_optimizer, type(self.inner_optimizer).load_own_variables

        def load_then_spread(inner_store: Any) -> None:
            del inner.load_own_variables
            load_inner(inner, inner_store)
            self._replica_state.spread(stacked)

        inner.load_own_variables = load_then_spread

    def get_config(self) -> dict[str, Any]:
        return {
            **self._config(),
            "sync_every": self.sync_every,
            "root": self.root,
            "compression": self.compression,
        }


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
        compression: "none", or "fp16" to send float32/float64 gradients as float16.
    """

    def __init__(
        self,
        inner: keras.optimizers.Optimizer,
        op: Any = distributed.Average,
        name: str | None = None,
        compression: str = "none",
    ) -> None:
        op = distributed.ReduceOp(op)
        # Mixed precision's skip decision must be global: one rank skipping would average other steps.
        _compat.require("LossScaleOptimizer.check_finite")
        if op is distributed.Adasum:
            raise ValueError("AllreduceOptimizer sums or averages gradients; for Adasum use AdasumOptimizer")
        super().__init__(inner, name=name or f"allreduce_{getattr(inner, 'name', 'optimizer')}")
        self.op = op
        self.compression = _check_compression(compression)

    def build(self, var_list: list[Any]) -> None:
        self.inner_optimizer.build(var_list)
        super().build(var_list)

    def apply(self, grads: list[Any], trainable_variables: list[Any] | None = None) -> None:
        context = tf.distribute.get_replica_context()
        if context is not None and context.num_replicas_in_sync > 1:
            raise ValueError(
                f"AllreduceOptimizer runs one replica per process, but this step has "
                f"{context.num_replicas_in_sync} replicas: start one process per device instead of a "
                "tf.distribute strategy"
            )
        comm = distributed.init()
        if comm.size > 1:
            # A rank that ran out of data meets this sync at its epoch end: both raise, neither waits.
            checked = agreement.agree(comm, agreement.SYNC, -1, "gradient allreduce")
            with tf.control_dependencies([checked]):
                grads = [None if g is None else tf.identity(_dense(g)) for g in grads]
            present = [i for i, g in enumerate(grads) if g is not None]
            variables = list(trainable_variables) if trainable_variables is not None else None
            names = [variables[i].path for i in present] if variables is not None else []
            reduced = distributed.allreduce_compressed(
                [grads[i] for i in present], self.op, self.compression, names
            )
            grads = list(grads)
            for i, g in zip(present, reduced, strict=True):
                grads[i] = g
        self.inner_optimizer.apply(grads, trainable_variables)

    def get_config(self) -> dict[str, Any]:
        return {**self._config(), "op": self.op.value, "compression": self.compression}


def _value_of(variable: Any) -> Any:
    """An initializer that copies the variable's current value."""

    def initializer(shape: Any, dtype: Any) -> Any:
        return tf.cast(tf.identity(tf_variable(variable)), dtype)

    return initializer


# Keras's LossScaleOptimizer decides to skip a step from the first replica's gradients; around a
# tf_adasum optimizer it must decide from all of them.
_compat.install_global_loss_scale_finiteness(
    lambda optimizer: isinstance(optimizer, WrappedOptimizer) or syncs_in_apply(optimizer), finite_everywhere
)
