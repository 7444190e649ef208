"""The two optimizer wrappers, AdasumOptimizer and AllreduceOptimizer, and their per-replica checkpoint state.

AdasumOptimizer: every replica steps on its own, then the model deltas are combined with Adasum.

This is the paper's "Adasum after the optimizer update" (arXiv 2006.02924, Figure 3):

1. Each replica runs the inner optimizer on its own gradient, with its own optimizer state. The inner
   optimizer's cross-replica gradient sum is switched off; Keras's own update path
   (`extended.update` with per-replica gradients) then steps each replica's copy of every variable
   and of every slot on its device, so momentum and Adam moments stay per replica.
2. Every `sync_every` steps the deltas since the window's first step, `w_replica - w_anchor`, are
   combined with the contract tree over every replica of every process (sync.sync_if_due); every
   replica then holds `w_anchor + adasum(deltas)`, bitwise identical. The anchors are the weights at the
   window's first step, or where anything but the optimizer wrote them since (sync.start_window).

Under a strategy Keras scales each replica's loss by 1/N so that summed gradients average; the
gradients are multiplied back by N, so each local step is exactly a single-worker step on that
replica's batch.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from keras.optimizers import LossScaleOptimizer
from tensorflow.core.framework import tensor_pb2

from tf_adasum import _compat, agreement, distributed, sync
from tf_adasum.compression import check_compression
from tf_adasum.shared_state import broadcast_variables
from tf_adasum.tensor_lists import dense
from tf_adasum.variables import replica_values, tf_variable, variable_name


class _Stepping(threading.local):
    def __init__(self) -> None:
        self.wrappers: set[int] = set()


# Each wrapper by the optimizer it wraps; and, per thread, the wrappers inside their own step. An inner
# optimizer stepped directly (a strategy.run loop under AdasumStrategy steps a plain optimizer, or a
# script keeps a reference to the optimizer it wrapped) runs its wrapper's step instead
# (strategy.adasum_for), and the wrapper's own step of it must not be sent round again.
_WRAPPERS: weakref.WeakKeyDictionary[Any, WrappedOptimizer] = weakref.WeakKeyDictionary()
_STEPPING = _Stepping()


class WrappedOptimizer(keras.optimizers.Optimizer):
    """What AdasumOptimizer and AllreduceOptimizer share: an inner Keras optimizer that does the steps.

    The learning rate, the iteration count, loss scaling and finalisation are the inner optimizer's,
    so schedules and callbacks that read or set them see the optimizer the user configured.
    """

    _tf_adasum_syncs = True  # sync.syncs(): its step ends in a sync across replicas or processes

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
        _WRAPPERS[inner] = self

    def register_local_var(self, var: Any) -> None:
        """Horovod's: `var` is this worker's own. Its gradient is not all-reduced (AllreduceOptimizer) and
        its updates are not combined (AdasumOptimizer), and BroadcastGlobalVariablesCallback given it as
        a local variable leaves it alone; it stays different on every process."""
        self._local_ids().add(id(tf_variable(var)))

    def _local_ids(self) -> set[int]:
        if "_tf_adasum_local" not in self.__dict__:
            self.__dict__["_tf_adasum_local"] = set()
        return self.__dict__["_tf_adasum_local"]

    def is_local(self, var: Any) -> bool:
        """Whether `var` was registered as this worker's own (register_local_var)."""
        return id(tf_variable(var)) in self._local_ids()

    @classmethod
    def wrapping(cls, optimizer: Any) -> WrappedOptimizer | None:
        """The wrapper whose inner optimizer `optimizer` is, if any."""
        return _WRAPPERS.get(optimizer)

    @contextlib.contextmanager
    def _stepping(self) -> Iterator[None]:
        """Marks this thread as inside this wrapper's own step of its inner optimizer."""
        _STEPPING.wrappers.add(id(self))
        try:
            yield
        finally:
            _STEPPING.wrappers.discard(id(self))

    def is_stepping(self) -> bool:
        """Whether this thread is inside this wrapper's own step (its inner optimizer's apply)."""
        return id(self) in _STEPPING.wrappers

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

    # The first key of the saved config: where tf_adasum is not imported, Keras's "Could not locate
    # class" error prints the config, and this says what to do.
    LOADING = "loading"
    LOADING_ADVICE = (
        "this optimizer is tf_adasum's: `import tf_adasum` before keras.models.load_model, or load the "
        "model without it, for inference, with keras.models.load_model(path, compile=False)"
    )

    def _config(self) -> dict[str, Any]:
        return {
            self.LOADING: self.LOADING_ADVICE,
            "name": self.name,
            "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
        }

    @classmethod
    def from_config(cls, config: dict[str, Any], custom_objects: Any = None) -> Any:
        config = dict(config)
        config.pop(cls.LOADING, None)
        serialized = config.pop("inner_optimizer") if "inner_optimizer" in config else config.pop("inner")
        inner = keras.saving.deserialize_keras_object(serialized, custom_objects=custom_objects)
        if callable(inner) and not isinstance(inner, keras.optimizers.Optimizer):
            # Horovod's load_model idiom: custom_objects={"Name": lambda **kw: hvd.DistributedOptimizer(
            # Name(**kw))}. The factory builds the optimizer from the saved config; its wrapper is this one.
            inner = inner(**serialized.get("config", {}))
            inner = getattr(inner, "inner_optimizer", inner)
        return cls(inner, **config)


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


