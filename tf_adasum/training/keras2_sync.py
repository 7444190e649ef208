"""The model sync on a tf_keras (Keras 2) optimizer, for AdasumCallback on a tf_keras model.

Keras 3's optimizers step through `apply`; tf_keras's, both its optimizers and its legacy OptimizerV2,
through `apply_gradients(grads_and_vars, ...)`, which its train step calls. AdasumCallback extends that
method on the user's own optimizer, during fit, with the sync every entry point runs
(model_sync.start_window before the step, sync_if_due and record_lasts after it), and puts the class's
own back at the end of fit, so the model saves and loads as plain tf_keras.

Where tf_keras's step cannot carry the sync exactly, the optimizer is refused before the first step:
- a LossScaleOptimizer (mixed precision) skips an overflowed step on the process that overflowed only,
  and the others would wait for it at the sync;
- use_ema updates the moving average inside the step, before the sync, so it would follow the
  process's own weights and not the synced ones.
"""

from __future__ import annotations

import inspect
import sys
import warnings
from collections.abc import Callable
from typing import Any

import tensorflow as tf

from tf_adasum.training import model_sync

_APPLY = "apply_gradients"


def check_keras_2_optimizer(model: Any, optimizer: Any) -> None:
    """Raises ValueError where AdasumCallback cannot sync this tf_keras model's optimizer exactly, and
    turns XLA off (XLA has no kernels for tf_adasum's ops) with a warning."""
    if optimizer is None:
        raise ValueError("AdasumCallback: the tf_keras model has no optimizer: compile it first")
    mixed_precision = sys.modules["tf_keras"].mixed_precision
    if isinstance(optimizer, mixed_precision.LossScaleOptimizer):
        raise ValueError(
            "AdasumCallback: a tf_keras LossScaleOptimizer (mixed precision) is not served under tf_keras: "
            "a process that overflowed would skip its step alone while the others wait for it at the sync. "
            "Train in float32 under tf_keras, or use Keras 3, where AdasumCallback decides the skip on "
            "every process at once"
        )
    if getattr(optimizer, "use_ema", False):
        raise ValueError(
            f"AdasumCallback: {type(optimizer).__name__}(use_ema=True) under tf_keras updates the moving "
            "average inside its step, before the sync, so it would follow this process's weights, not the "
            "synced ones. Use use_ema=False under tf_keras, or Keras 3, where the sync comes before it"
        )
    if getattr(model, "jit_compile", False):
        warnings.warn(
            "tf_adasum: compiling this model's train step without XLA (jit_compile=False): XLA cannot "
            "compile tf_adasum's ops and collectives",
            stacklevel=3,
        )
        model.jit_compile = False


def extend_with_sync(
    optimizer: Any,
    variables: list[Any],
    window: tuple[list[Any], list[Any] | None],
    sync_every: int,
    sync: tuple[str, Any, str] = ("none", None, "adasum"),
) -> None:
    """Extends this tf_keras optimizer's apply_gradients with the sync, until end_sync: the window's
    (anchors, lasts), and the sync's (compression, outer optimizer, combine)."""
    original = getattr(optimizer, _APPLY)

    def apply_then_sync(grads_and_vars: Any, *args: Any, **kwargs: Any) -> Any:
        step = lambda: original(grads_and_vars, *args, **kwargs)  # noqa: E731
        return step_in_window(optimizer, step, variables, window, sync_every, *sync)

    setattr(apply_then_sync, model_sync.SYNCS, True)
    setattr(optimizer, _APPLY, apply_then_sync)


def step_in_window(
    optimizer: Any,
    step: Callable[[], Any],
    variables: list[Any],
    window: tuple[list[Any], list[Any] | None],
    sync_every: int,
    compression: str = "none",
    outer: Any = None,
    combine: str = "adasum",
) -> Any:
    """The optimizer's `step`, in a window of sync_every local steps (without a strategy): the window's
    anchors taken before it (model_sync.start_window), the sync after it when due (with `outer`, the
    outer optimizer's step), the weights it left recorded. Returns what the step returned."""
    anchors, lasts = window
    before = tf.identity(optimizer.iterations)
    model_sync.start_window(variables, anchors, before, sync_every, lasts)
    result = step()
    stats = model_sync.sync_stats(optimizer)  # an OrthogonalityMonitor's, if one asked
    distribution = tf.distribute.get_strategy()
    model_sync.sync_if_due(
        distribution, variables, anchors, before + 1, sync_every, compression, stats, outer, combine
    )
    model_sync.record_lasts(variables, lasts)
    return result


def window_variables(
    optimizer: Any, variables: list[Any], sync_every: int, strategy: Any = None
) -> tuple[list[Any], list[Any] | None]:
    """The anchors (and, with windows of several steps, the last weights) of this optimizer's windows over
    these variables, made once, eagerly, under `strategy` (the current one by default): one value per
    replica, as the variables have."""
    key = tuple(id(v) for v in variables)
    windows = optimizer.__dict__.setdefault("_tf_adasum_windows", {})
    if key not in windows:
        with tf.init_scope(), (strategy or tf.distribute.get_strategy()).scope():
            anchors = [tf.Variable(v, trainable=False, name="adasum_anchor") for v in variables]
            lasts = (
                [tf.Variable(v, trainable=False, name="adasum_last") for v in variables]
                if sync_every > 1
                else None
            )
        windows[key] = (anchors, lasts)
    return windows[key]


