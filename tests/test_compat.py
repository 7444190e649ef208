"""The private Keras and TensorFlow hooks (tf_adasum._compat): each one's check fails clearly without it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf
import tomllib
from keras.src import optimizers as keras_optimizers
from keras.src.backend.tensorflow.optimizer import TFOptimizer
from keras.src.backend.tensorflow.trainer import TensorFlowTrainer
from keras.src.callbacks.swap_ema_weights import SwapEMAWeights
from keras.src.losses import loss as keras_loss_module
from keras.src.optimizers.base_optimizer import BaseOptimizer
from keras.src.optimizers.loss_scale_optimizer import LossScaleOptimizer
from keras.src.trainers import trainer as keras_trainer
from keras.src.trainers.epoch_iterator import EpochIterator
from tensorflow.python.data.ops import multi_device_iterator_ops
from tensorflow.python.distribute import input_lib, merge_call_interim
from tensorflow.python.eager import context as eager_context
from tensorflow.python.profiler import trace as profiler_trace
from tf_keras.src import callbacks as tf_keras_callbacks
from tf_keras.src import optimizers as tf_keras_optimizers
from tf_keras.src.optimizers import optimizer as tf_keras_optimizer
from tf_keras.src.optimizers.legacy import optimizer_v2 as tf_keras_optimizer_v2

import tf_adasum
from tests.support.training import build_linear, cpus, make_inner, problem
from tf_adasum import _compat
from tf_adasum._compat import numpy_views

ROOT = Path(__file__).resolve().parents[1]


def test_every_hook_is_in_place_with_the_tested_keras_and_tensorflow() -> None:
    assert _compat.untested_versions() == []
    assert {name: _compat.hook_problem(name) for name in _compat.HOOKS} == dict.fromkeys(_compat.HOOKS)
    _compat.require()


def without_compile_through_get(self: Any, optimizer: Any = "rmsprop", **kwargs: Any) -> None:
    self.optimizer = optimizer


def without_the_train_step(self: Any, force: bool = False) -> None:
    self.train_function = None


def apply_gradients_of_its_own(self: Any, grads_and_vars: Any) -> None:
    grads, variables = zip(*grads_and_vars, strict=True)
    self._backend_update_step(list(grads), list(variables), self.learning_rate)


# (hook, what to take away), the way a Keras release could.
def merge_always(fn: Any, strategy: Any, *args: Any, **kwargs: Any) -> Any:
    """maybe_merge_call as a TensorFlow that always merges would have it."""
    return tf.distribute.get_replica_context().merge_call(fn, args=args, kwargs=kwargs)


REMOVALS = [
    ("optimizers.get", lambda mp: mp.delattr(keras_trainer, "optimizers")),
    ("optimizers.get", lambda mp: mp.setattr(keras_trainer.Trainer, "compile", without_compile_through_get)),
    ("_all_reduce_sum_gradients", lambda mp: mp.delattr(TFOptimizer, "_all_reduce_sum_gradients")),
    ("_distribution_strategy", lambda mp: mp.setattr(TFOptimizer, "__init__", lambda self, *a, **k: None)),
    ("Optimizer.apply", lambda mp: mp.setattr(BaseOptimizer, "apply_gradients", apply_gradients_of_its_own)),
    (
        "Optimizer.apply",
        lambda mp: mp.setattr(TFOptimizer, "apply", lambda self, grads, variables=None: None),
    ),
    ("train_step / test_step", lambda mp: mp.delattr(TensorFlowTrainer, "make_test_function")),
    (
        "train_step / test_step",
        lambda mp: mp.setattr(TensorFlowTrainer, "make_train_function", without_the_train_step),
    ),
    ("LossScaleOptimizer.check_finite", lambda mp: mp.delattr(LossScaleOptimizer, "check_finite")),
    ("_create_device_dataset", lambda mp: mp.delattr(multi_device_iterator_ops, "_create_device_dataset")),
    ("_maybe_symbolic_build", lambda mp: mp.delattr(TensorFlowTrainer, "_maybe_symbolic_build")),
    ("profiler.trace.enabled", lambda mp: mp.delattr(profiler_trace, "enabled")),
    ("profiler.trace.enabled", lambda mp: mp.setattr(profiler_trace, "enabled", "on")),
    ("context.abort_collective_ops", lambda mp: mp.delattr(eager_context.Context, "abort_collective_ops")),
    ("coordination service", lambda mp: mp.delattr(eager_context.Context, "coordination_service")),
    (
        "cross-replica optimizer steps",
        lambda mp: mp.setattr(merge_call_interim, "maybe_merge_call", merge_always),
    ),
    (
        "loss scaling for distribution",
        lambda mp: mp.delattr(keras_loss_module, "unscale_loss_for_distribution"),
    ),
    (
        "loss scaling for distribution",
        lambda mp: mp.setattr(keras_loss_module, "reduce_values", lambda values, *a, **k: values),
    ),
    ("tf.nn.compute_average_loss", lambda mp: mp.delattr(tf.nn, "compute_average_loss")),
    ("epoch iterators", lambda mp: mp.setattr(EpochIterator, "_enumerate_iterator", lambda self: iter(()))),
    ("_iterations", lambda mp: mp.setattr(BaseOptimizer, "apply", lambda self, grads, variables=None: None)),
    ("moving average", lambda mp: mp.delattr(BaseOptimizer, "_update_model_variables_moving_average")),
    (
        "moving average",
        lambda mp: mp.setattr(TFOptimizer, "_backend_apply_gradients", lambda self, g, v: None),
    ),
    ("moving average", lambda mp: mp.setattr(SwapEMAWeights, "_tf_swap_variables", lambda self, o: None)),
    ("optimizer variables", lambda mp: mp.delattr(BaseOptimizer, "_get_variable_index")),
    ("optimizer variables", lambda mp: mp.setattr(BaseOptimizer, "build", lambda self, variables: None)),
    ("distributed dataset iterators", lambda mp: mp.delattr(input_lib.DistributedDataset, "__iter__")),
    (
        "MirroredExtended._batch_reduce_to",
        lambda mp: mp.delattr(tf.distribute.StrategyExtended, "_container_strategy"),
    ),
    (
        "MirroredExtended._batch_reduce_to",
        lambda mp: mp.setattr(tf.distribute.StrategyExtended, "batch_reduce_to", lambda self, *a, **k: None),
    ),
    ("tracking", lambda mp: mp.delattr(tf.__internal__.tracking.Trackable, "_serialize_to_tensors")),
    (
        "tf_keras gradient sums",
        lambda mp: mp.delattr(tf_keras_optimizer.Optimizer, "aggregate_gradients"),
    ),
    (
        "tf_keras gradient sums",
        lambda mp: mp.delattr(tf_keras_optimizer_v2.OptimizerV2, "_aggregate_gradients"),
    ),
    ("tf_keras optimizer steps", lambda mp: mp.delattr(tf_keras_optimizer.Optimizer, "apply_gradients")),
    (
        "tf_keras optimizer steps",
        lambda mp: mp.delattr(tf_keras_optimizer_v2.OptimizerV2, "apply_gradients"),
    ),
    ("tf_keras optimizers.get", lambda mp: mp.delattr(tf_keras_optimizers, "get")),
    ("tf_keras optimizer index", lambda mp: mp.delattr(tf_keras_optimizer._BaseOptimizer, "_var_key")),
    (
        "tf_keras optimizer index",
        lambda mp: mp.setattr(tf_keras_optimizer._BaseOptimizer, "_build_index_dict", lambda self, v: None),
    ),
    (
        "tf_keras callback protocol",
        lambda mp: mp.delattr(tf_keras_callbacks.Callback, "_implements_train_batch_hooks"),
    ),
    ("BatchNormalization._moments", lambda mp: mp.delattr(keras.layers.BatchNormalization, "_moments")),
    (
        "BatchNormalization._moments",
        lambda mp: mp.setattr(
            keras.layers.BatchNormalization, "call", lambda self, inputs, training=None: inputs
        ),
    ),
]


def test_every_hook_has_a_removal_here() -> None:
    assert {hook for hook, _ in REMOVALS} == set(_compat.HOOKS)


@pytest.mark.parametrize(("hook", "remove"), REMOVALS, ids=[f"{h}-{i}" for i, (h, _) in enumerate(REMOVALS)])
def test_a_removed_hook_is_named_at_import_and_refused_on_use(
    hook: str, remove: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    remove(monkeypatch)
    found = _compat.hook_problem(hook)
    assert found is not None
    with pytest.warns(UserWarning, match="tf_adasum: ") as warned:
        _compat.warn_at_import()
    assert any(found in str(w.message) for w in warned)
    if hook in _compat.required_hooks():
        with pytest.raises(tf_adasum.HookError, match="tf_adasum cannot run safely with Keras") as raised:
            _compat.require(hook)
        first, last = _compat.TESTED_KERAS
        assert found in str(raised.value) and f"keras>={first},<{last}" in str(raised.value)


def test_the_profiler_flag_of_tensorflow_2_16_to_2_20_is_read_at_each_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tf_adasum._compat import profiler

    # TensorFlow 2.16 to 2.20 keep a module flag that the profiler's C++ sets; 2.21 a function.
    monkeypatch.setattr(profiler_trace, "enabled", False)
    assert _compat.hook_problem("profiler.trace.enabled") is None
    recording = profiler._reader()
    assert recording() is False
    monkeypatch.setattr(profiler_trace, "enabled", True)  # the profiler starts
    assert recording() is True


def test_without_the_loss_scale_hook_the_callback_and_allreduce_optimizer_refuse_to_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delattr(LossScaleOptimizer, "check_finite")
    with pytest.raises(tf_adasum.HookError, match="one replica's overflow would not skip the step"):
        tf_adasum.AdasumCallback()
    with pytest.raises(tf_adasum.HookError, match="LossScaleOptimizer has no check_finite"):
        tf_adasum.AllreduceOptimizer(keras.optimizers.SGD())


def test_a_train_step_that_syncs_is_compiled_without_xla() -> None:
    # Keras turns XLA on by default on a GPU host without a strategy; XLA cannot compile the sync.
    x, y, _, _ = problem()
    model = build_linear(tf.distribute.get_strategy(), lambda: tf_adasum.AdasumOptimizer(make_inner("adam")))
    model.jit_compile = True
    with pytest.warns(UserWarning, match=r"without XLA \(jit_compile=False\)"):
        model.fit(x[:8], y[:8], batch_size=8, verbose=0)
    assert model.jit_compile is False
    assert int(model.optimizer.iterations.numpy()) == 1


def test_without_the_gradient_sum_hook_adasum_optimizer_refuses_to_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delattr(TFOptimizer, "_all_reduce_sum_gradients")
    with pytest.raises(tf_adasum.HookError, match="would sum gradients across replicas"):
        tf_adasum.AdasumOptimizer(keras.optimizers.SGD())


def test_without_the_moving_average_hook_only_an_optimizer_with_use_ema_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delattr(BaseOptimizer, "_update_model_variables_moving_average")
    with pytest.raises(tf_adasum.HookError, match="each replica would average its own weights"):
        tf_adasum.AdasumOptimizer(keras.optimizers.SGD(use_ema=True))
    tf_adasum.AdasumOptimizer(keras.optimizers.SGD())


def test_when_compile_stops_resolving_optimizers_adasum_strategy_refuses_to_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(keras_trainer.Trainer, "compile", without_compile_through_get)
    with pytest.raises(tf_adasum.HookError, match="cannot wrap a plain optimizer"):
        tf_adasum.AdasumStrategy(devices=cpus(2))


def test_a_step_keras_passes_as_a_closure_is_refused_not_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    original = TensorFlowTrainer._make_function

    def make_function(self: Any, step_function: Any) -> Any:
        return original(self, lambda data: step_function(data))  # what a Keras release might do

    monkeypatch.setattr(TensorFlowTrainer, "_make_function", make_function)
    x, y, _, _ = problem()
    model = build_linear(tf_adasum.AdasumStrategy(devices=cpus(2)), lambda: make_inner("sgd_momentum"))
    with pytest.raises(tf_adasum.HookError, match="not the model's bound train_step"):
        model.fit(x[:8], y[:8], batch_size=8, verbose=0)
    with pytest.raises(tf_adasum.HookError, match="not the model's bound test_step"):
        model.evaluate(x[:8], y[:8], batch_size=8, verbose=0)


def test_keras_optimizers_get_is_replaced_once_public_and_private_alike() -> None:
    get = keras.optimizers.get
    assert get is keras_optimizers.get
    assert get._tf_adasum_original.__module__ == "keras.src.optimizers"
    _compat.install_optimizer_get(lambda optimizer: None)  # a second install changes nothing
    tf_adasum.AdasumStrategy(devices=cpus(2))
    assert keras.optimizers.get is get is keras_optimizers.get
    assert isinstance(keras.optimizers.get("sgd"), keras.optimizers.SGD)  # outside a strategy: untouched


def test_a_keras_or_tensorflow_outside_the_tested_range_warns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(keras, "__version__", "3.16.0")
    assert _compat.untested_versions() == ["Keras 3.16.0 (tested: >=3.10, <3.16)"]
    with pytest.warns(UserWarning, match=r"not tested with Keras 3\.16\.0 \(tested: >=3\.10, <3\.16\)"):
        _compat.warn_at_import()
    monkeypatch.setattr(keras, "__version__", "3.9.2")
    monkeypatch.setattr(tf, "__version__", "2.15.1")
    assert _compat.untested_versions() == [
        "TensorFlow 2.15.1 (tested: >=2.16, <2.22)",
        "Keras 3.9.2 (tested: >=3.10, <3.16)",
    ]


def test_the_package_metadata_bounds_are_the_tested_ranges() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    keras_first, keras_last = _compat.TESTED_KERAS
    tf_first, tf_last = _compat.TESTED_TENSORFLOW
    assert f"keras>={keras_first},<{keras_last}" in project["dependencies"]
    extras = project["optional-dependencies"]
    assert f"tensorflow-cpu>={tf_first},<{tf_last}" in extras["cpu"]
    assert f"tensorflow[and-cuda]>={tf_first},<{tf_last}" in extras["gpu"]


def test_another_keras_backend_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(keras.backend, "backend", lambda: "jax")
    with pytest.raises(RuntimeError, match="needs Keras's TensorFlow backend, but KERAS_BACKEND is 'jax'"):
        tf_adasum.AdasumOptimizer(keras.optimizers.SGD())
    with pytest.raises(RuntimeError, match="KERAS_BACKEND is 'jax'"):
        tf_adasum.AdasumStrategy(devices=cpus(2))


def test_the_mpi_engine_receives_into_tensor_memory_only_while_numpy_shares_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import tensorflow as tf

    tensor = tf.raw_ops.Empty(shape=[3], dtype=tf.float64, init=True)
    view = _compat.writable_view(tensor)
    assert view is not None
    view[:] = [1.0, 2.0, 3.0]
    np.testing.assert_array_equal(tensor.numpy(), [1.0, 2.0, 3.0])

    monkeypatch.setattr(numpy_views, "_view", lambda t: np.array(t))  # a release that hands out copies
    _compat.numpy_views_share_memory.cache_clear()
    try:
        with pytest.warns(UserWarning, match="the MPI engine copies each received buffer instead"):
            assert _compat.writable_view(tensor) is None
    finally:
        _compat.numpy_views_share_memory.cache_clear()


def test_without_the_abort_hook_a_group_end_aborts_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(eager_context.Context, "abort_collective_ops")
    assert _compat.abort_collectives("the group ended") is False
