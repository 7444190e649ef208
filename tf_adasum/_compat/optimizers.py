"""Hooks into Keras's optimizers.

`optimizers.get`
    keras.src.optimizers.get, which Trainer.compile resolves optimizers through. tf_adasum replaces it
    once, and the public keras.optimizers.get with it, so that a plain optimizer compiled under an
    AdasumStrategy's scope becomes an AdasumOptimizer.
`_all_reduce_sum_gradients`
    TFOptimizer's cross-replica gradient sum, switched off on an AdasumOptimizer's inner optimizer so
    that each replica steps on its own gradient, and guarded everywhere else: under an AdasumStrategy a
    plain optimizer that reaches it raises instead of averaging (install_gradient_sum_guard).
`Optimizer.apply`
    BaseOptimizer.apply, which apply_gradients steps through. Under an AdasumStrategy, a plain Keras
    optimizer's step in a strategy.run loop runs as an AdasumOptimizer's (install_optimizer_apply).
`_distribution_strategy`
    the strategy an optimizer was created under (read to refuse a build under another one).
`LossScaleOptimizer.check_finite`
    the finiteness decision of mixed precision. Keras takes it from the first replica, since its
    gradients are all-reduced; Adasum's are not, so tf_adasum makes it global.
`optimizer variables`
    BaseOptimizer's own variable lists and index (`_variables`, `_trainable_variables`,
    `_get_variable_index`), which the wrappers read to find a variable's slots, and the tracking of a
    child (`_track_trackable`), through which checkpoints find the inner optimizer.
`_iterations`
    BaseOptimizer's count of its applies. With gradient_accumulation_steps, Keras's `iterations` counts
    only the updates; the syncs are timed by every apply, as the learning-rate schedule is.
`moving average`
    BaseOptimizer's update of the moving average of the weights (use_ema), called in its step after the
    update: tf_adasum runs the sync just before it, so that the average follows the synced weights; and
    where SwapEMAWeights looks for the averages (`_model_variables_moving_average`), one wrapper deep.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import keras
import tensorflow as tf

from tf_adasum._compat.registry import hook_problem, mark, register, replaced, require, uses


def _tf_optimizer() -> Any:
    from keras.src.backend.tensorflow.optimizer import TFOptimizer

    return TFOptimizer


def _base_optimizer() -> Any:
    from keras.src.optimizers.base_optimizer import BaseOptimizer

    return BaseOptimizer


def _swap_ema_weights() -> Any:
    from keras.src.callbacks.swap_ema_weights import SwapEMAWeights

    return SwapEMAWeights


def _loss_scale_optimizer() -> Any:
    from keras.src.optimizers.loss_scale_optimizer import LossScaleOptimizer

    return LossScaleOptimizer


# --- optimizers.get ------------------------------------------------------------------------------


@register("optimizers.get", "AdasumStrategy cannot wrap a plain optimizer passed to compile")
def _check_optimizers_get() -> str | None:
    from keras.src import optimizers
    from keras.src.trainers import trainer

    if getattr(trainer, "optimizers", None) is not optimizers or not callable(
        getattr(optimizers, "get", None)
    ):
        return "keras.src.trainers.trainer no longer imports keras.src.optimizers, or it has no get"
    if not uses(trainer.Trainer.compile, "optimizers", "get"):
        return "Trainer.compile no longer resolves its optimizer through optimizers.get"
    return None


def install_optimizer_get(resolve: Callable[[Any], Any], check: Callable[[Any], None] | None = None) -> None:
    """Makes keras.optimizers.get (public and private) return resolve(the optimizer), once per process;
    `check`, where given, sees what it was asked for first (and raises to refuse it)."""
    from keras.src import optimizers

    if hook_problem("optimizers.get") is not None or replaced(optimizers.get):
        return
    before = optimizers.get

    @functools.wraps(before)
    def get(identifier: Any) -> Any:
        if check is not None:
            check(identifier)
        return resolve(before(identifier))

    optimizers.get = mark(get, before)
    if getattr(keras.optimizers, "get", None) is before:
        keras.optimizers.get = get


# --- _all_reduce_sum_gradients --------------------------------------------------------------------


@register(
    "_all_reduce_sum_gradients", "AdasumOptimizer's inner optimizer would sum gradients across replicas"
)
def _check_gradient_sum() -> str | None:
    optimizer = _tf_optimizer()
    if not callable(getattr(optimizer, "_all_reduce_sum_gradients", None)):
        return "TFOptimizer has no _all_reduce_sum_gradients"
    if not uses(optimizer._backend_update_step, "_all_reduce_sum_gradients"):
        return "TFOptimizer._backend_update_step no longer calls _all_reduce_sum_gradients"
    return None


def disable_gradient_sum(optimizer: Any) -> None:
    """Makes `optimizer` step on each replica's own gradient: no cross-replica sum before its update."""
    require("_all_reduce_sum_gradients")
    optimizer._all_reduce_sum_gradients = lambda grads_and_vars: list(grads_and_vars)