class _ReplicaStateCheckpoint(tf.__internal__.tracking.Trackable):
    """ReplicaState for tf.train.Checkpoint and SavedModel: one string tensor, each of its elements one
    inner variable's replicas, stacked, as a serialized TensorProto.

    Tensors, not Python state, so that tf.saved_model.save, which traces the save, can write it. It is
    restored after the inner optimizer's own variables: the restore of a mirrored variable puts its
    first replica's value into every replica, and this must come after it. TensorFlow restores an
    object graph breadth first, so this sits deeper than the inner optimizer's variables
    (_after_the_inner_variables).
    """

    _KEY = "per_replica"

    def __init__(self, state: ReplicaState) -> None:
        self._state = state

    def _serialize_to_tensors(self) -> dict[str, tf.Tensor]:
        stacked = [
            tf.io.serialize_tensor(tf.stack([tf.identity(c) for c in replica_values(v)]))
            for v in self._state.optimizer.inner_optimizer.variables
        ]
        return {self._KEY: tf.stack(stacked) if stacked else tf.constant([], tf.string)}

    def _restore_from_tensors(self, restored_tensors: dict[str, tf.Tensor]) -> Any:
        if not tf.executing_eagerly():  # a restore traced into a graph: nothing to spread from here
            warnings.warn(
                "tf_adasum: a graph-mode restore cannot spread every replica's optimizer state; every "
                "replica keeps replica 0's",
                stacklevel=2,
            )
            return tf.no_op()
        protos = restored_tensors[self._KEY].numpy().tolist()
        self._state.spread([tf.make_ndarray(tensor_pb2.TensorProto.FromString(p)) for p in protos])


class _CheckpointsOnly(tf.__internal__.tracking.AutoTrackable):
    """A node of tf.train.Checkpoint's object graph that SavedModels leave out.

    A SavedModel loads as generic objects, without tf_adasum and without replicas, so every replica's
    optimizer state means nothing there; and tf.saved_model.save could not write it, since it saves
    copies of the variables in a graph of its own.
    """

    def _trackable_children(self, save_type: Any = "checkpoint", **kwargs: Any) -> dict[str, Any]:
        if save_type == "savedmodel":
            return {}
        return super()._trackable_children(save_type, **kwargs)


def _after_the_inner_variables(trackable: Any) -> Any:
    """`trackable` three levels down a chain of empty trackables: deeper in the object graph than the
    inner optimizer's variables (optimizer/inner_optimizer/_variables/N), whether the chain hangs from
    the AdasumOptimizer or from the plain optimizer it wraps (strategy.adasum_optimizer_for)."""
    for _ in range(3):
        node = _CheckpointsOnly()
        node._track_trackable(trackable, name="then")
        trackable = node
    return trackable


