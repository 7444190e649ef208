"""Every private Keras and TensorFlow name tf_adasum depends on, in one place, each checked at import.

tf_adasum changes where Keras sums gradients and what a train step does across processes. It does so
through the hooks below; if a Keras or TensorFlow release renamed or reshaped one, training would not
stop, it would quietly run a different algorithm (a gradient mean instead of Adasum, an inner optimizer
that sums gradients already multiplied by N, logs averaged on one process only). So each hook is
checked when tf_adasum is imported, against the code that uses it, and:

- at import, a missing or changed hook gives one warning naming it, and a Keras or TensorFlow outside
  the tested range (TESTED_KERAS, TESTED_TENSORFLOW; pyproject.toml carries the same bounds) gives a
  warning naming the range;
- whatever needs a missing hook (AdasumStrategy, AdasumOptimizer, AdasumCallback, ...) raises
  HookError when it is created, before any training, instead of degrading.

This module sits at the bottom of tf_adasum: it imports nothing of it but its errors. tf_adasum's own
policies (how to translate an error, what a syncing optimizer needs, which optimizers sync) come in
as arguments to the install_* functions, which tf_adasum/__init__.py calls once: that is every change
`import tf_adasum` makes to Keras.

The hooks:

`optimizers.get`
    keras.src.optimizers.get, which Trainer.compile resolves optimizers through. tf_adasum replaces
    it once, here, and the public keras.optimizers.get with it, so that a plain optimizer compiled
    under an AdasumStrategy's scope becomes an AdasumOptimizer.
`_all_reduce_sum_gradients`
    TFOptimizer's cross-replica gradient sum, switched off on an AdasumOptimizer's inner optimizer
    so that each replica steps on its own gradient, and guarded everywhere else: under an
    AdasumStrategy a plain optimizer that reaches it raises instead of averaging
    (install_gradient_sum_guard).
`Optimizer.apply`
    BaseOptimizer.apply, which apply_gradients steps through. Under an AdasumStrategy, a plain Keras
    optimizer's step in a strategy.run loop (TensorFlow's custom-training tutorial) runs as an
    AdasumOptimizer's (install_optimizer_apply).
`_distribution_strategy`
    the strategy an optimizer was created under (read to refuse a build under another one).
`train_step / test_step`
    TensorFlowTrainer's make_train_function / make_test_function, which pass the model's bound
    train_step / test_step to strategy.run. tf_adasum wraps the functions they build (to translate
    its errors, and to know a Keras step is running) and recognises the bound steps, to average logs
    and BatchNorm statistics across processes. An unrecognised step inside a Keras train or test
    function raises HookError.
`LossScaleOptimizer.check_finite`
    the finiteness decision of mixed precision. Keras takes it from the first replica, since its
    gradients are all-reduced; Adasum's are not, so tf_adasum makes it global (see
    install_global_loss_scale_finiteness).
`_maybe_symbolic_build`
    TensorFlowTrainer's build of the model on one batch before fit, evaluate and predict. Where a
    process holds several replicas it reduces that batch through strategy.reduce, for its shapes only;
    a process with one replica has no per-replica batch and calls nothing. tf_adasum marks the build
    (in_symbolic_build), so that AdasumStrategy.reduce stays inside the process there: a reduce across
    processes would meet nothing on the one-replica process (install_symbolic_build_mark).
`_create_device_dataset`
    tf.data's per-device prefetch datasets (quiet_per_device_iterators). Optional: without it,
    epoch boundaries can be slow with many replicas, nothing else changes.
`numpy views of eager tensors`
    the MPI engine receives into a fresh tensor through np.asarray's view of its memory (checked on
    first use; without it the engine copies, which is slower but the same).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import inspect
import threading
import types
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tf_adasum.errors import HookError

# [first, last) of the releases tf_adasum is tested with; pyproject.toml carries the same bounds.
TESTED_TENSORFLOW = ("2.21", "2.22")
TESTED_KERAS = ("3.15", "3.16")


def _release(version: str) -> tuple[int, ...]:
    numbers = []
    for part in version.split(".")[:2]:
        digits = "".join(c for c in part if c.isdigit())
        numbers.append(int(digits or 0))
    return tuple(numbers)


def untested_versions() -> list[str]:
    """The installed Keras and TensorFlow releases outside the tested ranges, described."""
    found = []
    for name, version, (first, last) in (
        ("TensorFlow", tf.__version__, TESTED_TENSORFLOW),
        ("Keras", keras.__version__, TESTED_KERAS),
    ):
        if not _release(first) <= _release(version) < _release(last):
            found.append(f"{name} {version} (tested: >={first}, <{last})")
    return found


def _names(code: types.CodeType) -> set[str]:
    """The global and attribute names a function's code uses, nested functions included."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def _uses(function: Any, *names: str) -> bool:
    code = getattr(inspect.unwrap(function), "__code__", None)
    return code is not None and set(names) <= _names(code)


