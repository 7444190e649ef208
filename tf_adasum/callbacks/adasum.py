"""AdasumCallback: the one line that turns a plain Keras script into Adasum data parallelism."""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from tf_adasum import _compat, distributed
from tf_adasum.algorithm.compression import check_compression
from tf_adasum.callbacks.batches import CountsBatches, retrace_with, retrace_without
from tf_adasum.common.variables import tf_variable
from tf_adasum.training import keras2_sync, model_sync, optimizer_options
from tf_adasum.training.keras_consensus import (
    agree_at_epoch_end,
    broadcast_model_and_optimizer,
    broadcast_variables,
    check_equal_steps,
)


class AdasumCallback(CountsBatches):
    """Adasum after the optimizer, across the processes of a plain Keras script (no strategy).

    Start the script as several processes (`mpirun -np 4 python train.py`, `horovodrun -np 4 python
    train.py`, or `python -m tf_adasum.run -np 4 train.py`) and add this callback to `fit`. At train
    begin it starts the engine and checks that every process will run the same number of batches;
    before the first batch (after every callback's on_train_begin, so after a BackupAndRestore restore)
    it broadcasts rank `root`'s model variables, and its optimizer state if no process has taken a step
    yet (a resumed process keeps its own, see broadcast_model_and_optimizer). From then on each process
    steps with its own optimizer and its own optimizer state (momentum, Adam moments), and every
    `sync_every` optimizer steps the model deltas since the last sync are combined with Adasum across
    processes, exactly as AdasumOptimizer does. The sync runs inside the compiled train step.

    With `steps_per_execution > 1` nothing changes: the sync belongs to the optimizer step, so it still
    happens after every `sync_every`-th step inside the compiled loop; Keras only calls the batch hooks
    once per execution.

    The model keeps the optimizer you compiled it with: during `fit` its `apply` is extended with the
    sync, and after `fit` it is the plain optimizer again, so the model saves and loads without
    tf_adasum (a checkpoint written during `fit` holds it too; an outer optimizer rides on it as an
    attribute, below). Its options keep their one-worker
    meaning (docs/training/optimizer-options.md): with use_ema the moving average follows the synced
    weights; with gradient_accumulation_steps each process accumulates its own gradients and the sync
    comes with every `sync_every`-th update. A second optimizer stepping in a custom train step must be
    a tf_adasum.AdasumOptimizer: a plain one is refused at the first step.

    A tf_keras (Keras 2) model is served alike: its optimizer's apply_gradients carries the sync during
    fit, with an outer optimizer of tf_keras's own (`tf.keras.optimizers.SGD(...)`), combine="mean" and
    compression alike. There a LossScaleOptimizer and use_ema are refused (training/keras2_sync.py says
    why).

    With an `outer_optimizer`, each sync puts the weights back where the window began and the outer
    optimizer steps them on the combined deltas, negated (local SGD with an outer optimizer:
    docs/training/outer-optimizer.md). Its state is one copy, the same on every process, since every
    process steps it on the same values, and root's is broadcast before the first batch. It lives on the
    model's optimizer, as its attribute `tf_adasum_outer_optimizer`, from the moment the callback meets
    the model (`set_model`, which `fit` calls before any callback's on_train_begin) until a callback
    without one trains the model: weights files and `.keras` files written during or after fit
    (BackupAndRestore, ModelCheckpoint, `save_weights`, `model.save`) hold it, BackupAndRestore brings
    it back, and to load it yourself call `callback.set_model(model)` first, then
    `model.load_weights(path)`. `keras.models.load_model` makes a new optimizer without it, and a model
    without tf_adasum ignores it.

    Under the TF engine (tf_adasum.run, horovodrun's Gloo mode, TF_CONFIG), TensorFlow's collective
    runtime must start before the first op: `import tf_adasum` does that for processes started by
    tf_adasum.run or horovodrun; with a TF_CONFIG of your own, call `tf_adasum.init()` at the top.

    Args:
        sync_every: optimizer steps between two Adasum combinations.
        root: the rank whose weights and optimizer state every process starts from.
        outer_optimizer: None (each sync adds the combined deltas to the weights), or a Keras optimizer
            (or its name) of the model's Keras that each sync steps from the window's first weights on the
            pseudo-gradient `-combined`.
        combine: how a sync combines the processes' deltas: "adasum" (the contract tree), or "mean"
            (their average: DiLoCo as published, to compare with).
        compression: "none", or "fp16" ("bf16") to send float32/float64 deltas as float16 (bfloat16).

    Raises:
        TypeError: an outer_optimizer that is not a plain Keras optimizer.
        ValueError: bad arguments, a model compiled under a tf.distribute strategy (use
            AdasumStrategy), an optimizer that already combines across processes, use_ema with
            sync_every > 1, a second plain optimizer in the train step, the model's own optimizer or
            one built on other variables or of the other Keras as the outer optimizer; under tf_keras,
            mixed precision and use_ema.
        UnevenDataError: the processes would run different numbers of batches.
        NonFiniteUpdateError: some process's update holds NaN or Inf (every process raises it).
        PeerError: a process died or stopped answering.

    Examples:
        >>> model.fit(x_shard, y_shard, epochs=5, callbacks=[tf_adasum.AdasumCallback()])
    """

    serves_keras_2 = True  # a tf_keras model's apply_gradients carries the sync (training/keras2_sync.py)

    def __init__(
        self,
        sync_every: int = 1,
        root: int = 0,
        outer_optimizer: Any = None,
        combine: str = "adasum",
        compression: str = "none",
    ) -> None:
        super().__init__()
        model_sync.check_sync_every(sync_every)
        # Mixed precision's skip decision must be global, and errors inside steps translated.
        _compat.require("LossScaleOptimizer.check_finite", "train_step / test_step", "_iterations")
        if not isinstance(root, int) or root < 0:
            raise ValueError(f"root must be a rank (a non-negative integer), got {root!r}")
        self.sync_every = sync_every
        self.root = root
        self.outer_optimizer = model_sync.check_outer_optimizer(outer_optimizer, keras_2=True)
        self.combine = model_sync.check_combine(combine)
        self.compression = check_compression(compression)
        self._optimizer: keras.optimizers.Optimizer | None = None

    def set_model(self, model: keras.Model) -> None:
        super().set_model(model)
        if self._refusal() is None:
            self._attach_outer_optimizer()

    def _refusal(self) -> str | None:
        """Why this callback cannot serve its model, or None: a strategy, or an optimizer that already
        combines across processes."""
        model = self.model
        if model.distribute_strategy is not tf.distribute.get_strategy() or tf.distribute.has_strategy():
            return (
                "AdasumCallback is for one process per worker without a tf.distribute strategy; under a "
                f"strategy ({type(model.distribute_strategy).__name__}) use tf_adasum.AdasumStrategy instead"
            )
        stepping = _compat.loss_scale_inner(getattr(model, "optimizer", None))
        # (An apply this callback extended, left by a fit that raised, is taken off at train begin.)
        syncs = model_sync.syncs(stepping) and not model_sync.extended_by_callback(stepping)
        if syncs or hasattr(stepping, "_tf_adasum_op"):
            what = "DistributedOptimizer" if hasattr(stepping, "_tf_adasum_op") else type(stepping).__name__
            return (
                f"the model's optimizer is already a {what}, which combines across "
                "processes itself: use either it or AdasumCallback, not both"
            )
        return None

    def _attach_outer_optimizer(self) -> None:
        """Builds the outer optimizer on the model's trainable variables (eagerly: Keras cannot build a
        stateful optimizer inside the train function) and hangs it on the model's optimizer, where
        checkpoints find it (with none asked, takes off one an earlier callback hung there). Builds the
        model's optimizer too: Keras loads no state into an optimizer that has none yet (a load_weights
        after set_model, before fit). Nothing while the model has no weights (a Sequential without an
        Input gets them in fit's first trace, after on_train_begin has refused it)."""
        outer, model = self.outer_optimizer, self.model
        optimizer = getattr(model, "optimizer", None)
        if optimizer is None or not model.weights:
            return
        keras_2 = _compat.keras_2_name(model) is not None
        if outer is None:
            _compat.attach_outer(optimizer if keras_2 else _compat.loss_scale_inner(optimizer), None)
            return
        _compat.hang_outer(optimizer, outer, list(model.trainable_variables))

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        super().on_train_begin(logs)
        model, optimizer = self.model, self.model.optimizer
        refusal = self._refusal()
        if refusal is not None:
            raise ValueError(refusal)
        keras_2 = _compat.keras_2_name(model) is not None
        stepping = optimizer if keras_2 else _compat.loss_scale_inner(optimizer)  # mixed_float16's inner
        if keras_2:
            keras2_sync.end_sync(stepping)  # left by a fit that raised before on_train_end
            keras2_sync.check_keras_2_optimizer(model, stepping)
        elif model_sync.extended_by_callback(stepping):
            del stepping.apply  # left by a fit that raised before on_train_end could restore it
        distributed.init()
        check_equal_steps(self.params)
        variables = list(model.trainable_variables)
        if not model.weights:
            raise ValueError(
                "AdasumCallback: the model has no weights yet (Keras builds a Sequential without an Input "
                "only in its first step), so there is nothing to combine: give it one, "
                "keras.Sequential([keras.Input(shape), ...]), or call model.build(input_shape) before fit"
            )
        if not keras_2:
            optimizer_options.check(stepping, self.sync_every)
        _compat.build_optimizer(optimizer, variables)
        self._attach_outer_optimizer()  # again: a set_model before the model had weights, or a stale one
        # The window's anchors (model_sync.start_window) and, with windows of several steps, the weights as
        # the last step left them, outside the optimizer so that it saves as the user's own. Each fit starts
        # a window at its first batch, after every callback's on_train_begin (a BackupAndRestore restore).
        self._anchors = [
            tf.Variable(tf_variable(v), trainable=False, name="adasum_anchor") for v in variables
        ]
        every = self.sync_every if keras_2 else optimizer_options.sync_period(stepping, self.sync_every)
        lasts = (
            [tf.Variable(tf_variable(v), trainable=False, name="adasum_last") for v in variables]
            if every > 1
            else None
        )
        self._lasts = lasts
        self._optimizer = stepping
        self._started = False
        if keras_2:  # tf_keras: its apply_gradients, with no options to honour (use_ema was refused)
            sync = (self.compression, self.outer_optimizer, self.combine)
            keras2_sync.extend_with_sync(stepping, variables, (self._anchors, lasts), every, sync)
            retrace_with(model)
            return
        # The sync extends the optimizer that steps, so that a step mixed precision skips for overflow
        # skips the sync too. The skip is decided on every process at once (optimizer.finite_everywhere),
        # since the sync is a collective.
        anchors, local_step = self._anchors, stepping.apply
        distribution = tf.distribute.get_strategy()
        outer, combine, compression = self.outer_optimizer, self.combine, self.compression

        def apply_then_sync(grads: list[Any], trainable_variables: list[Any] | None = None) -> None:
            before = optimizer_options.steps_so_far(stepping)
            model_sync.start_window(variables, anchors, before, every, lasts)

            def sync() -> None:
                stats = model_sync.sync_stats(stepping)  # an OrthogonalityMonitor's, if one asked
                model_sync.sync_if_due(
                    distribution, variables, anchors, before + 1, every, compression, stats, outer, combine
                )
                model_sync.record_lasts(variables, lasts)

            optimizer_options.step_then_sync(stepping, lambda: local_step(grads, trainable_variables), sync)

        setattr(apply_then_sync, model_sync.SYNCS, True)
        stepping.apply = apply_then_sync
        retrace_with(model)  # a train function traced before (an earlier fit) would not sync

    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if not self._started:
            # After every on_train_begin, so that a state BackupAndRestore brought back is what counts.
            broadcast_model_and_optimizer(self.model, self.root, state_per_process=True)
            if self.outer_optimizer is not None:
                # One outer state for the job, root's: a resume where root alone loaded it (Horovod's)
                # must not leave the others stepping from zeros.
                broadcast_variables(_compat.optimizer_variables(self.outer_optimizer), self.root)
            # This fit's first step opens a window, whatever the iteration count says.
            for anchor, variable in zip(self._anchors, self.model.trainable_variables, strict=True):
                anchor.assign(tf_variable(variable))
            if self._lasts is not None:
                for last, variable in zip(self._lasts, self.model.trainable_variables, strict=True):
                    last.assign(tf_variable(variable))
            self._started = True

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        agree_at_epoch_end(self.model, epoch, self.batches)

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        if self._optimizer is not None:  # the class's own step again
            if _compat.keras_2_name(self._optimizer) is not None:
                keras2_sync.end_sync(self._optimizer)
            else:
                del self._optimizer.apply
            self._optimizer = None
            retrace_without(self.model)
