"""Where AdasumCallback's outer optimizer lives: built on the model's trainable variables and hung on the
model's optimizer, so that Keras's saving, tf.train.Checkpoint and an elastic KerasState find it; with
the checks every outer optimizer passes first, for the callback and the elastic state alike.

Its hook, `tf_keras optimizer index`: tf_keras's optimizers' private index of the variables they step
(`_index_dict`, keyed by `_var_key`, once `_built`). It also creates tf_keras's legacy optimizers' slots
(`_create_all_weights`), and reads Keras 3's optimizers through _compat.optimizers.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import keras
import tensorflow as tf

from tf_adasum._compat.optimizers import loss_scale_inner, track, trainable_variables_of
from tf_adasum._compat.registry import hook_problem, register, uses
from tf_adasum.common.variables import tf_variable

# Where AdasumCallback's outer optimizer hangs on the plain one: Keras's saving walks its attributes (and
# tf.train.Checkpoint its tracked children). An elastic KerasState given it pins it: its commits hold it.
OUTER_ATTRIBUTE = "tf_adasum_outer_optimizer"
PINNED_ATTRIBUTE = "_tf_adasum_outer_pinned"


def optimizer_name(optimizer: Any) -> str:  # tf_keras's legacy optimizers have only `_name`
    """An optimizer's name for messages."""
    return str(getattr(optimizer, "name", None) or getattr(optimizer, "_name", type(optimizer).__name__))


def attach_outer(optimizer: Any, outer: Any) -> None:
    """Hangs `outer` on `optimizer` (OUTER_ATTRIBUTE), replacing any outer optimizer there; None takes
    it off. Refuses to replace one an elastic state pinned (hang_outer(pin=True))."""
    there = attached_outer(optimizer)
    if getattr(optimizer, PINNED_ATTRIBUTE, False) and outer is not there:
        asked = "none" if outer is None else repr(optimizer_name(outer))
        raise ValueError(
            f"the model's optimizer carries the outer optimizer {optimizer_name(there)!r}, which an elastic "
            f"KerasState commits, and AdasumCallback asks for {asked}: give it the state's own"
        )
    if outer is not None:
        setattr(optimizer, OUTER_ATTRIBUTE, outer)
        track(optimizer, outer, OUTER_ATTRIBUTE)
    elif there is not None:
        delattr(optimizer, OUTER_ATTRIBUTE)  # TensorFlow's AutoTrackable drops the tracking with it


def attached_outer(optimizer: Any) -> Any:
    """The outer optimizer AdasumCallback hung on `optimizer`, or None."""
    return getattr(optimizer, OUTER_ATTRIBUTE, None)


@register(
    "tf_keras optimizer index",
    "a tf_keras outer optimizer built on another model's variables is refused only by tf_keras, with a "
    "KeyError at the first sync, after steps",
    required=False,
)
def _check_tf_keras_index() -> str | None:
    if "tf_keras" not in sys.modules:
        return None  # checked where tf_keras is imported
    base = getattr(importlib.import_module("tf_keras.src.optimizers.optimizer"), "_BaseOptimizer", None)
    build = getattr(base, "_build_index_dict", None)
    if not callable(getattr(base, "_var_key", None)) or not callable(build) or not uses(build, "_index_dict"):
        return (
            f"tf_keras {sys.modules['tf_keras'].__version__}'s optimizers no longer keep the variables they "
            "step in _index_dict, keyed by _var_key"
        )
    return None


def stepped_by_callback(optimizer: Any) -> bool:
    """Whether AdasumCallback has extended the step of a model's `optimizer` (its LossScaleOptimizer's
    inner one) with its sync for this fit: the mark (training.model_sync.SYNCS) on the `apply`, or on
    tf_keras's `apply_gradients`, it installs on the optimizer until the fit ends."""
    stepping = loss_scale_inner(optimizer)
    if stepping is None:
        return False
    steps = (vars(stepping).get(name) for name in ("apply", "apply_gradients"))
    return any(getattr(step, "_tf_adasum_syncs", False) for step in steps)


