"""tf_keras (Keras 2, `tf.keras` under TF_USE_LEGACY_KERAS=1): what works with it today, and what refuses it.

tf_adasum's three ways in serve Keras 3. Given a tf_keras model or optimizer, each refuses it at once,
naming the object and what works instead, and changes nothing; none trains it another way (under
AdasumStrategy tf_keras's own optimizer would average the replicas' gradients). The Keras of an object is
read from its class, so these run in a process where `tf.keras` is Keras 3. What works today, a custom
loop with DistributedGradientTape(op=Adasum), runs across 2 processes with `tf.keras` as tf_keras and as
Keras 3, against numpy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import tf_adasum
import tf_adasum.keras as hvd
from tests.support import oracle
from tests.support.processes import launch, log_tail
from tests.support.training import cpus, mse_grads
from tf_adasum import _compat
from tf_adasum._compat import keras2
from tf_adasum.common.errors import HookError
from tf_adasum.training.allreduce_optimizer import AllreduceOptimizer

WHAT_WORKS = "DistributedGradientTape"


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.standard_normal((32, 3)).astype(np.float32), rng.standard_normal((32, 2)).astype(np.float32)


def _model() -> Any:
    model = tf_keras.Sequential([tf_keras.Input((3,)), tf_keras.layers.Dense(2)])
    model.compile(tf_keras.optimizers.SGD(0.1), "mse")
    return model


def _unchanged(model: Any, before: list[np.ndarray]) -> None:
    for a, b in zip(before, model.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)


def test_the_keras_of_an_object_is_read_from_its_class() -> None:
    class Mine(tf_keras.optimizers.SGD):  # a user's subclass, defined outside tf_keras
        pass

    assert keras2.keras_2_name(tf_keras.optimizers.SGD()) == "tf_keras.src.optimizers.sgd.SGD"
    assert keras2.keras_2_name(Mine()) is not None and keras2.keras_2_name(Mine) is not None
    assert keras2.keras_2_name(_model()) is not None
    for keras_3 in (keras.optimizers.SGD(), keras.Sequential([keras.layers.Dense(1)]), object()):
        assert keras2.keras_2_name(keras_3) is None


@pytest.mark.parametrize(
    "wrap",
    [
        lambda o: tf_adasum.AdasumOptimizer(o),
        lambda o: AllreduceOptimizer(o),
        lambda o: hvd.DistributedOptimizer(o, op=hvd.Adasum),
        lambda o: hvd.DistributedOptimizer(o, op=hvd.Average),
    ],
    ids=[
        "AdasumOptimizer",
        "AllreduceOptimizer",
        "DistributedOptimizer-Adasum",
        "DistributedOptimizer-Average",
    ],
)
def test_the_optimizer_wrappers_refuse_a_tf_keras_optimizer_naming_it(wrap: Any) -> None:
    with pytest.raises(TypeError) as raised:
        wrap(tf_keras.optimizers.Adam(0.01))
    message = str(raised.value)
    assert "tf_keras (Keras 2) object, tf_keras.src.optimizers.adam.Adam" in message, message
    assert "serves Keras 3" in message and WHAT_WORKS in message, message


CALLBACKS = {
    "AdasumCallback": lambda tmp: tf_adasum.AdasumCallback(),
    "BroadcastGlobalVariablesCallback": lambda tmp: hvd.callbacks.BroadcastGlobalVariablesCallback(0),
    "MetricAverageCallback": lambda tmp: hvd.callbacks.MetricAverageCallback(),
    "LearningRateWarmupCallback": lambda tmp: hvd.callbacks.LearningRateWarmupCallback(0.1, warmup_epochs=1),
    "LearningRateScheduleCallback": lambda tmp: hvd.callbacks.LearningRateScheduleCallback(
        0.1, multiplier=0.5
    ),
    "BestModelCheckpoint": lambda tmp: hvd.callbacks.BestModelCheckpoint(str(tmp / "best.weights.h5")),
    "OrthogonalityMonitor": lambda tmp: tf_adasum.callbacks.OrthogonalityMonitor(),
    "CommitStateCallback": lambda tmp: hvd.elastic.CommitStateCallback(None),
}


@pytest.mark.parametrize("name", sorted(CALLBACKS))
def test_every_callback_refuses_a_tf_keras_model_before_it_trains(name: str, tmp_path: Path) -> None:
    x, y = _data()
    model = _model()
    before = model.get_weights()
    callback = CALLBACKS[name](tmp_path)
    assert type(callback).__name__ == name
    with pytest.raises(TypeError) as raised:
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[callback])
    message = str(raised.value)
    assert message.startswith(f"{name} was given a tf_keras (Keras 2) object, ") and WHAT_WORKS in message, (
        message
    )
    _unchanged(model, before)


def test_the_elastic_keras_state_refuses_a_tf_keras_model() -> None:
    with pytest.raises(TypeError, match=r"^KerasState was given a tf_keras \(Keras 2\) object, "):
        hvd.elastic.KerasState(_model(), batch=0, epoch=0)


def test_adasum_strategy_refuses_a_tf_keras_models_fit_evaluate_and_predict() -> None:
    x, y = _data()
    strategy = tf_adasum.AdasumStrategy(cpus(2))
    with strategy.scope():
        model = _model()
    before = model.get_weights()
    for run in (
        lambda: model.fit(x, y, batch_size=8, epochs=1, verbose=0),
        lambda: model.evaluate(x, y, batch_size=8, verbose=0),
        lambda: model.predict(x, batch_size=8, verbose=0),
    ):
        with pytest.raises(
            TypeError, match=r"AdasumStrategy: this model's fit, evaluate or predict is tf_keras's"
        ):
            run()
    _unchanged(model, before)


@pytest.mark.parametrize("legacy", [False, True], ids=["optimizer", "legacy-optimizer"])
def test_adasum_strategy_refuses_a_tf_keras_optimizer_in_a_custom_loop(legacy: bool) -> None:
    x, y = _data()
    strategy = tf_adasum.AdasumStrategy(cpus(2))
    with strategy.scope():
        model = tf_keras.Sequential([tf_keras.Input((3,)), tf_keras.layers.Dense(2)])
        optimizer = (tf_keras.optimizers.legacy.SGD if legacy else tf_keras.optimizers.SGD)(0.1)
    before = model.get_weights()
    name = type(optimizer).__name__

    @tf.function
    def train(xb: tf.Tensor, yb: tf.Tensor) -> None:
        def step(xr: tf.Tensor, yr: tf.Tensor) -> None:
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(xr) - yr))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))

        strategy.run(step, args=(xb, yb))

    with pytest.raises(
        TypeError, match=rf"AdasumStrategy: optimizer {name} is tf_keras's \(Keras 2\), which would"
    ):
        train(tf.constant(x[:8]), tf.constant(y[:8]))
    _unchanged(model, before)


def test_a_missing_tf_keras_hook_fails_its_fence_check(monkeypatch: pytest.MonkeyPatch) -> None:
    from tf_keras.src.optimizers import optimizer as tf_keras_optimizer

    assert keras2._check_gradient_sums() is None
    monkeypatch.delattr(tf_keras_optimizer.Optimizer, "aggregate_gradients")
    problem = _compat.HOOKS["tf_keras gradient sums"].check()
    assert problem is not None and "Optimizer.aggregate_gradients" in problem, problem
    with pytest.raises(HookError, match="cannot refuse a tf_keras optimizer under AdasumStrategy"):
        _compat.install_keras_2_gradient_sum_guard(lambda optimizer: None)


@pytest.mark.multiprocess
@pytest.mark.parametrize("launcher", ["tf", "horovodrun"])
def test_a_tf_keras_custom_loop_with_distributed_gradient_tape_equals_numpy_and_keras_3(
    launcher: str, tmp_path: Path
) -> None:
    """Horovod's `tf.keras` custom loop, with the import line changed, as tf_keras and as Keras 3: every
    step's update is SGD on the Adasum of the two ranks' gradients, and the ranks end bitwise alike; under
    tf_adasum.run and under horovodrun (Gloo)."""
    for mode in ("keras2", "keras3"):  # one launch each: a process's `tf.keras` is one Keras for good
        code = launch(launcher, 2, tmp_path, ["-m", "tests.workers.keras2", str(tmp_path), mode])
        assert code == 0, log_tail(tmp_path)
    finals = {}
    for kind in ("tf_keras", "keras"):
        ranks = [np.load(tmp_path / f"{kind}{r}.npz") for r in range(2)]
        np.testing.assert_array_equal(ranks[0]["w"], ranks[1]["w"])
        np.testing.assert_array_equal(ranks[0]["b"], ranks[1]["b"])
        params = [ranks[0]["start"].astype(np.float64), ranks[0]["start_bias"].astype(np.float64)]
        for _ in range(3):
            grads = [mse_grads(params, r["x"].astype(np.float64), r["y"].astype(np.float64)) for r in ranks]
            params = [p - 0.1 * g for p, g in zip(params, oracle.tree(grads), strict=True)]
        np.testing.assert_allclose(ranks[0]["w"], params[0], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(ranks[0]["b"], params[1], rtol=1e-5, atol=1e-6)
        finals[kind] = (ranks[0]["w"], ranks[0]["b"])
    np.testing.assert_allclose(finals["tf_keras"][0], finals["keras"][0], rtol=1e-6, atol=1e-7)
