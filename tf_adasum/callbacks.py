"""Keras callbacks for scripts that run one process per worker (mpirun, horovodrun, tf_adasum.run).

- AdasumCallback: the one line that turns a plain Keras script into Adasum data parallelism.
- OrthogonalityMonitor: how orthogonal the replicas' updates were, per layer (the paper's Figure 1).
- BroadcastGlobalVariablesCallback, MetricAverageCallback, LearningRateWarmupCallback,
  LearningRateScheduleCallback and BestModelCheckpoint: Horovod's callbacks
  (horovod/_keras/callbacks.py, horovod/tensorflow/keras/callbacks.py), for Keras 3.

The sync they install is sync.py's; the broadcasts, log averaging and batch-count checks are
shared_state.py's, which AdasumOptimizer and AdasumStrategy call too.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tf_adasum import _compat, agreement, distributed, sync
from tf_adasum.optimizer import AdasumOptimizer
from tf_adasum.shared_state import (
    agree_at_epoch_end,
    average_logs,
    broadcast_model_and_optimizer,
    check_equal_steps,
    forget_agreed_epochs,
)
from tf_adasum.variables import tf_variable


def _retrace_with(model: keras.Model) -> None:
    """Makes Keras trace a new train function now, which holds what a callback just installed."""
    model.make_train_function(force=True)


def _retrace_without(model: keras.Model) -> None:
    """Makes the next fit trace a train function without what a callback installed."""
    model.train_function = None


class _CountsBatches(keras.callbacks.Callback):
    """Counts the batches of the current epoch, for the epoch-end agreement."""

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        forget_agreed_epochs(self.model)  # a new fit counts its epochs from its initial epoch again

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self._batches = 0

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        # With steps_per_execution > 1, `batch` is the last batch of the execution.
        self._batches = batch + 1


class AdasumCallback(_CountsBatches):
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
    tf_adasum (a checkpoint written during `fit` holds it too).

    Under the TF engine (tf_adasum.run, horovodrun's Gloo mode, TF_CONFIG), TensorFlow's collective
    runtime must start before the first op: `import tf_adasum` does that for processes started by
    tf_adasum.run or horovodrun; with a TF_CONFIG of your own, call `tf_adasum.init()` at the top.

    Args:
        sync_every: optimizer steps between two Adasum combinations.
        root: the rank whose weights and optimizer state every process starts from.

    Raises:
        ValueError: bad arguments, a model compiled under a tf.distribute strategy (use
            AdasumStrategy), or an optimizer that already combines across processes.
        UnevenDataError: the processes would run different numbers of batches.
        NonFiniteUpdateError: some process's update holds NaN or Inf (every process raises it).
        PeerError: a process died or stopped answering.

    Example:
        >>> model.fit(x_shard, y_shard, epochs=5, callbacks=[tf_adasum.AdasumCallback()])
    """

    def __init__(self, sync_every: int = 1, root: int = 0) -> None:
        super().__init__()
        sync.check_sync_every(sync_every)
        # Mixed precision's skip decision must be global, and errors inside steps translated.
        _compat.require("LossScaleOptimizer.check_finite", "train_step / test_step")
        if not isinstance(root, int) or root < 0:
            raise ValueError(f"root must be a rank (a non-negative integer), got {root!r}")
        self.sync_every = sync_every
        self.root = root
        self._optimizer: keras.optimizers.Optimizer | None = None

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        super().on_train_begin(logs)
        model, optimizer = self.model, self.model.optimizer
        if model.distribute_strategy is not tf.distribute.get_strategy() or tf.distribute.has_strategy():
            raise ValueError(
                "AdasumCallback is for one process per worker without a tf.distribute strategy; under a "
                f"strategy ({type(model.distribute_strategy).__name__}) use tf_adasum.AdasumStrategy instead"
            )
        stepping = _compat.loss_scale_inner(optimizer)  # under mixed_float16, inside a LossScaleOptimizer
        if sync.extended_by_callback(stepping):
            del stepping.apply  # left by a fit that raised before on_train_end could restore it
        if sync.syncs(stepping):
            raise ValueError(
                f"the model's optimizer is already a {type(stepping).__name__}, which combines across "
                "processes itself: use either it or AdasumCallback, not both"
            )
        distributed.init()
        check_equal_steps(self.params)
        variables = list(model.trainable_variables)
        if not model.weights:
            raise ValueError(
                "AdasumCallback: the model has no weights yet (Keras builds a Sequential without an Input "
                "only in its first step), so there is nothing to combine: give it one, "
                "keras.Sequential([keras.Input(shape), ...]), or call model.build(input_shape) before fit"
            )
        if not optimizer.built:
            optimizer.build(variables)
        # The window's anchors (sync.start_window) and, with sync_every > 1, the weights as the last step
        # left them, outside the optimizer so that it saves as the user's own. Each fit starts a window
        # at its first batch, after every callback's on_train_begin (a BackupAndRestore restore).
        self._anchors = [
            tf.Variable(tf_variable(v), trainable=False, name="adasum_anchor") for v in variables
        ]
        lasts = (
            [tf.Variable(tf_variable(v), trainable=False, name="adasum_last") for v in variables]
            if self.sync_every > 1
            else None
        )
        self._lasts = lasts
        # The sync extends the optimizer that steps, so that a step mixed precision skips for overflow
        # skips the sync too. The skip is decided on every process at once (optimizer.finite_everywhere),
        # since the sync is a collective.
        anchors, local_step = self._anchors, stepping.apply
        every, distribution = self.sync_every, tf.distribute.get_strategy()

        def apply_then_sync(grads: list[Any], trainable_variables: list[Any] | None = None) -> None:
            sync.start_window(variables, anchors, stepping.iterations, every, lasts)
            local_step(grads, trainable_variables)
            stats = sync.sync_stats(stepping)  # an OrthogonalityMonitor's, if one asked
            sync.sync_if_due(distribution, variables, anchors, stepping.iterations, every, stats=stats)
            sync.record_lasts(variables, lasts)

        setattr(apply_then_sync, sync.SYNCS, True)
        stepping.apply = apply_then_sync
        self._optimizer = stepping
        self._started = False
        _retrace_with(model)  # a train function traced before (an earlier fit) would not sync

    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if not self._started:
            # After every on_train_begin, so that a state BackupAndRestore brought back is what counts.
            broadcast_model_and_optimizer(self.model, self.root, state_per_process=True)
            # This fit's first step opens a window, whatever the iteration count says.
            for anchor, variable in zip(self._anchors, self.model.trainable_variables, strict=True):
                anchor.assign(tf_variable(variable))
            if self._lasts is not None:
                for last, variable in zip(self._lasts, self.model.trainable_variables, strict=True):
                    last.assign(tf_variable(variable))
            self._started = True

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        agree_at_epoch_end(self.model, epoch, self._batches)

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        if self._optimizer is not None:
            del self._optimizer.apply  # the class's own apply again
            self._optimizer = None
            _retrace_without(self.model)


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Every process starts from rank `root_rank`'s model variables and optimizer state (Horovod's).

    Horovod broadcasts after the first batch, because TF1-era optimizers created their state during
    the first step. Keras 3 can build the optimizer before, so this broadcasts before the first batch
    (building the optimizer if Keras has not), and the first step already starts from the same weights
    everywhere; a model Keras builds only in its first step is broadcast after it. It also checks at
    train begin that every process will run the same number of batches per epoch. As
    broadcast_model_and_optimizer says, the optimizer state is broadcast at a fresh start and when only
    root resumed from a checkpoint (Horovod's `if hvd.rank() == 0: model = hvd.load_model(...)`);
    processes that all resumed at the same step keep their own.

    Args:
        root_rank: the rank whose values every process takes.
        local_variables: variables each worker keeps for itself (Horovod's; see
            DistributedOptimizer.register_local_var), which are not broadcast.
    """

    def __init__(self, root_rank: int, device: str = "", local_variables: Any = None) -> None:
        super().__init__()
        if device:
            raise ValueError(
                f"BroadcastGlobalVariablesCallback(device={device!r}) is not supported by tf_adasum"
            )
        self.root_rank = root_rank
        self.broadcast_done = False
        # Horovod's: variables (or one) that each worker keeps for itself, left out of the broadcast.
        if local_variables is None:
            local_variables = []
        self.local_variables = (
            list(local_variables) if isinstance(local_variables, list | tuple) else [local_variables]
        )

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        check_equal_steps(self.params)

    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        # At the first batch, after every on_train_begin (BackupAndRestore's restore among them). A model
        # Keras builds only in its first step (a Sequential without an Input) has no weights yet: then
        # after the first batch, as Horovod does, or each process would keep its own initialisation.
        if not self.broadcast_done and self.model.weights:
            self._broadcast()
            self.broadcast_done = True

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if not self.broadcast_done:
            self._broadcast()
            self.broadcast_done = True

    def _broadcast(self) -> None:
        per_process = isinstance(self.model.optimizer, AdasumOptimizer)  # Adasum after the optimizer
        broadcast_model_and_optimizer(self.model, self.root_rank, self.local_variables, per_process)


class MetricAverageCallback(_CountsBatches):
    """Averages the epoch's logs over processes at the end of every epoch (Horovod's).

    Put it before callbacks that read the logs (ReduceLROnPlateau, ModelCheckpoint, TensorBoard).
    AdasumStrategy already averages its logs; this is for one-process-per-worker scripts.
    """

    def __init__(self, device: str = "") -> None:
        super().__init__()
        if device:
            raise ValueError(f"MetricAverageCallback(device={device!r}) is not supported by tf_adasum")

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        logs = logs if logs is not None else {}
        agree_at_epoch_end(self.model, epoch, self._batches)
        # Sorted by name, as Horovod does, so every process reduces the same values in the same order.
        names = sorted(logs)
        averaged = average_logs({name: logs[name] for name in names})
        logs.update(averaged)


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """Horovod's BestModelCheckpoint: a ModelCheckpoint that keeps only the best model so far
    (save_best_only=True), written by rank 0 alone.

    Horovod's takes no file path (its Spark estimator sets one); here pass `filepath=` (a `.keras` path,
    or `.weights.h5` with save_weights_only=True), or set `.filepath` before fit. Put
    MetricAverageCallback before it, so that rank 0 judges the metric over every process.
    """

    def __init__(
        self,
        monitor: str = "val_loss",
        verbose: int = 0,
        save_weights_only: bool = False,
        mode: str = "auto",
        save_freq: Any = "epoch",
        filepath: str | None = None,
    ) -> None:
        # Keras checks the path's extension here; with none given, a placeholder passes that check.
        placeholder = "best.weights.h5" if save_weights_only else "best.keras"
        super().__init__(
            filepath=filepath or placeholder,
            monitor=monitor,
            verbose=verbose,
            save_best_only=True,
            save_weights_only=save_weights_only,
            mode=mode,
            save_freq=save_freq,
        )
        if filepath is None:
            self.filepath = None

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        if self.filepath is None:
            raise ValueError(
                "BestModelCheckpoint has no file to write: pass filepath='best.keras' (Horovod's Spark "
                "estimator sets it; a script must)"
            )
        super().on_train_begin(logs)

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if distributed.init().rank == 0:
            super().on_train_batch_end(batch, logs)

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if distributed.init().rank == 0:
            super().on_epoch_end(epoch, logs)


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Sets the learning rate to `initial_lr * multiplier(epoch)` (Horovod's schedule callback).

    Args:
        initial_lr: the base learning rate.
        multiplier: a constant (the rate becomes `initial_lr * multiplier ** (epoch - start_epoch)`, as
            in Horovod since 2021) or a function of the (fractional) epoch.
        start_epoch: the first epoch to adjust (inclusive).
        end_epoch: the epoch to stop adjusting at (exclusive); None for no end.
        staircase: adjust once at the start of each epoch; otherwise every batch, with a fractional epoch.
        momentum_correction: scale momentum by new_lr / old_lr for the batch in which the rate changes.
            Keras 3's SGD compiles its momentum (a Python float) into the train step, so it cannot be
            changed per batch; this then warns once and adjusts only the learning rate.
        steps_per_epoch: batches per epoch, for staircase=False; default what fit reports.

    Raises:
        ValueError: initial_lr is None, or the steps per epoch cannot be found for staircase=False.
    """

    def __init__(
        self,
        initial_lr: float,
        multiplier: float | Callable[[float], float],
        start_epoch: int = 0,
        end_epoch: int | None = None,
        staircase: bool = True,
        momentum_correction: bool = True,
        steps_per_epoch: int | None = None,
    ) -> None:
        super().__init__()
        if initial_lr is None:
            raise ValueError("Parameter `initial_lr` is required")
        self.initial_lr = initial_lr
        self.multiplier = (
            multiplier if callable(multiplier) else (lambda epoch: multiplier ** (epoch - start_epoch))
        )
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch: int = steps_per_epoch or 0
        self.current_epoch = 0

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = self.params.get("steps")
            if not self.steps_per_epoch:
                raise ValueError(
                    f"{type(self).__name__} could not find the number of steps per epoch: pass "
                    "steps_per_epoch to it (or to fit)"
                )
        stepping = _compat.loss_scale_inner(self.model.optimizer)
        momentum = getattr(stepping, "inner_optimizer", stepping).__dict__.get("momentum")
        if self.momentum_correction and isinstance(momentum, float) and momentum != 0:
            warnings.warn(
                f"{type(self).__name__}: momentum_correction cannot change the momentum of a Keras 3 "
                "optimizer, a Python float compiled into the train step; only the learning rate is "
                "adjusted. Pass momentum_correction=False to silence this.",
                stacklevel=2,
            )

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.current_epoch = epoch

    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if self.current_epoch < self.start_epoch or (
            self.end_epoch is not None and self.current_epoch >= self.end_epoch
        ):
            return
        if self.staircase and batch == 0:
            self._set_learning_rate(self.current_epoch)
        elif not self.staircase:
            self._set_learning_rate(self.current_epoch + float(batch) / self.steps_per_epoch)

    def _set_learning_rate(self, epoch: float) -> None:
        self.model.optimizer.learning_rate = self.initial_lr * self.multiplier(epoch)

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if logs is not None:
            logs["lr"] = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Ramps the learning rate from `initial_lr / size` to `initial_lr` over `warmup_epochs` (Horovod's).

    Horovod's recipe (Goyal et al., arXiv 1706.02677) for a learning rate scaled by the number of
    workers. With Adasum you usually need no scaling and no warm-up; it is here so that Horovod scripts
    run unchanged. At the last batch of the warm-up the rate is exactly `initial_lr`.

    Args:
        initial_lr: the learning rate at the end of the warm-up.
        warmup_epochs: how many epochs the warm-up lasts.
        momentum_correction: as for LearningRateScheduleCallback.
        steps_per_epoch: batches per epoch; default what fit reports.
        verbose: 1 prints a line on rank 0 when the warm-up ends.
    """

    def __init__(
        self,
        initial_lr: float,
        warmup_epochs: int = 5,
        momentum_correction: bool = True,
        steps_per_epoch: int | None = None,
        verbose: int = 0,
    ) -> None:
        def multiplier(epoch: float) -> float:
            # Shifted by one batch so that the last batch of every epoch lands on a round number.
            epoch += 1.0 / self.steps_per_epoch
            size = distributed.size()
            return 1.0 / size * (epoch * (size - 1) / warmup_epochs + 1)

        super().__init__(
            initial_lr,
            multiplier,
            start_epoch=0,
            end_epoch=warmup_epochs,
            staircase=False,
            momentum_correction=momentum_correction,
            steps_per_epoch=steps_per_epoch,
        )
        self.verbose = verbose
        self.warmup_epochs = warmup_epochs

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        super().on_epoch_end(epoch, logs)
        if epoch == self.warmup_epochs - 1 and self.verbose > 0 and distributed.rank() == 0:
            rate = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to {rate:g}.")


class OrthogonalityMonitor(keras.callbacks.Callback):
    """Reports, per trainable variable, how orthogonal the replicas' updates were at the last sync.

    The value is `|adasum(d_1, ..., d_n)|^2 / sum_i |d_i|^2` over the n replicas (of every process) and
    their deltas d_i since the previous sync: 1 when the updates were orthogonal, where Adasum adds
    them; 1/n when they were all equal, where Adasum returns one of them; between for a mix. It is the
    paper's Figure 1 diagnostic: how much of the extra replicas' work Adasum keeps.

    Every `every` optimizer steps, and at each epoch end, the values go into `logs` as
    `orthogonality/<variable path>`, with their mean over variables as `orthogonality`;
    `history` keeps (step, values) for every report. A keras.callbacks.TensorBoard placed after this
    callback in the list writes them as scalars. Works under AdasumStrategy, with AdasumOptimizer
    (tf_adasum.keras.DistributedOptimizer(op=Adasum)), and with AdasumCallback. Across processes, add it
    on every process: the recording joins a collective at every sync (a process without one is named in
    a PeerError at train begin).

    Cost: the syncs record two squared norms per variable (one pass over each delta and over the
    result) and, across processes, all-reduce one float64 per variable; the updates themselves are not
    reduced a second time.

    Args:
        every: optimizer steps between two reports in the batch logs.

    Example:
        >>> model.fit(x, y, callbacks=[tf_adasum.callbacks.OrthogonalityMonitor(every=100)])
    """

    def __init__(self, every: int = 100) -> None:
        super().__init__()
        self.every = sync.check_positive_integer("every", every)
        self.history: list[tuple[int, dict[str, float]]] = []
        self._stats: Any = None
        self._optimizer: Any = None
        self._next = every

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        model = self.model
        comm = distributed.init()
        if comm.size > 1:
            # The recording adds a collective to every sync: a process without a monitor would not join
            # it. Meeting here first turns that into an error at train begin, naming the missing rank.
            agreement.gather_objects(
                comm, "monitor", "OrthogonalityMonitor start (add the monitor on every process)"
            )
        self._optimizer = _compat.loss_scale_inner(model.optimizer)
        with model.distribute_strategy.scope():
            self._stats = sync.SyncStats(list(model.trainable_variables))
        sync.enable_sync_stats(self._optimizer, self._stats)
        _retrace_with(model)  # one traced before would not record
        self._next = (int(model.optimizer.iterations.numpy()) // self.every + 1) * self.every

    def values(self) -> dict[str, float]:
        """The orthogonality of each variable at the last sync, and their mean; empty before any sync."""
        if self._stats is None or int(self._stats.syncs.numpy()) == 0:
            return {}
        deltas = self._stats.deltas_sq.numpy()
        combined = self._stats.combined_sq.numpy()
        out = {}
        for name, d, c in zip(self._stats.names, deltas, combined, strict=True):
            if d > 0:  # a variable that did not move has no direction
                out[f"orthogonality/{name}"] = float(c / d)
        if out:
            out["orthogonality"] = float(np.mean(list(out.values())))
        return out

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        step = int(self.model.optimizer.iterations.numpy())
        if step < self._next:
            return
        self._next = (step // self.every + 1) * self.every  # steps_per_execution may jump past a multiple
        values = self.values()
        if values:
            self.history.append((step, values))
            if logs is not None:
                logs.update(values)

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        values = self.values()
        if not values:
            warnings.warn(
                "OrthogonalityMonitor has seen no Adasum sync that moved a variable in this fit: train "
                "under AdasumStrategy, with AdasumOptimizer, or with AdasumCallback",
                stacklevel=2,
            )
        elif logs is not None:
            logs.update(values)

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        if self._optimizer is not None:
            sync.enable_sync_stats(self._optimizer, None)
            _retrace_without(self.model)
            self._optimizer = None
