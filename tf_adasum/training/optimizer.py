"""WrappedOptimizer, what the optimizer wrappers share, and AdasumOptimizer.

AdasumOptimizer: every replica steps on its own, then the model deltas are combined with Adasum.

This is the paper's "Adasum after the optimizer update" (arXiv 2006.02924, Figure 3):

1. Each replica runs the inner optimizer on its own gradient, with its own optimizer state. The inner
   optimizer's cross-replica gradient sum is switched off; Keras's own update path
   (`extended.update` with per-replica gradients) then steps each replica's copy of every variable
   and of every slot on its device, so momentum and Adam moments stay per replica.
2. Every `sync_every` steps the deltas since the window's first step, `w_replica - w_anchor`, are
   combined with the contract tree over every replica of every process (model_sync.sync_if_due); every
   replica then holds `w_anchor + adasum(deltas)`, bitwise identical. The anchors are the weights at the
   window's first step, or where anything but the optimizer wrote them since (model_sync.start_window).
   With the inner optimizer's use_ema the sync runs inside its step, just before Keras updates the moving
   average, which then follows the synced weights (optimizer_options.step_then_sync).

Each local step is exactly a single-worker step on that replica's batch, however the loss was built and
scaled (tf_adasum/training/loss_scaling.py).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from keras.optimizers import LossScaleOptimizer

from tf_adasum import _compat
from tf_adasum.algorithm.compression import check_compression
from tf_adasum.algorithm.tensor_lists import dense
from tf_adasum.common.variables import have_values, tf_variable
from tf_adasum.training import loss_scaling, model_sync, optimizer_options
from tf_adasum.training.keras_consensus import broadcast_variables
from tf_adasum.training.replica_optimizer_state import ReplicaState


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

    _tf_adasum_syncs = True  # model_sync.syncs(): its step ends in a sync across replicas or processes

    def __init__(self, inner: keras.optimizers.Optimizer, name: str) -> None:
        if isinstance(inner, WrappedOptimizer):
            raise ValueError(f"the inner optimizer is already a {type(inner).__name__}")
        _compat.require_keras_3(inner, type(self).__name__)
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
        _compat.track(self, inner, "inner")
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
        return _compat.own_variables(self) + self.inner_optimizer.variables

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
        own = _compat.own_variables(self)
        if len(store.keys()) == len(own) != len(self.variables):
            # Saved before `variables` listed the inner optimizer's too: this optimizer's own only.
            for i, variable in enumerate(own):
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


# Keras's SwapEMAWeights finds the inner optimizer's moving averages in a LossScaleOptimizer around a
# wrapper too (mixed precision under AdasumStrategy), as it does around a plain optimizer.
_compat.show_moving_averages(WrappedOptimizer, lambda wrapper: wrapper.inner_optimizer)


def build_before_the_trace(model: Any) -> None:
    """Builds a model's tf_adasum optimizer eagerly before Keras makes its train function, where fit runs
    without a strategy (DistributedOptimizer in Horovod's recipe) and the model's weights exist.

    Keras builds an optimizer before fit only under a strategy; without one, in the trace of the train
    step. TensorFlow traces a function whose first trace created variables a second time, so the slots
    made there cost a second trace of the whole step: 0.1-0.2 s more at the first step of
    benchmarks/studies/convergence.py's CNN, 0.7-1.5 s of its Transformer
    (benchmarks/training/bench_first_step.py).
    Under a strategy, and for a model whose weights are made in its first call, this does nothing and
    Keras builds as before.
    """
    optimizer = getattr(model, "optimizer", None)
    if not isinstance(optimizer, keras.optimizers.Optimizer) or optimizer.built:
        return
    if not isinstance(_compat.loss_scale_inner(optimizer), WrappedOptimizer):
        return
    variables = list(model.trainable_variables) if getattr(model, "built", False) else []
    if variables and have_values(variables):
        optimizer.build(variables)


# AdasumOptimizers whose first step was traced before their model's variables had values, each with its
# flag: False until that step, when it runs, has broadcast the weights (_broadcast_at_the_first_step).
_BROADCAST_DONE: weakref.WeakKeyDictionary[Any, tf.Variable] = weakref.WeakKeyDictionary()


@keras.saving.register_keras_serializable(package="tf_adasum")
class AdasumOptimizer(WrappedOptimizer):
    """Wraps a Keras optimizer so that replicas step locally and their deltas are combined with Adasum.

    Args:
        inner: any Keras 3 optimizer (SGD with momentum, Adam, AdamW, Lamb, ...). Its learning-rate
            schedule, clipping and weight decay apply in each local step; its moving average (use_ema)
            follows the synced weights (docs/training/optimizer-options.md has each option's rule).
        sync_every: how many local steps each replica takes between two Adasum combinations (with
            the inner optimizer's gradient_accumulation_steps, how many of its updates).
        name: optional name; default "adasum_<inner name>".
        root: across processes, the rank whose initial weights every process starts from.
        compression: "none", or "fp16" ("bf16") to send float32/float64 deltas across processes as
            float16 (bfloat16).
        outer_optimizer: None (each sync adds the combined deltas to the weights), or a Keras
            optimizer (or its name) that each sync steps from the window's first weights on the
            pseudo-gradient `-combined` (local SGD with an outer optimizer, as DiLoCo has it). Its state
            is one copy, the same on every replica and process, saved and restored with this
            optimizer's. An optimizer made outside the strategy's scope is copied from its config.
        combine: how a sync combines the replicas' deltas: "adasum" (the contract tree), or "mean"
            (their average over every replica of every process: DiLoCo as published, to compare with).

    Raises:
        TypeError: `inner` is not a Keras optimizer.
        ValueError: `sync_every` is not a positive integer, `inner` is already wrapped, or one of its
            options cannot keep its meaning here (use_ema with sync_every > 1; under a tf.distribute
            strategy, gradient_accumulation_steps or ema_overwrite_frequency).

    Examples:
        >>> model.compile(optimizer=tf_adasum.AdasumOptimizer(keras.optimizers.Adam(1e-3)), loss=...)
    """

    def __init__(
        self,
        inner: keras.optimizers.Optimizer,
        sync_every: int = 1,
        name: str | None = None,
        root: int = 0,
        compression: str = "none",
        outer_optimizer: Any = None,
        combine: str = "adasum",
    ) -> None:
        if isinstance(inner, AdasumOptimizer):
            raise ValueError("the inner optimizer is already an AdasumOptimizer")
        _compat.require()
        super().__init__(inner, name=name or f"adasum_{getattr(inner, 'name', 'optimizer')}")
        self.sync_every = model_sync.check_sync_every(sync_every)
        optimizer_options.check(inner, self.sync_every)
        self.root = root
        self.compression = check_compression(compression)
        self.combine = model_sync.check_combine(combine)
        outer = model_sync.check_outer_optimizer(outer_optimizer)
        if outer is inner:
            raise ValueError(
                f"outer_optimizer is the inner optimizer {inner.name!r}: the outer step needs an optimizer "
                "of its own, with its own state (keras.optimizers.SGD(0.5, momentum=0.5, nesterov=True), ...)"
            )
        if outer is not None and _compat.strategy_of(outer) is not tf.distribute.get_strategy():
            outer = model_sync.outer_copy(outer)  # its state must live under this optimizer's strategy
        self.outer_optimizer = outer
        if outer is not None:
            _compat.track(self, outer, "outer")
        # Each replica must step on its own gradient: no cross-replica sum inside the inner optimizer.
        _compat.disable_gradient_sum(inner)
        self._replica_state = ReplicaState(self)
        # tf.train.Checkpoint saves this child with the optimizer: every replica's state, not the first.
        self.replica_state = self._replica_state.checkpoint_node()

    def build(self, var_list: list[Any]) -> None:
        current = tf.distribute.get_strategy()
        for optimizer in (self, self.inner_optimizer, *self._outer()):
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
        for outer in self._outer():
            outer.build([v for v in var_list if not self.is_local(v)])
        if self._replica_state.pending is not None:
            stacked, self._replica_state.pending = self._replica_state.pending, None
            self._replica_state.spread(stacked)
        # The weights at the window's first step (model_sync.start_window); deltas are measured from here.
        # Taken before the first step: a new window opens there (or a restore brings them back).
        self._anchors = [self.add_variable_from_reference(v, name="adasum_anchor") for v in var_list]
        # Inside a window, the weights as the optimizer's last step left them: a write by anything else
        # re-anchors. Saved with the optimizer, so that a restore mid-window resumes the window.
        self._lasts = (
            [self.add_variable_from_reference(v, name="adasum_last", initializer="zeros") for v in var_list]
            if optimizer_options.sync_period(self.inner_optimizer, self.sync_every) > 1
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

    def weights_agreed(self) -> None:
        """Says that every process holds root's weights already (an elastic state's sync), so that the
        first step does not broadcast them again: a collective of the whole model at every group's start.
        The optimizer must be built (a later build would owe the broadcast again)."""
        if not self.built:
            raise ValueError(f"optimizer {self.name!r}: weights_agreed() before build()")
        self._broadcast_owed = False

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
                if have_values(mine):
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
        grads = [None if g is None else dense(g) for g in grads]
        # Each local step is a single-worker step on this replica's batch, however the loss was scaled.
        factor = loss_scaling.gradient_factor(context.num_replicas_in_sync, self.name)
        if factor != 1:
            grads = [None if g is None else g * tf.cast(factor, g.dtype) for g in grads]
        variables = (
            list(trainable_variables)
            if trainable_variables is not None
            else _compat.trainable_variables_of(self)
        )
        variables = [v for v in variables if not self.is_local(v)]  # a worker's own are not combined
        indices = [_compat.variable_index(self, v) for v in variables]
        anchors = [self._anchors[i] for i in indices]
        lasts = [self._lasts[i] for i in indices] if self._lasts else None
        inner = self.inner_optimizer
        every = optimizer_options.sync_period(inner, self.sync_every)
        before = optimizer_options.steps_so_far(inner)
        if self._broadcast_owed or self in _BROADCAST_DONE:  # the first step, or its retraces
            context.merge_call(self._broadcast_at_the_first_step, args=(variables,))
        context.merge_call(lambda _: model_sync.start_window(variables, anchors, before, every, lasts))

        def sync_then_record(distribution: Any) -> None:
            stats = model_sync.sync_stats(self)
            model_sync.sync_if_due(
                distribution,
                variables,
                anchors,
                before + 1,
                every,
                self.compression,
                stats,
                self.outer_optimizer,
                self.combine,
            )
            model_sync.record_lasts(variables, lasts)

        with self._stepping():
            optimizer_options.step_then_sync(
                inner,
                lambda: inner.apply(grads, trainable_variables),
                lambda: context.merge_call(sync_then_record),
            )

    def _outer(self) -> list[keras.optimizers.Optimizer]:
        return [] if self.outer_optimizer is None else [self.outer_optimizer]

    @property
    def variables(self) -> list[Any]:
        """This optimizer's own variables, the inner optimizer's, then the outer optimizer's."""
        return super().variables + [v for outer in self._outer() for v in outer.variables]

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
            **(
                {}
                if self.outer_optimizer is None
                else {"outer_optimizer": keras.saving.serialize_keras_object(self.outer_optimizer)}
            ),
            **({} if self.combine == "adasum" else {"combine": self.combine}),
        }