def install_gradient_sum_guard(check: Callable[[Any], None]) -> None:
    """Makes every Keras optimizer call check(optimizer) before it sums gradients across replicas, once.

    check raises where the sum would be wrong (a plain optimizer under an AdasumStrategy, whose
    replicas must step on their own gradients); an optimizer disable_gradient_sum switched off never
    gets here.
    """
    if hook_problem("_all_reduce_sum_gradients") is not None:
        return
    optimizer = _tf_optimizer()
    before = optimizer._all_reduce_sum_gradients
    if replaced(before):
        return

    @functools.wraps(before)
    def guarded(self: Any, grads_and_vars: Any) -> Any:
        check(self)
        return before(self, grads_and_vars)

    optimizer._all_reduce_sum_gradients = mark(guarded, before)


# --- Optimizer.apply ------------------------------------------------------------------------------


@register(
    "Optimizer.apply",
    "a plain optimizer's step in a strategy.run loop under AdasumStrategy cannot run Adasum",
)
def _check_apply() -> str | None:
    base = _base_optimizer()
    if not callable(getattr(base, "apply", None)):
        return "Keras's BaseOptimizer has no apply"
    if not uses(base.apply_gradients, "apply"):
        return "BaseOptimizer.apply_gradients no longer steps through apply"
    if "apply" in vars(_tf_optimizer()):
        return "TFOptimizer overrides apply"
    return None


def install_optimizer_apply(route: Callable[[Any, Any], Any]) -> None:
    """Makes a Keras optimizer's apply (and apply_gradients) run route(optimizer, variables).apply
    instead, where route gives an optimizer rather than None; once per process.

    Keras's own wrappers (LossScaleOptimizer) and tf_adasum's override apply and reach this through
    their inner optimizer.
    """
    if hook_problem("Optimizer.apply") is not None:
        return
    base = _base_optimizer()
    before = base.apply
    if replaced(before):
        return

    @functools.wraps(before)
    def apply(self: Any, grads: Any, trainable_variables: Any = None) -> Any:
        instead = route(self, trainable_variables)
        if instead is None:
            return before(self, grads, trainable_variables)
        return instead.apply(grads, trainable_variables)

    base.apply = mark(apply, before)


# --- _distribution_strategy -----------------------------------------------------------------------


@register("_distribution_strategy", "AdasumOptimizer cannot check the strategy it is built under")
def _check_distribution_strategy() -> str | None:
    if not uses(_tf_optimizer().__init__, "_distribution_strategy"):
        return "TFOptimizer.__init__ no longer sets _distribution_strategy"
    return None


def strategy_of(optimizer: Any) -> Any:
    """The tf.distribute strategy `optimizer` was created under."""
    require("_distribution_strategy")
    return optimizer._distribution_strategy


