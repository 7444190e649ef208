"""tf_keras (Keras 2, `tf.keras` under TF_USE_LEGACY_KERAS=1): telling its objects from Keras 3's, and
the tf_keras names tf_adasum touches.

AdasumStrategy, AdasumCallback, OrthogonalityMonitor and the Horovod face serve tf_keras scripts;
AdasumOptimizer and AllreduceOptimizer are built on Keras 3, and a tf_keras optimizer passed to those
would fail deep inside Keras with an error that says nothing (a missing private attribute). So:

- which Keras an object belongs to is read from its class (keras_2_name), never from an environment
  variable, which only says what `tf.keras` names;
- those refuse a tf_keras object when they are given one (require_keras_3), naming what works;
- under AdasumStrategy, a tf_keras optimizer's apply_gradients is routed (install_keras_2_step_route,
  hooks `Optimizer.apply_gradients` and `OptimizerV2.apply_gradients` of tf_keras) to each replica's own
  step and the sync (training/keras2_sync.py); anything that would still sum the replicas' gradients
  there (tf_keras's LossScaleOptimizer calls its inner optimizer's sum) meets the guard installed by
  install_keras_2_gradient_sum_guard, which raises (hooks `OptimizerV2._aggregate_gradients` and
  `Optimizer.aggregate_gradients` of tf_keras, checked when the guard is installed, which is only where
  tf_keras is already imported: tf_adasum never imports it);
- the callbacks that serve tf_keras models (the Horovod face's broadcast, metric average and learning
  rate) answer tf_keras's CallbackList, which asks each callback which batch hooks it implements
  (Keras2CallbackProtocol), and a tf_keras optimizer's state is built before it is broadcast
  (optimizers.build_optimizer).
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Callable
from typing import Any

import keras

from tf_adasum._compat.registry import register
from tf_adasum.common.errors import HookError

# What a user of tf.keras can do today, in every refusal.
_WHAT_WORKS = (
    "With tf_keras, AdasumStrategy (a plain tf_keras optimizer compiled under its scope) and "
    "tf_adasum.AdasumCallback serve a script, and so does the Horovod face: tf_adasum.keras's "
    "DistributedOptimizer (op=Adasum, Average or Sum), its callbacks, load_model, the elastic KerasState, "
    "and tf_adasum.tensorflow's DistributedGradientTape and collectives, under `python -m tf_adasum.run` "
    "or horovodrun, with OrthogonalityMonitor. AdasumOptimizer and AllreduceOptimizer serve Keras 3 "
    "optimizers (`import keras`, without TF_USE_LEGACY_KERAS=1)"
)

# tf_keras's optimizer steps, which AdasumStrategy routes: (module, class, method).
_STEPS = (
    ("tf_keras.src.optimizers.optimizer", "Optimizer", "apply_gradients"),
    ("tf_keras.src.optimizers.legacy.optimizer_v2", "OptimizerV2", "apply_gradients"),
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


def refuse_mixing_in_keras_3(optimizer: Any) -> None:
    """Raises TypeError where Keras 3's compile is given a tf_keras optimizer (keras.optimizers.get)."""
    name = keras_2_name(optimizer)
    if name is not None:
        raise TypeError(_mixing(f"a Keras 3 model was compiled with a tf_keras (Keras 2) optimizer, {name}"))


def refuse_mixing_in_keras_2(optimizer: Any) -> None:
    """Raises TypeError where tf_keras's compile is given a Keras 3 optimizer (or one of tf_adasum's
    Keras 3 wrappers) (tf_keras's optimizers.get, install_keras_2_mixing_guard)."""
    cls = type(optimizer)
    if isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(
            _mixing(
                f"a tf_keras (Keras 2) model was compiled with a Keras 3 optimizer, "
                f"{cls.__module__}.{cls.__qualname__}"
            )
        )


def _mixing(what: str) -> str:
    return (
        f"{what}. One model takes one Keras: under TF_USE_LEGACY_KERAS=1 `tf.keras` is tf_keras, and "
        "`import keras` is Keras 3 whatever the variable says. Build the model and its optimizer from the "
        "same one (tf.keras.optimizers.* for a tf.keras model), then wrap that optimizer"
    )


def install_keras_2_mixing_guard() -> bool:
    """Where tf_keras is imported, makes its optimizers.get (which its compile resolves optimizers
    through) refuse a Keras 3 optimizer with refuse_mixing_in_keras_2's message, not tf_keras's "Could
    not interpret optimizer identifier". Once per process; True where installed."""
    if "tf_keras" not in sys.modules:
        return False
    module = importlib.import_module("tf_keras.src.optimizers")
    before = getattr(module, "get", None)
    if not callable(before) or getattr(before, "_tf_adasum_guard", False):
        return callable(before)

    def get(identifier: Any, **kwargs: Any) -> Any:
        refuse_mixing_in_keras_2(identifier)
        return before(identifier, **kwargs)

    get._tf_adasum_guard = True  # type: ignore[attr-defined]
    setattr(module, "get", get)  # noqa: B010 (a module's attribute, replaced)
    return True