def build_optimizer(optimizer: Any, variables: Any) -> None:
    """Creates `optimizer`'s state for `variables` where it has none yet: a Keras 3 optimizer, a tf_keras
    one, or tf_keras's legacy OptimizerV2 (whose slots are created per variable, idempotently)."""
    if isinstance(optimizer, keras.optimizers.Optimizer):
        if not optimizer.built:
            optimizer.build(variables)
    elif hasattr(optimizer, "_create_all_weights"):
        optimizer._create_all_weights(variables)
    elif not getattr(optimizer, "_built", False):
        optimizer.build(variables)


def _keras_of(optimizer: Any) -> str | None:
    """Which Keras `optimizer` is of: "Keras 3", "tf_keras", or None for no Keras optimizer."""
    if isinstance(optimizer, keras.optimizers.Optimizer):
        return "Keras 3"
    tf_keras = any(c.__module__.split(".")[0] == "tf_keras" for c in type(optimizer).__mro__)
    return "tf_keras" if tf_keras and hasattr(optimizer, "apply_gradients") else None


def _built_elsewhere(outer: Any, keras_of: str | None, variables: list[Any]) -> str | None:
    """The other variables a built `outer` steps, in words, or None: Keras 3's optimizer lists them,
    tf_keras's keeps their keys (its legacy OptimizerV2 makes its slots per variable, as it meets them)."""
    if keras_of == "Keras 3" and outer.built:
        own = [tf_variable(v) for v in trainable_variables_of(outer)]
        if [id(v) for v in own] != [id(tf_variable(v)) for v in variables]:
            return f"{len(own)} other variables ({', '.join(v.name for v in own[:3])}, ...)"
    index = getattr(outer, "_index_dict", None)  # tf_keras's: each variable's key to its slots' index
    known = keras_of == "tf_keras" and hook_problem("tf_keras optimizer index") is None
    if known and getattr(outer, "_built", False) and isinstance(index, dict):
        if set(index) != {outer._var_key(v) for v in variables}:
            return f"{len(index)} other variables"
    return None


def hang_outer(optimizer: Any, outer: Any, variables: list[Any], pin: bool = False) -> None:
    """Builds `outer` on `variables` (a model's trainable ones) and hangs it on the model's `optimizer`
    (a Keras 3 LossScaleOptimizer's inner one), where checkpoints and elastic commits find it; with `pin`
    (an elastic state's) for good. Builds `optimizer` too, since Keras loads no state into one that has
    none; both eagerly, since Keras cannot build a stateful optimizer in the train function. Refuses,
    before anything changes, an outer optimizer that is not a plain one of the model's Keras, the model's
    own, and one built on other variables."""
    stepping = loss_scale_inner(optimizer)
    model_keras, outer_keras = _keras_of(stepping), _keras_of(outer)
    example = f"{'tf.' * (model_keras != 'Keras 3')}keras.optimizers.SGD(0.5, momentum=0.5, nesterov=True)"
    wrapper = getattr(outer, "_tf_adasum_syncs", False) or hasattr(outer, "_tf_adasum_op")
    if outer_keras != model_keras or wrapper or "LossScaleOptimizer" in type(outer).__name__:
        other = f", a {outer_keras} optimizer" if outer_keras not in (None, model_keras) else ""
        raise ValueError(
            f"outer_optimizer is a plain {model_keras} optimizer, of the model's Keras, that steps the "
            f"combined deltas ({example}, ...), got {type(outer).__module__}.{type(outer).__name__}{other}"
        )
    if outer is stepping:
        raise ValueError(
            f"outer_optimizer is the model's optimizer {optimizer_name(stepping)!r}: the outer step needs "
            f"an optimizer of its own, with its own state ({example}, ...)"
        )
    elsewhere = _built_elsewhere(outer, outer_keras, variables)
    if elsewhere is not None:
        raise ValueError(
            f"outer_optimizer {optimizer_name(outer)!r} was built on {elsewhere}, not this model's "
            f"{len(variables)} ({', '.join(v.name for v in variables[:3])}, ...): give each model, and each "
            "set of trainable variables, an outer optimizer of its own"
        )
    with tf.init_scope():
        build_optimizer(optimizer, variables)
        build_optimizer(outer, variables)
    attach_outer(stepping, outer)
    if pin:
        setattr(stepping, PINNED_ATTRIBUTE, True)