# --- LossScaleOptimizer.check_finite ---------------------------------------------------------------


@register(
    "LossScaleOptimizer.check_finite",
    "under mixed_float16, one replica's overflow would not skip the step on the others",
)
def _check_loss_scale() -> str | None:
    optimizer = _loss_scale_optimizer()
    check = getattr(optimizer, "check_finite", None)
    if not callable(check):
        return "LossScaleOptimizer has no check_finite"
    if not (uses(optimizer._tf_apply, "check_finite") and uses(optimizer._common_apply, "check_finite")):
        return "LossScaleOptimizer no longer decides to skip a step through check_finite"
    return None


def install_global_loss_scale_finiteness(
    applies_to: Callable[[Any], bool], everywhere: Callable[[tf.Tensor], tf.Tensor]
) -> None:
    """Makes mixed precision skip a step everywhere when any replica's gradients overflow, once.

    Keras's LossScaleOptimizer checks that the gradients are finite and skips the step (halving the
    loss scale) if not. Under a strategy it asks every replica but uses the first replica's answer,
    because it expects gradients all-reduced before that; without a strategy each process decides on
    its own. tf_adasum's replicas keep their own gradients, so one replica could overflow while the
    first did not: it would step on Inf while the others step normally, or, across processes, skip a
    sync the others wait in. For an optimizer where applies_to(inner optimizer) holds, the decision is
    everywhere(this replica's decision): finite only if finite on every replica of every process.
    """
    if hook_problem("LossScaleOptimizer.check_finite") is not None:
        return
    optimizer = _loss_scale_optimizer()
    before = optimizer.check_finite
    if replaced(before):
        return

    @functools.wraps(before)
    def check_finite(self: Any, grads: Any) -> Any:
        finite = before(self, grads)
        return everywhere(finite) if applies_to(self.inner_optimizer) else finite

    optimizer.check_finite = mark(check_finite, before)


def loss_scale_inner(optimizer: Any) -> Any:
    """The optimizer a Keras LossScaleOptimizer wraps, or `optimizer` itself."""
    if optimizer is not None and isinstance(optimizer, _loss_scale_optimizer()):
        return optimizer.inner_optimizer
    return optimizer


# --- optimizer variables ---------------------------------------------------------------------------


@register(
    "optimizer variables", "the optimizer wrappers cannot find a variable's slots or their inner optimizer"
)
def _check_optimizer_variables() -> str | None:
    base = _base_optimizer()
    if not uses(base.__init__, "_variables") or not uses(base.build, "_trainable_variables"):
        return "BaseOptimizer no longer keeps _variables and _trainable_variables"
    if not callable(getattr(base, "_get_variable_index", None)):
        return "BaseOptimizer has no _get_variable_index"
    if not callable(getattr(keras.optimizers.Optimizer, "_track_trackable", None)):
        return "Keras's optimizers are no longer TensorFlow trackables with _track_trackable"
    return None


def own_variables(optimizer: Any) -> list[Any]:
    """The variables an optimizer created itself (its iteration count, learning rate), not its slots'."""
    return list(optimizer._variables)


def trainable_variables_of(optimizer: Any) -> list[Any]:
    """The model variables a built optimizer steps, in the order of its slots."""
    return list(optimizer._trainable_variables)


def variable_index(optimizer: Any, variable: Any) -> int:
    """The index of `variable` among those a built optimizer steps (of its slots, in lists per slot)."""
    return int(optimizer._get_variable_index(variable))


def track(parent: Any, child: Any, name: str) -> None:
    """Makes tf.train.Checkpoint save `child` under `parent` as `name` (replacing one there)."""
    parent._track_trackable(child, name=name, overwrite=True)


# --- _iterations -------------------------------------------------------------------------------------


@register("_iterations", "with gradient_accumulation_steps, the syncs would come at the wrong steps")
def _check_applies() -> str | None:
    base = _base_optimizer()
    if not (uses(base.__init__, "_iterations") and uses(base.apply, "_iterations")):
        return "BaseOptimizer no longer counts its applies in _iterations"
    return None