@register(
    "tf_keras optimizers.get",
    "a tf_keras model compiled with a Keras 3 optimizer fails with tf_keras's own message, which does not "
    "say that two Kerases were mixed",
    required=False,
)
def _check_keras_2_get() -> str | None:
    if "tf_keras" not in sys.modules:
        return None
    module = importlib.import_module("tf_keras.src.optimizers")
    training = importlib.import_module("tf_keras.src.engine.training")
    if not callable(getattr(module, "get", None)) or getattr(training, "optimizers", None) is not module:
        return "tf_keras's compile no longer resolves optimizers through tf_keras.src.optimizers.get"
    return None


def refuse_keras_2(who: str, what: str) -> None:
    """Raises TypeError: under `who`, tf_keras's `what` is summing the replicas' gradients."""
    raise TypeError(
        f"{who}: {what} is tf_keras's (Keras 2) and is summing the replicas' gradients (its "
        "aggregate_gradients, which tf_keras's LossScaleOptimizer calls, or a call of a script's own), which "
        "would average them as MirroredStrategy does, not run Adasum after each replica's step. Under "
        "AdasumStrategy a tf_keras optimizer steps through its apply_gradients alone, in float32; mixed "
        "precision is served under Keras 3"
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


def optimizer_variables(optimizer: Any) -> list[Any]:
    """An optimizer's variables as a list: a property of Keras 3's and tf_keras's optimizers, a method of
    tf_keras's legacy OptimizerV2."""
    variables = optimizer.variables
    return list(variables() if inspect.ismethod(variables) else variables)


def _methods(names: tuple[tuple[str, str, str], ...], what: str) -> list[tuple[type, str]]:
    """Each (class, method) named, where the class defines the method itself (it is patched there: one
    inherited from a base would be the base's, which the class's own may have overridden)."""
    found = []
    for module_name, class_name, method in names:
        module = importlib.import_module(module_name)
        cls = getattr(module, class_name, None)
        if cls is None or not callable(vars(cls).get(method)):
            raise HookError(
                f"tf_keras {sys.modules['tf_keras'].__version__} has no {module_name}.{class_name}.{method}, "
                f"{what}"
            )
        found.append((cls, method))
    return found


def _problem_finding(find: Callable[[], object]) -> str | None:
    """The fence's check of the methods `find` looks up: what is missing, or None. Where tf_keras is not
    imported, None: it is checked where it is, when the route or guard is installed."""
    if "tf_keras" not in sys.modules:
        return None
    try:
        find()
    except (HookError, ImportError) as e:
        return str(e)
    return None


def _gradient_sums() -> list[tuple[type, str]]:
    return _methods(
        _GRADIENT_SUMS,
        "where tf_keras's optimizers sum the replicas' gradients: tf_adasum cannot refuse a tf_keras "
        "optimizer under AdasumStrategy",
    )


def _steps() -> list[tuple[type, str]]:
    return _methods(_STEPS, "where tf_keras's optimizers step: AdasumStrategy cannot run Adasum after them")


@register(
    "tf_keras optimizer steps",
    "in a process that imported tf_keras, AdasumStrategy.run raises HookError (it could not run Adasum "
    "after a tf_keras optimizer's step)",
    required=False,
)
def _check_steps() -> str | None:
    return _problem_finding(_steps)


def install_keras_2_step_route(route: Callable[..., Any]) -> bool:
    """Where tf_keras is imported, makes every tf_keras optimizer's apply_gradients call
    `route(optimizer, own_apply_gradients, grads_and_vars, args, kwargs)`, which decides whether to run
    the optimizer's own step or another around it. Once per process; True where installed."""
    if "tf_keras" not in sys.modules:
        return False
    for cls, method in _steps():
        original = cls.__dict__.get(method)
        if original is None or getattr(original, "_tf_adasum_route", False):
            continue

        def routed(
            self: Any, grads_and_vars: Any, *args: Any, _original: Any = original, **kwargs: Any
        ) -> Any:
            return route(self, _original, grads_and_vars, args, kwargs)

        routed._tf_adasum_route = True  # type: ignore[attr-defined]
        setattr(cls, method, routed)
    return True


@register(
    "tf_keras gradient sums",
    "in a process that imported tf_keras, AdasumStrategy.run raises HookError (it could not refuse a "
    "tf_keras optimizer, which would average gradients)",
    required=False,
)
def _check_gradient_sums() -> str | None:
    return _problem_finding(_gradient_sums)


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
