"""tf_keras (Keras 2, `tf.keras` under TF_USE_LEGACY_KERAS=1): telling its objects from Keras 3's, and
the tf_keras names tf_adasum touches.

The Horovod face serves tf_keras scripts; the other ways in are built on Keras 3. A tf_keras model or
optimizer passed to those would fail deep inside Keras with an error that says nothing (a missing
private attribute), or, under AdasumStrategy, train as MirroredStrategy does, averaging gradients
instead of running Adasum. So:

- which Keras an object belongs to is read from its class (keras_2_name), never from an environment
  variable, which only says what `tf.keras` names;
- the ways in refuse a tf_keras object when they are given one (require_keras_3), naming what works;
- under AdasumStrategy, tf_keras's optimizers would sum the replicas' gradients: the guard installed by
  install_keras_2_gradient_sum_guard raises there instead (hooks `OptimizerV2._aggregate_gradients` and
  `Optimizer.aggregate_gradients` of tf_keras, checked when the guard is installed, which is only where
  tf_keras is already imported: tf_adasum never imports it);
- the callbacks that serve tf_keras models (the Horovod face's broadcast, metric average and learning
  rate) answer tf_keras's CallbackList, which asks each callback which batch hooks it implements
  (Keras2CallbackProtocol), and a tf_keras optimizer's state is built before it is broadcast
  (build_optimizer).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any

from tf_adasum._compat.registry import register
from tf_adasum.common.errors import HookError

# What a user of tf.keras can do today, in every refusal.
_WHAT_WORKS = (
    "With tf_keras, the Horovod face serves a script: tf_adasum.keras's DistributedOptimizer (op=Adasum, "
    "Average or Sum), BroadcastGlobalVariablesCallback, MetricAverageCallback, the learning-rate "
    "callbacks, and tf_adasum.tensorflow's DistributedGradientTape and collectives, under "
    "`python -m tf_adasum.run` or horovodrun. AdasumStrategy, AdasumCallback, AdasumOptimizer and the "
    "other callbacks serve Keras 3 models (`import keras`, without TF_USE_LEGACY_KERAS=1)"
)

# tf_keras's gradient sums across replicas: (module, class, method).
_GRADIENT_SUMS = (
    ("tf_keras.src.optimizers.optimizer", "Optimizer", "aggregate_gradients"),
    ("tf_keras.src.optimizers.legacy.optimizer_v2", "OptimizerV2", "_aggregate_gradients"),
)


def _of_tf_keras(module: str | None) -> bool:
    return module is not None and (module == "tf_keras" or module.startswith("tf_keras."))


def keras_2_name(obj: Any) -> str | None:
    """`module.Class` of the tf_keras class `obj` is (or is an instance of, or derives from), else None."""
    cls = obj if isinstance(obj, type) else type(obj)
    if any(_of_tf_keras(base.__module__) for base in cls.__mro__):
        return f"{cls.__module__}.{cls.__qualname__}"
    return None


def is_keras_2_function(fn: Any) -> bool:
    """Whether `fn` is one of tf_keras's own functions (its train, test and predict steps)."""
    return _of_tf_keras(getattr(fn, "__module__", None))


def require_keras_3(obj: Any, who: str) -> None:
    """Raises TypeError where `obj` (a model, optimizer or callback's model) is tf_keras's."""
    name = keras_2_name(obj)
    if name is not None:
        raise TypeError(
            f"{who} was given a tf_keras (Keras 2) object, {name}, and serves Keras 3 (keras.Model, "
            f"keras.optimizers.*). {_WHAT_WORKS}"
        )


def refuse_keras_2(who: str, what: str) -> None:
    """Raises TypeError: under `who`, tf_keras's `what` would average the replicas' gradients."""
    raise TypeError(
        f"{who}: {what} is tf_keras's (Keras 2), which would average the replicas' gradients as "
        f"MirroredStrategy does, not run Adasum. {_WHAT_WORKS}"
    )


# What tf_keras's CallbackList asks of every callback, beyond the hooks Keras 3's Callback has.
_CALLBACK_PROTOCOL = (
    "_implements_train_batch_hooks",
    "_implements_test_batch_hooks",
    "_implements_predict_batch_hooks",
)


class Keras2CallbackProtocol:
    """tf_keras's CallbackList's questions, answered for a Keras 3 callback: every batch hook is called
    (Keras 3's Callback has them all, doing nothing where the callback does not override them)."""

    def _implements_train_batch_hooks(self) -> bool:
        return True

    def _implements_test_batch_hooks(self) -> bool:
        return True

    def _implements_predict_batch_hooks(self) -> bool:
        return True


@register(
    "tf_keras callback protocol",
    "the callbacks that serve tf_keras models fail inside tf_keras's fit",
    required=False,
)
def _check_callback_protocol() -> str | None:
    if "tf_keras" not in sys.modules:
        return None  # checked where tf_keras is imported
    base = getattr(importlib.import_module("tf_keras.src.callbacks"), "Callback", None)
    missing = [name for name in _CALLBACK_PROTOCOL if not callable(getattr(base, name, None))]
    if missing:
        return (
            f"tf_keras {sys.modules['tf_keras'].__version__}'s Callback has no {', '.join(missing)}: its "
            "CallbackList asks callbacks something else now"
        )
    return None


def build_optimizer(optimizer: Any, variables: Any) -> None:
    """Creates `optimizer`'s state for `variables` where it has none yet: a Keras 3 optimizer, a tf_keras
    one, or tf_keras's legacy OptimizerV2 (whose slots are created per variable, idempotently)."""
    if keras_2_name(optimizer) is None:
        if not optimizer.built:
            optimizer.build(variables)
    elif hasattr(optimizer, "_create_all_weights"):
        optimizer._create_all_weights(variables)
    elif not getattr(optimizer, "_built", False):
        optimizer.build(variables)


def _gradient_sums() -> list[tuple[type, str]]:
    found = []
    for module_name, class_name, method in _GRADIENT_SUMS:
        module = importlib.import_module(module_name)
        cls = getattr(module, class_name, None)
        if cls is None or not callable(getattr(cls, method, None)):
            raise HookError(
                f"tf_keras {sys.modules['tf_keras'].__version__} has no {module_name}.{class_name}.{method}, "
                "where tf_keras's optimizers sum the replicas' gradients: tf_adasum cannot refuse a tf_keras "
                "optimizer under AdasumStrategy"
            )
        found.append((cls, method))
    return found


@register(
    "tf_keras gradient sums",
    "in a process that imported tf_keras, AdasumStrategy.run raises HookError (it could not refuse a "
    "tf_keras optimizer, which would average gradients)",
    required=False,
)
def _check_gradient_sums() -> str | None:
    if "tf_keras" not in sys.modules:
        return None  # checked where tf_keras is imported, when the guard is installed
    try:
        _gradient_sums()
    except (HookError, ImportError) as e:
        return str(e)
    return None


def install_keras_2_gradient_sum_guard(check: Callable[[Any], None]) -> bool:
    """Where tf_keras is imported, runs `check(optimizer)` before any tf_keras optimizer sums its
    replicas' gradients (check raises to refuse). Once per process; True where installed."""
    if "tf_keras" not in sys.modules:
        return False
    for cls, method in _gradient_sums():
        original = cls.__dict__.get(method)
        if original is None or getattr(original, "_tf_adasum_guard", False):
            continue

        def guarded(self: Any, grads_and_vars: Any, _original: Any = original) -> Any:
            check(self)
            return _original(self, grads_and_vars)

        guarded._tf_adasum_guard = True  # type: ignore[attr-defined]
        setattr(cls, method, guarded)
    return True