def _trainer() -> Any:
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

    return TensorFlowTrainer


def _tf_optimizer() -> Any:
    from keras.src.backend.tensorflow.optimizer import TFOptimizer

    return TFOptimizer


def _base_optimizer() -> Any:
    from keras.src.optimizers.base_optimizer import BaseOptimizer

    return BaseOptimizer


def _loss_scale_optimizer() -> Any:
    from keras.src.optimizers.loss_scale_optimizer import LossScaleOptimizer

    return LossScaleOptimizer


def _check_optimizers_get() -> str | None:
    from keras.src import optimizers
    from keras.src.trainers import trainer

    if getattr(trainer, "optimizers", None) is not optimizers or not callable(
        getattr(optimizers, "get", None)
    ):
        return "keras.src.trainers.trainer no longer imports keras.src.optimizers, or it has no get"
    if not _uses(trainer.Trainer.compile, "optimizers", "get"):
        return "Trainer.compile no longer resolves its optimizer through optimizers.get"
    return None


def _check_gradient_sum() -> str | None:
    optimizer = _tf_optimizer()
    if not callable(getattr(optimizer, "_all_reduce_sum_gradients", None)):
        return "TFOptimizer has no _all_reduce_sum_gradients"
    if not _uses(optimizer._backend_update_step, "_all_reduce_sum_gradients"):
        return "TFOptimizer._backend_update_step no longer calls _all_reduce_sum_gradients"
    return None


def _check_apply() -> str | None:
    base = _base_optimizer()
    if not callable(getattr(base, "apply", None)):
        return "Keras's BaseOptimizer has no apply"
    if not _uses(base.apply_gradients, "apply"):
        return "BaseOptimizer.apply_gradients no longer steps through apply"
    if "apply" in vars(_tf_optimizer()):
        return "TFOptimizer overrides apply"
    return None


def _check_distribution_strategy() -> str | None:
    if not _uses(_tf_optimizer().__init__, "_distribution_strategy"):
        return "TFOptimizer.__init__ no longer sets _distribution_strategy"
    return None


def _check_steps() -> str | None:
    trainer = _trainer()
    for maker, step in (("make_train_function", "train_step"), ("make_test_function", "test_step")):
        function = getattr(trainer, maker, None)
        if function is None:
            return f"TensorFlowTrainer has no {maker}"
        original = getattr(function, "_tf_adasum_original", function)
        if not _uses(original, step):
            return f"TensorFlowTrainer.{maker} no longer runs the model's {step}"
    return None


def _check_loss_scale() -> str | None:
    optimizer = _loss_scale_optimizer()
    check = getattr(optimizer, "check_finite", None)
    if not callable(check):
        return "LossScaleOptimizer has no check_finite"
    if not (_uses(optimizer._tf_apply, "check_finite") and _uses(optimizer._common_apply, "check_finite")):
        return "LossScaleOptimizer no longer decides to skip a step through check_finite"
    return None


def _check_symbolic_build() -> str | None:
    build = getattr(_trainer(), "_maybe_symbolic_build", None)
    if build is None:
        return "TensorFlowTrainer has no _maybe_symbolic_build"
    if not _uses(getattr(build, "_tf_adasum_original", build), "reduce"):
        return "TensorFlowTrainer._maybe_symbolic_build no longer reduces its batch through the strategy"
    return None


def _check_device_datasets() -> str | None:
    from tensorflow.python.data.ops import multi_device_iterator_ops

    if not callable(getattr(multi_device_iterator_ops, "_create_device_dataset", None)):
        return "tf.data's multi_device_iterator_ops has no _create_device_dataset"
    return None


@dataclasses.dataclass(frozen=True)
class Hook:
    name: str
    check: Callable[[], str | None]
    consequence: str