def applies(optimizer: Any) -> Any:
    """The variable that counts an optimizer's applies: every step, also those that only accumulate a
    gradient (Keras's `iterations` divides it by gradient_accumulation_steps)."""
    return optimizer._iterations


# --- moving average -----------------------------------------------------------------------------------


@register(
    "moving average",
    "with use_ema, each replica would average its own weights before the sync",
    required=False,
)
def _check_moving_average() -> str | None:
    base, tf_optimizer = _base_optimizer(), _tf_optimizer()
    if not callable(getattr(base, "_update_model_variables_moving_average", None)):
        return "BaseOptimizer has no _update_model_variables_moving_average"
    if not uses(base._backend_apply_gradients, "_update_model_variables_moving_average"):
        return "BaseOptimizer._backend_apply_gradients no longer updates the moving average"
    overridden = [
        name
        for name in ("_backend_apply_gradients", "_update_model_variables_moving_average")
        if name in vars(tf_optimizer)
    ]
    if overridden:
        return f"TFOptimizer overrides {', '.join(overridden)}"
    if not uses(base.build, "_model_variables_moving_average"):
        return "BaseOptimizer.build no longer keeps the averages in _model_variables_moving_average"
    if not uses(_swap_ema_weights()._tf_swap_variables, "_model_variables_moving_average"):
        return "SwapEMAWeights no longer reads _model_variables_moving_average"
    return None


class BeforeTheAverage:
    """What runs once just before Keras updates an optimizer's moving average; `ran` says if it did."""

    def __init__(self, run: Callable[[], None]) -> None:
        self.run = run
        self.ran = False


class _Pending(threading.local):
    def __init__(self) -> None:
        self.by_optimizer: dict[int, BeforeTheAverage] = {}


_PENDING = _Pending()
_installing = threading.Lock()  # a strategy's replica threads reach their first step at once


@contextlib.contextmanager
def running_before_the_moving_average(optimizer: Any, run: Callable[[], None]) -> Iterator[BeforeTheAverage]:
    """While it lasts, on this thread: when `optimizer` (use_ema) updates its moving average of the
    weights, in its step after the update of the weights, it calls run() first, once.

    Per thread, so that each replica's thread of a MirroredStrategy step runs its own.
    """
    require("moving average")
    _install_before_the_average()
    pending = BeforeTheAverage(run)
    _PENDING.by_optimizer[id(optimizer)] = pending
    try:
        yield pending
    finally:
        _PENDING.by_optimizer.pop(id(optimizer), None)


def _install_before_the_average() -> None:
    """Makes BaseOptimizer's moving-average update run what running_before_the_moving_average asked
    first, once per process."""
    base = _base_optimizer()
    with _installing:
        before = base._update_model_variables_moving_average
        if replaced(before):
            return

        @functools.wraps(before)
        def update(self: Any, trainable_variables: Any) -> Any:
            pending = _PENDING.by_optimizer.pop(id(self), None)
            if pending is not None:
                pending.ran = True
                pending.run()
            return before(self, trainable_variables)

        base._update_model_variables_moving_average = mark(update, before)


def show_moving_averages(wrapper_class: type, inner_of: Callable[[Any], Any]) -> None:
    """Gives a wrapper class the moving averages of the optimizer it wraps where Keras's SwapEMAWeights
    looks for them. SwapEMAWeights looks one wrapper deep, so that it finds them in
    LossScaleOptimizer(AdasumOptimizer(SGD(use_ema=True))) only through this; an optimizer without
    averages gives none (AttributeError), as Keras's own."""
    if hook_problem("moving average") is not None:
        return

    def averages(self: Any) -> Any:
        return inner_of(self)._model_variables_moving_average

    wrapper_class._model_variables_moving_average = property(averages)  # type: ignore[attr-defined]