# AdasumOptimizers whose first step was traced before their model's variables had values, each with its
# flag: False until that step, when it runs, has broadcast the weights (_broadcast_at_the_first_step).
_BROADCAST_DONE: weakref.WeakKeyDictionary[Any, tf.Variable] = weakref.WeakKeyDictionary()


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
        self.sync_every = sync.check_sync_every(sync_every)
        self.root = root
        self.compression = check_compression(compression)
        # Each replica must step on its own gradient: no cross-replica sum inside the inner optimizer.
        _compat.disable_gradient_sum(inner)
        self._replica_state = ReplicaState(self)
        # tf.train.Checkpoint saves this child with the optimizer: every replica's state, not the first.
        self.replica_state = _after_the_inner_variables(_ReplicaStateCheckpoint(self._replica_state))

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
        # No collective here: build runs wherever Keras or the user calls it, also on one rank alone
        # (Horovod's resume: rank 0 loads the model, the others build a new one). Every process takes
        # root's weights at the first step instead (_broadcast_at_the_first_step).
        self._broadcast_owed = True
        self.inner_optimizer.build(var_list)  # restores deferred by tf.train.Checkpoint happen in here
        if self._replica_state.pending is not None:
            stacked, self._replica_state.pending = self._replica_state.pending, None
            self._replica_state.spread(stacked)
        # The weights at the window's first step (sync.start_window); deltas are measured from here.
        # Taken before the first step: a new window opens there (or a restore brings them back).
        self._anchors = [self.add_variable_from_reference(v, name="adasum_anchor") for v in var_list]
        # Inside a window, the weights as the optimizer's last step left them: a write by anything else
        # re-anchors. Saved with the optimizer, so that a restore mid-window resumes the window.
        self._lasts = (
            [self.add_variable_from_reference(v, name="adasum_last", initializer="zeros") for v in var_list]
            if self.sync_every > 1
            else []
        )
        super().build(var_list)

    def _build_at_the_first_step(self, var_list: list[Any]) -> None:
        """build() at the first step: in a custom loop, or in fit without a strategy, where Keras builds
        the optimizer only while it traces the train step.

        Eagerly, out of the traced step, in the strategy's cross-replica context: Keras 3 cannot create
        a stateful optimizer's slots inside a traced step under a strategy (keras-team/keras#23085).
        """

        def build_in_cross_replica_context(strategy: Any) -> None:
            with tf.init_scope():
                if not self.built:  # another replica's thread, or a retrace, got here first
                    self.build(var_list)

        tf.distribute.get_replica_context().merge_call(build_in_cross_replica_context)

    def _broadcast_at_the_first_step(self, distribution: Any, variables: list[Any]) -> None:
        """Every process takes root's weights before its first step, as MultiWorkerMirroredStrategy and
        Horovod's broadcast callback arrange; otherwise each would keep its own initialisation.

        Every rank gets here at the same point: its first step, or that step's trace. Eagerly when the
        weights have values (also while the step is traced: tf.init_scope), so that the compiled step
        holds no broadcast. Where the model's own variables are created in this very trace they have
        none yet: then the compiled step broadcasts in its first run, under a flag.
        """
        mine = [v for v in variables if not self.is_local(v)]
        if self._broadcast_owed:
            self._broadcast_owed = False
            with tf.init_scope():
                if all(bool(tf_variable(v).is_initialized()) for v in mine):
                    broadcast_variables(mine, self.root)
                    return
                _BROADCAST_DONE[self] = tf.Variable(False, trainable=False, name="adasum_broadcast_done")
        done = _BROADCAST_DONE.get(self)
        if done is None:
            return

        def broadcast() -> tf.Tensor:
            broadcast_variables(mine, self.root)
            done.assign(True)
            return tf.constant(True)

        tf.cond(done, lambda: tf.constant(False), broadcast)

    def apply(self, grads: list[Any], trainable_variables: list[Any] | None = None) -> None:
        context = tf.distribute.get_replica_context()
        if context is None:
            raise ValueError(
                "AdasumOptimizer.apply must run in a replica context (model.fit or strategy.run)"
            )
        if not self.built:
            self._build_at_the_first_step(
                list(trainable_variables) if trainable_variables is not None else []
            )
        replicas = context.num_replicas_in_sync
        grads = [None if g is None else dense(g) for g in grads]
        if replicas > 1:  # undo Keras's 1/N loss scaling: each local step is a single-worker step
            grads = [None if g is None else g * tf.cast(replicas, g.dtype) for g in grads]
        variables = (
            list(trainable_variables) if trainable_variables is not None else self._trainable_variables
        )
        variables = [v for v in variables if not self.is_local(v)]  # a worker's own are not combined
        indices = [self._get_variable_index(v) for v in variables]
        anchors = [self._anchors[i] for i in indices]
        lasts = [self._lasts[i] for i in indices] if self._lasts else None
        iterations, every = self.inner_optimizer.iterations, self.sync_every
        if self._broadcast_owed or self in _BROADCAST_DONE:  # the first step, or its retraces
            context.merge_call(self._broadcast_at_the_first_step, args=(variables,))
        context.merge_call(lambda _: sync.start_window(variables, anchors, iterations, every, lasts))
        with self._stepping():
            self.inner_optimizer.apply(grads, trainable_variables)

        def sync_then_record(distribution: Any) -> None:
            stats = sync.sync_stats(self)
            sync.sync_if_due(distribution, variables, anchors, iterations, every, self.compression, stats)
            sync.record_lasts(variables, lasts)

        context.merge_call(sync_then_record)

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
        backward_passes_per_step: Horovod's gradient accumulation: each process sums its gradients
            over this many steps, then they are all-reduced once and the inner optimizer steps; in
            between the weights stay as they are and only the iteration count moves, as in Horovod.
        average_aggregated_gradients: divide the accumulated gradients by backward_passes_per_step
            (Horovod's flag; its default, False, applies their sum).
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
    ) -> None:
        op = distributed.ReduceOp(op)
        # Mixed precision's skip decision must be global: one rank skipping would average other steps.
        _compat.require("LossScaleOptimizer.check_finite")
        if op is distributed.Adasum:
            raise ValueError("AllreduceOptimizer sums or averages gradients; for Adasum use AdasumOptimizer")
        super().__init__(inner, name=name or f"allreduce_{getattr(inner, 'name', 'optimizer')}")
        self.op = op
        self.compression = check_compression(compression)
        self.backward_passes_per_step = sync.check_positive_integer(
            "backward_passes_per_step", backward_passes_per_step
        )
        self.average_aggregated_gradients = bool(average_aggregated_gradients)
        self.scale_local_gradients = bool(scale_local_gradients)

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
            reduced = distributed.allreduce_compressed(
                [grads[i] for i in present], self.op, self.compression, names
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
            list(trainable_variables) if trainable_variables is not None else self._trainable_variables
        )
        accumulators = [self._accumulated[self._get_variable_index(v)] for v in variables]
        for accumulator, g in zip(accumulators, grads, strict=True):
            if g is not None:
                accumulator.assign_add(tf.cast(dense(g), accumulator.dtype))
        iterations = self.inner_optimizer.iterations
        passes = self.backward_passes_per_step

        def reduce_and_apply() -> tf.Tensor:
            summed = [
                None if g is None else tf.identity(a) / passes if self.average_aggregated_gradients else
                tf.identity(a)
                for a, g in zip(accumulators, grads, strict=True)
            ]  # fmt: skip
            self._reduce_then_apply(summed, variables)
            for accumulator in accumulators:
                accumulator.assign(tf.zeros_like(accumulator))
            return tf.constant(True)

        def count_the_pass() -> tf.Tensor:
            iterations.assign_add(1)
            return tf.constant(False)

        tf.cond(tf.equal(tf.math.floormod(iterations + 1, passes), 0), reduce_and_apply, count_the_pass)

    def get_config(self) -> dict[str, Any]:
        return {
            **self._config(),
            "op": self.op.value,
            "compression": self.compression,
            "backward_passes_per_step": self.backward_passes_per_step,
            "average_aggregated_gradients": self.average_aggregated_gradients,
            "scale_local_gradients": self.scale_local_gradients,
        }