HOOKS = {
    hook.name: hook
    for hook in (
        Hook(
            "optimizers.get",
            _check_optimizers_get,
            "AdasumStrategy cannot wrap a plain optimizer passed to compile",
        ),
        Hook(
            "_all_reduce_sum_gradients",
            _check_gradient_sum,
            "AdasumOptimizer's inner optimizer would sum gradients across replicas",
        ),
        Hook(
            "Optimizer.apply",
            _check_apply,
            "a plain optimizer's step in a strategy.run loop under AdasumStrategy cannot run Adasum",
        ),
        Hook(
            "_distribution_strategy",
            _check_distribution_strategy,
            "AdasumOptimizer cannot check the strategy it is built under",
        ),
        Hook(
            "train_step / test_step",
            _check_steps,
            "logs and BatchNorm statistics would not be averaged across processes",
        ),
        Hook(
            "LossScaleOptimizer.check_finite",
            _check_loss_scale,
            "under mixed_float16, one replica's overflow would not skip the step on the others",
        ),
        Hook(
            "_maybe_symbolic_build",
            _check_symbolic_build,
            "a process with one replica beside processes with several fails at fit's first batch",
        ),
        Hook(
            "_create_device_dataset",
            _check_device_datasets,
            "epoch boundaries may stall with many replicas (nothing else changes)",
        ),
    )
}
REQUIRED = tuple(name for name in HOOKS if name not in ("_create_device_dataset", "_maybe_symbolic_build"))


def hook_problem(name: str) -> str | None:
    """What is wrong with hook `name`, or None when it is there and used as assumed."""
    try:
        return HOOKS[name].check()
    except (ImportError, AttributeError) as error:
        return f"{type(error).__name__}: {error}"


def require(*names: str) -> None:
    """Raises HookError if any of the named hooks is missing or changed."""
    for name in names or REQUIRED:
        found = hook_problem(name)
        if found is not None:
            raise HookError(
                f"tf_adasum cannot run safely with Keras {keras.__version__} and TensorFlow "
                f"{tf.__version__}: {found}, so {HOOKS[name].consequence}. tf_adasum is tested with "
                f"tensorflow>={TESTED_TENSORFLOW[0]},<{TESTED_TENSORFLOW[1]} and "
                f"keras>={TESTED_KERAS[0]},<{TESTED_KERAS[1]}: install those"
            )


def require_tensorflow_backend(what: str) -> None:
    """Refuses a Keras backend other than TensorFlow: every hook above is TensorFlow's."""
    backend = keras.backend.backend()
    if backend != "tensorflow":
        raise RuntimeError(
            f"{what} needs Keras's TensorFlow backend, but KERAS_BACKEND is {backend!r}: set "
            "KERAS_BACKEND=tensorflow before importing keras"
        )


def warn_at_import() -> None:
    """One warning for a Keras or TensorFlow outside the tested range, and one per missing hook."""
    untested = untested_versions()
    if untested:
        warnings.warn(
            f"tf_adasum is not tested with {' and '.join(untested)}; its hooks into Keras are checked, "
            "but results may differ",
            stacklevel=3,
        )
    broken = {name: hook_problem(name) for name in HOOKS}
    for name, found in broken.items():
        if found is not None:
            warnings.warn(
                f"tf_adasum: {found}, so {HOOKS[name].consequence}"
                + ("; using it raises tf_adasum.HookError" if name in REQUIRED else ""),
                stacklevel=3,
            )


def _mark(function: Any, original: Any) -> Any:
    function._tf_adasum_original = original
    return function


# --- optimizers.get ------------------------------------------------------------------------------


def install_optimizer_get(resolve: Callable[[Any], Any]) -> None:
    """Makes keras.optimizers.get (public and private) return resolve(the optimizer), once per process."""
    from keras.src import optimizers

    if hook_problem("optimizers.get") is not None or hasattr(optimizers.get, "_tf_adasum_original"):
        return
    original = optimizers.get

    @functools.wraps(original)
    def get(identifier: Any) -> Any:
        return resolve(original(identifier))

    optimizers.get = _mark(get, original)
    if getattr(keras.optimizers, "get", None) is original:
        keras.optimizers.get = get


# --- _all_reduce_sum_gradients, _distribution_strategy --------------------------------------------


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
    original = optimizer._all_reduce_sum_gradients
    if hasattr(original, "_tf_adasum_original"):
        return

    @functools.wraps(original)
    def guarded(self: Any, grads_and_vars: Any) -> Any:
        check(self)
        return original(self, grads_and_vars)

    optimizer._all_reduce_sum_gradients = _mark(guarded, original)


