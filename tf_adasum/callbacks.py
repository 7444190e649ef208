"""Keras callbacks for scripts that run one process per worker (mpirun, horovodrun, tf_adasum.run).

- AdasumCallback: the one line that turns a plain Keras script into Adasum data parallelism.
- OrthogonalityMonitor: how orthogonal the replicas' updates were, per layer (the paper's Figure 1).
- BroadcastGlobalVariablesCallback, MetricAverageCallback, LearningRateWarmupCallback and
  LearningRateScheduleCallback: Horovod's callbacks (horovod/_keras/callbacks.py), for Keras 3.

The broadcast of weights, the averaging of logs and of BatchNorm statistics live here once;
AdasumOptimizer and AdasumStrategy call the same functions.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tf_adasum import _compat, agreement, distributed
from tf_adasum.comm.base import UnevenDataError


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


def tf_variable(variable: Any) -> Any:
    """The TensorFlow (possibly distributed) variable behind a Keras variable."""
    return variable.value if isinstance(variable, keras.Variable) else variable


def broadcast_model_and_optimizer(model: keras.Model, root: int) -> None:
    """Every process takes rank `root`'s model variables, and its optimizer state at a fresh start.

    Horovod broadcasts the optimizer state too, which is the same on every process when gradients are
    averaged before the optimizer. With Adasum after the optimizer each process's optimizer state is its
    own, and a run resumed from per-process checkpoints (BackupAndRestore) must keep it: so the state is
    broadcast only when no process has taken a step yet, and otherwise every process must be at the same
    step.

    Raises:
        ValueError: the processes' optimizers are at different steps.
    """
    broadcast_variables(model.variables, root)
    optimizer = model.optimizer
    if optimizer is None or not optimizer.built:
        return
    steps = distributed.init().allgather_object(int(optimizer.iterations.numpy()), "optimizer step check")
    if not any(steps):
        broadcast_variables(optimizer.variables, root)
    elif len(set(steps)) > 1:
        counts = ", ".join(f"rank {r}: {s}" for r, s in enumerate(steps))
        raise ValueError(
            f"the processes' optimizers are at different steps ({counts}): resume every process from a "
            "checkpoint of the same step"
        )


def average_logs(logs: Any) -> Any:
    """The mean over processes of every floating scalar in `logs`, in one collective.

    Works on Keras's logs both inside a compiled step (tensors) and between steps (Python floats or
    numpy scalars); other entries pass through. Returns logs of the same structure and types.
    """
    comm = distributed.init()
    if comm.size == 1:
        return logs
    flat = tf.nest.flatten(logs)
    index = [i for i, v in enumerate(flat) if _is_float_scalar(v)]
    if not index:
        return logs
    values = tf.stack([tf.cast(flat[i], tf.float64) for i in index])
    mean = distributed.allreduce(values, op=distributed.Average)
    for j, i in enumerate(index):
        if isinstance(flat[i], tf.Tensor):
            flat[i] = tf.cast(mean[j], flat[i].dtype)
        else:
            flat[i] = type(flat[i])(mean[j].numpy())
    return tf.nest.pack_sequence_as(logs, flat)


def average_state_over_processes(variables: Sequence[Any]) -> None:
    """Assigns to each floating variable its mean over processes (BatchNorm's moving statistics).

    AdasumStrategy runs this after every train step across processes, as MirroredStrategy averages
    non-trainable state over its replicas.
    """
    state = [v for v in variables if v.dtype in ("float16", "bfloat16", "float32", "float64")]
    if not state or distributed.init().size == 1:
        return
    means = distributed.allreduce([v.value for v in state], op=distributed.Average)
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
    steps = comm.allgather_object(params.get("steps"), "steps-per-epoch check")
    if any(s is not None for s in steps) and len(set(steps)) > 1:
        counts = ", ".join(f"rank {r}: {s}" for r, s in enumerate(steps))
        raise UnevenDataError(
            f"the ranks would run different numbers of batches per epoch ({counts}): give every rank the "
            "same number of batches (equal shards, drop_remainder=True), or pass steps_per_epoch to fit"
        )


# The last epoch whose end each model's processes agreed on: several callbacks may ask, once counts.
_epochs_agreed: weakref.WeakKeyDictionary[keras.Model, int] = weakref.WeakKeyDictionary()


def agree_at_epoch_end(model: keras.Model, epoch: int, batches: int) -> None:
    """Every process checks that all ended this epoch after the same number of batches.

    A process that ran out of data meets the others' next model sync here, so every rank raises
    UnevenDataError instead of waiting for a peer that will never come.
    """
    comm = distributed.init()
    if comm.size == 1 or _epochs_agreed.get(model) == epoch:
        return
    _epochs_agreed[model] = epoch
    agreement.agree(comm, agreement.EPOCH_END, batches, "epoch-end check")


class _CountsBatches(keras.callbacks.Callback):
    """Counts the batches of the current epoch, for the epoch-end agreement."""

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        _epochs_agreed.pop(self.model, None)  # a new fit counts its epochs from its initial epoch again

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
        from tf_adasum.optimizer import check_sync_every  # optimizer.py imports this module

        super().__init__()
        check_sync_every(sync_every)
        # Mixed precision's skip decision must be global, and errors inside steps translated.
        _compat.require("LossScaleOptimizer.check_finite", "train_step / test_step")
        if not isinstance(root, int) or root < 0:
            raise ValueError(f"root must be a rank (a non-negative integer), got {root!r}")
        self.sync_every = sync_every
        self.root = root
        self._optimizer: keras.optimizers.Optimizer | None = None

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        # Imported here: optimizer.py imports this module for broadcast_variables.
        from tf_adasum.optimizer import WrappedOptimizer, sync_if_due, sync_stats

        super().on_train_begin(logs)
        model, optimizer = self.model, self.model.optimizer
        if model.distribute_strategy is not tf.distribute.get_strategy() or tf.distribute.has_strategy():
            raise ValueError(
                "AdasumCallback is for one process per worker without a tf.distribute strategy; under a "
                f"strategy ({type(model.distribute_strategy).__name__}) use tf_adasum.AdasumStrategy instead"
            )
        stepping = _compat.loss_scale_inner(optimizer)  # under mixed_float16, inside a LossScaleOptimizer
        if isinstance(stepping, WrappedOptimizer):
            raise ValueError(
                f"the model's optimizer is already a {type(stepping).__name__}, which combines across "
                "processes itself: use either it or AdasumCallback, not both"
            )
        if syncs_in_apply(stepping):
            del stepping.apply  # left by a fit that raised before on_train_end could restore it
        distributed.init()
        check_equal_steps(self.params)
        variables = list(model.trainable_variables)
        if not optimizer.built:
            optimizer.build(variables)
        # The weights as of the last sync, outside the optimizer so that it saves as the user's own.
        # They get their values at the first batch, after every callback's on_train_begin.
        self._anchors = [
            tf.Variable(tf_variable(v), trainable=False, name="adasum_anchor") for v in variables
        ]
        # The sync extends the optimizer that steps, so that a step mixed precision skips for overflow
        # skips the sync too. The skip is decided on every process at once (optimizer.finite_everywhere),
        # since the sync is a collective.
        anchors, local_step = self._anchors, stepping.apply
        every, distribution = self.sync_every, tf.distribute.get_strategy()

        def apply_then_sync(grads: list[Any], trainable_variables: list[Any] | None = None) -> None:
            local_step(grads, trainable_variables)
            stats = sync_stats(stepping)  # an OrthogonalityMonitor's, if one asked
            sync_if_due(distribution, variables, anchors, stepping.iterations, every, stats=stats)

        apply_then_sync._tf_adasum_sync = True  # type: ignore[attr-defined]
        stepping.apply = apply_then_sync
        self._optimizer = stepping
        self._started = False
        # A train function traced before (an earlier fit) would not contain the sync.
        model.make_train_function(force=True)

    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if not self._started:
            # After every on_train_begin, so that a state BackupAndRestore brought back is what counts.
            broadcast_model_and_optimizer(self.model, self.root)
            for anchor, variable in zip(self._anchors, self.model.trainable_variables, strict=True):
                anchor.assign(tf_variable(variable))
            self._started = True

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        agree_at_epoch_end(self.model, epoch, self._batches)

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        if self._optimizer is not None:
            del self._optimizer.apply  # the class's own apply again
            self._optimizer = None
            self.model.train_function = None  # the next fit traces one without the sync

    def get_config(self) -> dict[str, Any]:
        return {"sync_every": self.sync_every, "root": self.root}


def syncs_in_apply(optimizer: keras.optimizers.Optimizer) -> bool:
    """Whether AdasumCallback has extended this optimizer's apply with the sync (during fit)."""
    return getattr(vars(optimizer).get("apply"), "_tf_adasum_sync", False)


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Every process starts from rank `root_rank`'s model variables and optimizer state (Horovod's).

    Horovod broadcasts after the first batch, because TF1-era optimizers created their state during
    the first step. Keras 3 builds the optimizer before training starts, so this broadcasts before the
    first batch, and the first step already starts from the same weights everywhere. It also checks at
    train begin that every process will run the same number of batches per epoch. As
    broadcast_model_and_optimizer says, the optimizer state is broadcast only at a fresh start.

    Args:
        root_rank: the rank whose values every process takes.
    """

    def __init__(self, root_rank: int, device: str = "") -> None:
        super().__init__()
        if device:
            raise ValueError(
                f"BroadcastGlobalVariablesCallback(device={device!r}) is not supported by tf_adasum"
            )
        self.root_rank = root_rank
        self.broadcast_done = False

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        check_equal_steps(self.params)

    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        # At the first batch, after every on_train_begin (BackupAndRestore's restore among them).
        if not self.broadcast_done:
            broadcast_model_and_optimizer(self.model, self.root_rank)
            self.broadcast_done = True


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


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Sets the learning rate to `initial_lr * multiplier(epoch)` (Horovod's schedule callback).

    Args:
        initial_lr: the base learning rate.
        multiplier: a constant (the rate becomes `initial_lr * multiplier ** epoch`) or a function of
            the (fractional) epoch.
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
        self.multiplier = multiplier if callable(multiplier) else (lambda epoch: multiplier**epoch)
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
        from tf_adasum.optimizer import positive_integer  # optimizer.py imports this module

        super().__init__()
        self.every = positive_integer("every", every)
        self.history: list[tuple[int, dict[str, float]]] = []
        self._stats: Any = None
        self._optimizer: Any = None
        self._next = every

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        from tf_adasum.optimizer import SyncStats, enable_sync_stats

        model = self.model
        comm = distributed.init()
        if comm.size > 1:
            # The recording adds a collective to every sync: a process without a monitor would not join
            # it. Meeting here first turns that into an error at train begin, naming the missing rank.
            comm.allgather_object("monitor", "OrthogonalityMonitor start (add the monitor on every process)")
        self._optimizer = _compat.loss_scale_inner(model.optimizer)
        with model.distribute_strategy.scope():
            self._stats = SyncStats(list(model.trainable_variables))
        enable_sync_stats(self._optimizer, self._stats)
        model.make_train_function(force=True)  # one traced before would not record
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
        from tf_adasum.optimizer import enable_sync_stats

        if self._optimizer is not None:
            enable_sync_stats(self._optimizer, None)
            self.model.train_function = None  # the next fit traces one without the recording
            self._optimizer = None