def extended(optimizer: Any) -> bool:
    """Whether AdasumCallback has extended this tf_keras optimizer (a fit that raised leaves it so)."""
    return getattr(vars(optimizer).get(_APPLY), model_sync.SYNCS, False)


def end_sync(optimizer: Any) -> None:
    """The class's own apply_gradients again."""
    if extended(optimizer):
        delattr(optimizer, _APPLY)


# --- under AdasumStrategy ---------------------------------------------------------------------------


def _refuse_under_strategy(optimizer: Any) -> None:
    name = type(optimizer).__name__
    if hasattr(optimizer, "_tf_adasum_op"):
        raise ValueError(
            "AdasumStrategy: the optimizer is tf_adasum.keras's DistributedOptimizer, which combines across "
            f"processes itself: compile the plain tf_keras {name} under the strategy's scope instead"
        )
    if getattr(optimizer, "use_ema", False):
        raise ValueError(
            f"AdasumStrategy: {name}(use_ema=True) under tf_keras updates the moving average inside its "
            "step, before the sync. Use use_ema=False under tf_keras, or Keras 3, where the sync comes first"
        )
    refuse_mixed_precision("AdasumStrategy", "replica")
    if getattr(tf.distribute.get_strategy(), "outer_optimizer", None) is not None:
        raise ValueError(
            "AdasumStrategy(outer_optimizer=...): the outer optimizer is a Keras 3 optimizer, which steps "
            "Keras 3 models only, and this model is tf_keras's. For a tf_keras model's local steps with "
            "an outer optimizer, use AdasumCallback(sync_every=..., outer_optimizer=tf.keras.optimizers."
            "SGD(...)), one process per worker, or Keras 3; or drop outer_optimizer (sync_every and "
            "combine serve tf_keras under the strategy)"
        )


def refuse_mixed_precision(who: str, where: str) -> None:
    """Raises ValueError under tf_keras's mixed precision: its LossScaleOptimizer skips an overflowed
    step on the `where` (replica, process) that overflowed only, while the others would meet it in the
    sync's collective."""
    policy = sys.modules["tf_keras"].mixed_precision.global_policy()
    if policy.compute_dtype != policy.variable_dtype:
        raise ValueError(
            f"{who}: tf_keras's mixed precision (policy {policy.name}) is not served: its loss scale skips "
            f"an overflowed step on the {where} that overflowed only, while the others would wait for it "
            "in the sync. Train in float32 under tf_keras, or use Keras 3, where the skip is decided "
            "everywhere at once"
        )


def step_under_adasum_strategy(
    optimizer: Any, own_step: Any, grads_and_vars: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """A tf_keras optimizer's apply_gradients (every one, through _compat.install_keras_2_step_route):
    under an AdasumStrategy, in replica context, each replica takes the single-worker step with its own
    optimizer state, and every `sync_every` steps the deltas are combined (model_sync); anywhere else,
    the optimizer's own step.

    Each replica steps on its own gradient: tf_keras is asked not to sum them (skip_gradients_aggregation,
    or experimental_aggregate_gradients=False for its legacy optimizers), and its update then runs per
    replica, each on its own copy of the variables and of the optimizer's slots (MirroredStrategy's
    update writes one replica's copy at a time). The gradients are multiplied by the number of replicas
    in sync: tf_keras's fit divides the loss by it, as TensorFlow's custom loops do.
    """
    strategy = tf.distribute.get_strategy()
    if not getattr(strategy, model_sync.SYNCS, False) or tf.distribute.in_cross_replica_context():
        return own_step(optimizer, grads_and_vars, *args, **kwargs)
    _refuse_under_strategy(optimizer)
    context = tf.distribute.get_replica_context()
    factor = context.num_replicas_in_sync
    pairs = [(g if g is None else g * tf.cast(factor, g.dtype), v) for g, v in grads_and_vars]
    variables = [v for _, v in pairs]
    every = strategy.sync_every
    anchors, lasts = context.merge_call(lambda s: window_variables(optimizer, variables, every, s))
    before = context.merge_call(lambda s: tf.identity(optimizer.iterations))

    def open_window(s: Any) -> None:
        model_sync.start_window(variables, anchors, before, every, lasts)

    context.merge_call(open_window)
    if "skip_gradients_aggregation" in inspect.signature(own_step).parameters:
        kwargs = {**kwargs, "skip_gradients_aggregation": True}
    else:
        kwargs = {**kwargs, "experimental_aggregate_gradients": False}
    result = own_step(optimizer, pairs, *args, **kwargs)

    def sync(s: Any) -> None:
        stats = model_sync.sync_stats(optimizer)  # an OrthogonalityMonitor's, if one asked
        model_sync.sync_if_due(
            s, variables, anchors, before + 1, every, strategy.compression, stats, combine=strategy.combine
        )
        model_sync.record_lasts(variables, lasts)

    context.merge_call(sync)
    return result