def install_optimizer_apply(route: Callable[[Any, Any], Any]) -> None:
    """Makes a Keras optimizer's apply (and apply_gradients) run route(optimizer, variables).apply
    instead, where route gives an optimizer rather than None; once per process.

    Keras's own wrappers (LossScaleOptimizer) and tf_adasum's override apply and reach this through
    their inner optimizer.
    """
    if hook_problem("Optimizer.apply") is not None:
        return
    base = _base_optimizer()
    original = base.apply
    if hasattr(original, "_tf_adasum_original"):
        return

    @functools.wraps(original)
    def apply(self: Any, grads: Any, trainable_variables: Any = None) -> Any:
        instead = route(self, trainable_variables)
        if instead is None:
            return original(self, grads, trainable_variables)
        return instead.apply(grads, trainable_variables)

    base.apply = _mark(apply, original)


def strategy_of(optimizer: Any) -> Any:
    """The tf.distribute strategy `optimizer` was created under."""
    require("_distribution_strategy")
    return optimizer._distribution_strategy


# --- Keras's train and test steps ------------------------------------------------------------------

_running = threading.local()


def keras_step(fn: Any) -> tuple[Any, str] | None:
    """(model, "train" or "test") when fn is a model's bound train_step or test_step, else None."""
    fn = getattr(fn, "python_function", fn)
    model = getattr(fn, "__self__", None)
    if isinstance(model, keras.Model) and getattr(fn, "__name__", None) in ("train_step", "test_step"):
        return model, fn.__name__[: -len("_step")]
    return None


def keras_function_running() -> str | None:
    """ "train" or "test" while a Keras train or test function runs (and is traced) on this thread."""
    return getattr(_running, "kind", None)


@contextlib.contextmanager
def _running_keras_function(kind: str) -> Iterator[None]:
    outer = keras_function_running()
    _running.kind = kind
    try:
        yield
    finally:
        _running.kind = outer


def install_step_hooks(
    translate_errors: Callable[[Any], Any], before_train_function: Callable[[Any], None]
) -> None:
    """Wraps the functions Keras's make_train_function / make_test_function build, once per process.

    Args:
        translate_errors: wraps a train or test function so that tf_adasum's errors raised inside a
            compiled step reach the caller as tf_adasum.PeerError, NonFiniteUpdateError or
            UnevenDataError, naming the rank (instead of tf.errors.UnknownError).
        before_train_function: called with the model before Keras makes its train function (tf_adasum
            turns XLA off there for a model whose optimizer syncs).

    The wrapped function also marks the thread as running a Keras step, so that AdasumStrategy.run
    can tell an unrecognised step from a user's own function.
    """
    if hook_problem("train_step / test_step") is not None:
        return
    trainer = _trainer()
    for maker, attribute, kind in (
        ("make_train_function", "train_function", "train"),
        ("make_test_function", "test_function", "test"),
    ):
        original = getattr(trainer, maker)
        if hasattr(original, "_tf_adasum_original"):
            continue
        setattr(
            trainer,
            maker,
            _mark(_step_maker(original, attribute, kind, translate_errors, before_train_function), original),
        )


def _step_maker(
    original: Any,
    attribute: str,
    kind: str,
    translate_errors: Callable[[Any], Any],
    before_train_function: Callable[[Any], None],
) -> Any:
    """make_train_function or make_test_function, wrapped: see install_step_hooks."""

    @functools.wraps(original)
    def make(self: Any, force: bool = False) -> Any:
        if kind == "train":
            before_train_function(self)
        original(self, force)
        function = getattr(self, attribute, None)
        if function is not None and not hasattr(function, "_tf_adasum_original"):
            translated = translate_errors(function)

            @functools.wraps(function)
            def run(*args: Any, **kwargs: Any) -> Any:
                with _running_keras_function(kind):
                    return translated(*args, **kwargs)

            setattr(self, attribute, _mark(run, function))
        return getattr(self, attribute)

    return make


# --- LossScaleOptimizer.check_finite ---------------------------------------------------------------


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
    original = optimizer.check_finite
    if hasattr(original, "_tf_adasum_original"):
        return

    @functools.wraps(original)
    def check_finite(self: Any, grads: Any) -> Any:
        finite = original(self, grads)
        return everywhere(finite) if applies_to(self.inner_optimizer) else finite

    optimizer.check_finite = _mark(check_finite, original)


