"""Keras's optimizer options under Adasum: each keeps what it means on one worker, or is refused.

Every replica (or process) runs the inner Keras optimizer on its own gradient with its own state, and
then the deltas are combined (model_sync). For the options that read or write the weights:

- clipnorm, clipvalue, global_clipnorm: each replica clips its own gradient, as one worker clips its
  batch's; the global norm is over that replica's gradients.
- weight_decay, exclude_from_weight_decay: inside each local step, as on one worker; the sync combines
  the decayed steps.
- learning-rate schedules: read the inner optimizer's count of steps, the same on every replica.
- gradient_accumulation_steps (A): each replica accumulates its own gradients (its accumulators are
  optimizer state, per replica as momentum is); the weights move at every A-th step, and the sync comes
  with every `sync_every`-th such update: every sync_every * A steps (sync_period).
- use_ema: the moving average follows the synced weights. The sync runs inside the inner optimizer's
  step, just before Keras updates the average (step_then_sync), so the average, its overwrite
  (ema_overwrite_frequency), SwapEMAWeights and the end of fit see the same weights everywhere.

Refused (check), with what to do instead:
- use_ema with sync_every > 1: between syncs the replicas hold different weights, so there is no one
  model whose weights to average.
- under a tf.distribute strategy, gradient_accumulation_steps and ema_overwrite_frequency: Keras applies
  them inside a tf.cond, where a strategy's cross-replica update cannot run; MirroredStrategy fails at
  the first step ("merge_call called while defining a new graph").
- with AdasumCallback, a second plain optimizer in the train step (refuse_unsynced_optimizer): the
  callback combines the steps of the model's optimizer only.

Horovod's own option, backward_passes_per_step for an all-reduce of gradients (AllreduceOptimizer, and
the Horovod face under tf_keras), is accumulate_then_step.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import tensorflow as tf

from tf_adasum import _compat
from tf_adasum.algorithm.tensor_lists import dense


def check(optimizer: Any, sync_every: int, setting: str = "sync_every") -> None:
    """Raises ValueError for an option of `optimizer` that cannot keep its meaning with `sync_every`
    local steps between syncs (`setting`: the argument that set them, for the message), here: under
    the current tf.distribute strategy, if any."""
    name = f"optimizer {getattr(optimizer, 'name', '?')!r} ({type(optimizer).__name__})"
    ema = bool(getattr(optimizer, "use_ema", False))
    if ema:
        _compat.require("moving average")
    if ema and sync_every > 1:
        raise ValueError(
            f"{name} has use_ema=True, with {setting}={sync_every}: the moving average must follow the "
            "weights every replica agrees on, and between two syncs the replicas hold different weights. "
            f"Use {setting}=1 (a sync after every optimizer step), or use_ema=False"
        )
    if not tf.distribute.has_strategy():
        return
    strategy = type(tf.distribute.get_strategy()).__name__
    options = {"gradient_accumulation_steps": getattr(optimizer, "gradient_accumulation_steps", None)}
    if ema:
        options["ema_overwrite_frequency"] = getattr(optimizer, "ema_overwrite_frequency", None)
    for option, value in options.items():
        if value:
            raise ValueError(
                f"{name} has {option}={value}, which Keras cannot run under a tf.distribute strategy "
                f"({strategy}): it applies it inside a tf.cond, where the strategy's cross-replica update "
                'cannot run (MirroredStrategy fails at the first step with "merge_call called while '
                f'defining a new graph"). Leave {option} unset under {strategy}, or start one process per '
                "device with tf_adasum.AdasumCallback or tf_adasum.keras, where it keeps its meaning"
            )


def sync_period(optimizer: Any, sync_every: int) -> int:
    """The optimizer steps between two syncs: sync_every updates of the weights, each
    gradient_accumulation_steps steps apart where that is set."""
    return sync_every * (getattr(optimizer, "gradient_accumulation_steps", None) or 1)


def steps_so_far(optimizer: Any) -> tf.Tensor:
    """The optimizer's steps before the one being taken, read now: every apply, as the learning-rate
    schedule counts them (with gradient_accumulation_steps, Keras's `iterations` counts updates only)."""
    return tf.convert_to_tensor(_compat.applies(optimizer))


def step_then_sync(optimizer: Any, step: Callable[[], None], sync: Callable[[], None]) -> None:
    """Runs step(), the optimizer's local step, then sync().

    With use_ema, sync() runs inside the step instead, after the update of the weights and just before
    Keras updates their moving average: the average then follows the synced weights, as one worker's
    follows its own, and is the same on every replica and process. Where Keras updates no average (no
    gradient at all), the sync comes after the step.
    """
    if not getattr(optimizer, "use_ema", False):
        step()
        sync()
        return
    with _compat.running_before_the_moving_average(optimizer, sync) as before_the_average:
        step()
    if not before_the_average.ran:
        sync()


class _CallbackSteps(threading.local):
    def __init__(self) -> None:
        self.synced: Any = None


_CALLBACK_STEPS = _CallbackSteps()


@contextlib.contextmanager
def callback_steps(synced: Any) -> Iterator[None]:
    """Marks this thread, while it runs (or traces) a train function, as in a step AdasumCallback syncs
    through the optimizer `synced` (refuse_unsynced_optimizer reads the mark)."""
    outer, _CALLBACK_STEPS.synced = _CALLBACK_STEPS.synced, synced
    try:
        yield
    finally:
        _CALLBACK_STEPS.synced = outer


def refuse_unsynced_optimizer(optimizer: Any) -> None:
    """Raises where a plain optimizer steps in a train step whose model AdasumCallback syncs through
    another optimizer: the callback combines only that one's steps, and this one's variables would drift
    apart across processes. (A tf_adasum wrapper's inner optimizer never gets here: strategy.adasum_for
    runs its wrapper's step, which syncs.)"""
    synced = _CALLBACK_STEPS.synced
    if synced is None or optimizer is synced or optimizer is _compat.attached_outer(synced):
        return  # the model's optimizer, or the outer optimizer its syncs step
    kind = type(optimizer).__name__
    raise ValueError(
        f"AdasumCallback combines the steps of the model's optimizer {synced.name!r}, but optimizer "
        f"{optimizer.name!r} ({kind}) steps in this train step too, and its steps would not be combined "
        f"across processes: wrap it, `tf_adasum.AdasumOptimizer(keras.optimizers.{kind}(...))`, and step "
        "the wrapper"
    )


def accumulate_then_step(
    accumulators: list[Any],
    gradients: list[Any],
    iterations: Any,
    passes: int,
    average: bool,
    step: Callable[[list[Any]], None],
) -> None:
    """Horovod's gradient accumulation (its LocalGradientAggregationHelper), under Keras 3 and tf_keras:
    each gradient added to its accumulator on this process; at every `passes`-th pass, counted by
    `iterations`, step(sums) (divided by `passes` when `average`; None where a gradient is None) and
    the accumulators cleared; on the other passes only `iterations` moves, so that Adam's bias
    correction counts passes. `step` moves `iterations` itself, as an optimizer's step does."""
    for accumulator, g in zip(accumulators, gradients, strict=True):
        if g is not None:
            accumulator.assign_add(tf.cast(dense(g), accumulator.dtype))

    def reduce_and_step() -> tf.Tensor:
        step(
            [
                None if g is None else tf.identity(a) / passes if average else tf.identity(a)
                for a, g in zip(accumulators, gradients, strict=True)
            ]
        )
        for accumulator in accumulators:
            accumulator.assign(tf.zeros_like(accumulator))
        return tf.constant(True)

    def count_the_pass() -> tf.Tensor:
        iterations.assign_add(1)
        return tf.constant(False)

    tf.cond(tf.equal(tf.math.floormod(iterations + 1, passes), 0), reduce_and_step, count_the_pass)