def loss_scale_inner(optimizer: Any) -> Any:
    """The optimizer a Keras LossScaleOptimizer wraps, or `optimizer` itself."""
    if optimizer is not None and isinstance(optimizer, _loss_scale_optimizer()):
        return optimizer.inner_optimizer
    return optimizer


# --- _maybe_symbolic_build ------------------------------------------------------------------------

_building = threading.local()


def in_symbolic_build() -> bool:
    """Whether Keras is building a model on one batch (before fit, evaluate, predict) on this thread."""
    return getattr(_building, "active", False)


def install_symbolic_build_mark() -> None:
    """Marks TensorFlowTrainer._maybe_symbolic_build's run (in_symbolic_build), once per process."""
    if hook_problem("_maybe_symbolic_build") is not None:
        return
    trainer = _trainer()
    original = trainer._maybe_symbolic_build
    if hasattr(original, "_tf_adasum_original"):
        return

    @functools.wraps(original)
    def build(self: Any, *args: Any, **kwargs: Any) -> Any:
        outer = in_symbolic_build()
        _building.active = True
        try:
            return original(self, *args, **kwargs)
        finally:
            _building.active = outer

    trainer._maybe_symbolic_build = _mark(build, original)


# --- _create_device_dataset -----------------------------------------------------------------------


def quiet_per_device_iterators() -> None:
    """Turns tf.data autotuning off on the per-device prefetch datasets of distributed datasets.

    Why: MirroredStrategy (and so AdasumStrategy) feeds each replica through a per-device prefetch
    dataset with a fixed one-element buffer, and each of their iterators starts an autotuning thread.
    Keras makes a new distributed iterator every epoch; destroying the old one waits for every such
    thread to end (RootDataset::Iterator::~Iterator), and an autotuning thread can sleep through its
    cancellation for a whole optimisation period, up to 60 s, each. With 32 replicas on 2 cores the
    epoch boundary then stalls for minutes at 0% CPU (stack: the main thread in
    ~MultiDeviceIterator -> ~RootDataset::Iterator -> ~LogicalThreadWrapper; the threads it waits for
    in Model::OptimizeLoop). A one-element buffer has nothing to tune, so nothing is lost. The source
    dataset keeps its own options.
    """
    if hook_problem("_create_device_dataset") is not None:
        return
    from tensorflow.python.data.ops import multi_device_iterator_ops as module

    original = module._create_device_dataset
    if hasattr(original, "_tf_adasum_original"):
        return

    @functools.wraps(original)
    def create_device_dataset(*args: Any, **kwargs: Any) -> Any:
        options = tf.data.Options()
        options.autotune.enabled = False
        return original(*args, **kwargs).with_options(options)

    module._create_device_dataset = _mark(create_device_dataset, original)


# --- numpy views of eager tensors ------------------------------------------------------------------


def _view(tensor: tf.Tensor) -> np.ndarray:
    shared = np.asarray(tensor)
    raw = (ctypes.c_char * shared.nbytes).from_address(shared.ctypes.data)
    return np.frombuffer(memoryview(raw).cast("B"), dtype=shared.dtype)


@functools.cache
def numpy_views_share_memory() -> bool:
    """Whether writing through np.asarray(eager tensor)'s memory changes the tensor (checked once)."""
    tensor = tf.raw_ops.Empty(shape=[4], dtype=tf.float32, init=True)
    try:
        _view(tensor)[:] = np.arange(1, 5, dtype=np.float32)
    except (TypeError, ValueError, BufferError):
        return False
    shared = bool(np.array_equal(tensor.numpy(), np.arange(1, 5, dtype=np.float32)))
    if not shared:
        warnings.warn(
            "tf_adasum: np.asarray no longer shares an eager tensor's memory; the MPI engine copies each "
            "received buffer instead (slower, same results)",
            stacklevel=2,
        )
    return shared


def writable_view(tensor: tf.Tensor) -> np.ndarray | None:
    """A writable numpy view of a fresh eager tensor that nothing else references yet, or None.

    np.asarray(tensor) shares the tensor's memory but is marked read-only; the buffer is ours to fill,
    since the tensor was just allocated for this receive. None when TensorFlow no longer shares it.
    """
    return _view(tensor) if numpy_views_share_memory() else None
