"""tf_keras (Keras 2, `tf.keras` under TF_USE_LEGACY_KERAS=1): what serves it, and what refuses it.

The Horovod face serves tf_keras scripts: DistributedOptimizer (Adasum after the optimizer, or the
gradients averaged before it), the broadcast and metric-average callbacks, and the collectives with
DistributedGradientTape. They run across 2 processes, under tf_adasum.run and horovodrun, against numpy.
The other ways in are built on Keras 3: given a tf_keras model or optimizer, each refuses it at once,
naming the object and what works instead, and changes nothing; none trains it another way (under
AdasumStrategy tf_keras's own optimizer would average the replicas' gradients). The Keras of an object is
read from its class, so these run in a process where `tf.keras` is Keras 3.
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
from tests.support.training import Replica, cpus, mse_grads
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
    [lambda o: tf_adasum.AdasumOptimizer(o), lambda o: AllreduceOptimizer(o)],
    ids=["AdasumOptimizer", "AllreduceOptimizer"],
)
def test_the_optimizer_wrappers_refuse_a_tf_keras_optimizer_naming_it(wrap: Any) -> None:
    with pytest.raises(TypeError) as raised:
        wrap(tf_keras.optimizers.Adam(0.01))
    message = str(raised.value)
    assert "tf_keras (Keras 2) object, tf_keras.src.optimizers.adam.Adam" in message, message
    assert "serves Keras 3" in message and WHAT_WORKS in message, message


@pytest.mark.parametrize("op", ["Adasum", "Average", "Sum"])
def test_horovods_distributed_optimizer_remakes_a_tf_keras_optimizer_as_its_own_class(op: str) -> None:
    inner = tf_keras.optimizers.Adam(0.003, beta_1=0.8, name="mine")
    wrapped = hvd.DistributedOptimizer(inner, op=getattr(hvd, op))
    assert isinstance(wrapped, tf_keras.optimizers.Adam) and type(wrapped).__name__ == "Adam"
    assert wrapped.get_config() == inner.get_config()
    assert getattr(wrapped, "_tf_adasum_state_per_process", False) is (op == "Adasum")
    with pytest.raises(NotImplementedError, match=r"register_local_var on a tf_keras \(Keras 2\) optimizer"):
        wrapped.register_local_var(tf.Variable(1.0))


def test_horovods_distributed_optimizer_refuses_what_it_does_not_build_for_tf_keras() -> None:
    for kwargs in ({"backward_passes_per_step": 2}, {"groups": 2}):
        with pytest.raises(NotImplementedError, match="only the defaults are built for tf_keras"):
            hvd.DistributedOptimizer(tf_keras.optimizers.SGD(0.1), op=hvd.Adasum, **kwargs)


def test_distributed_optimizer_in_one_process_steps_as_the_plain_tf_keras_optimizer() -> None:
    x, y = _data()
    for op in (hvd.Adasum, hvd.Average):
        plain, wrapped = _model(), _model()
        wrapped.set_weights(plain.get_weights())
        wrapped.compile(hvd.DistributedOptimizer(tf_keras.optimizers.Adam(0.01), op=op), "mse")
        plain.compile(tf_keras.optimizers.Adam(0.01), "mse")
        for model in (plain, wrapped):
            model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        for a, b in zip(plain.get_weights(), wrapped.get_weights(), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)  # a world of one changes nothing


LEARNING_RATE_CALLBACKS = {
    "schedule-staircase": lambda: hvd.callbacks.LearningRateScheduleCallback(0.1, 0.5, start_epoch=1),
    "schedule-per-batch": lambda: hvd.callbacks.LearningRateScheduleCallback(
        0.1, lambda epoch: 1.0 / (1.0 + epoch), staircase=False
    ),
    "warmup": lambda: hvd.callbacks.LearningRateWarmupCallback(0.1, warmup_epochs=2),
}


@pytest.mark.parametrize("name", sorted(LEARNING_RATE_CALLBACKS))
def test_the_learning_rate_callbacks_set_a_tf_keras_optimizer_as_a_keras_3_one(name: str) -> None:
    x, y = _data()
    seen = {}
    for k in (keras, tf_keras):
        model = k.Sequential([k.Input((3,)), k.layers.Dense(2)])
        model.compile(k.optimizers.SGD(0.1), "mse")

        class Record(k.callbacks.Callback):
            def __init__(self) -> None:
                super().__init__()
                self.rates: list[float] = []

            def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
                self.rates.append(float(tf.convert_to_tensor(self.model.optimizer.learning_rate)))

        callback = LEARNING_RATE_CALLBACKS[name]()
        record = Record()
        history = model.fit(x, y, batch_size=8, epochs=3, verbose=0, callbacks=[callback, record])
        seen[k.__name__] = (record.rates, history.history["lr"])
    assert len(seen["keras"][0]) == 12 and seen["tf_keras"] == seen["keras"], seen
    if name.startswith("schedule"):
        assert len(set(seen["keras"][0])) > 1, "the schedule changed the rate"


CALLBACKS = {
    "AdasumCallback": lambda tmp: tf_adasum.AdasumCallback(),
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


def _fit_reference(ranks: list[Any], op: str) -> tuple[list[np.ndarray], list[float]]:
    """numpy's fit of the worker's linear model: rank 0's start, SGD with momentum, 2 epochs of 2 batches;
    Adasum of the processes' steps (each with its own momentum), or their gradients' mean. Also each
    epoch's loss, the mean over batches and processes, as fit with MetricAverageCallback logs it."""
    params = [ranks[0]["start"].astype(np.float64), ranks[0]["start_bias"].astype(np.float64)]
    replicas = [Replica("sgd_momentum", params) for _ in ranks]
    shared = Replica("sgd_momentum", params)
    losses = []
    for _epoch in range(2):
        epoch = []
        for batch in range(2):
            rows = slice(16 * batch, 16 * (batch + 1))
            data = [(r["x"][rows].astype(np.float64), r["y"][rows].astype(np.float64)) for r in ranks]
            epoch += [float(np.mean((x @ params[0] + params[1] - y) ** 2)) for x, y in data]
            grads = [mse_grads(params, x, y) for x, y in data]
            if op == "adasum":
                deltas = [
                    [after - before for after, before in zip(rep.step(params, g, 0), params, strict=True)]
                    for rep, g in zip(replicas, grads, strict=True)
                ]
                params = [p + d for p, d in zip(params, oracle.tree(deltas), strict=True)]
            else:
                mean = [np.mean(parts, axis=0) for parts in zip(*grads, strict=True)]
                params = shared.step(params, mean, 0)
        losses.append(float(np.mean(epoch)))
    return params, losses


@pytest.mark.multiprocess
@pytest.mark.parametrize("launcher", ["tf", "horovodrun"])
def test_tf_keras_scripts_with_the_import_changed_equal_numpy(launcher: str, tmp_path: Path) -> None:
    """Horovod's `tf.keras` shapes, with the import line changed, on 2 processes, under tf_adasum.run and
    horovodrun (Gloo):
    - a custom loop with DistributedGradientTape(op=Adasum), as tf_keras and as Keras 3: each step is SGD
      on the Adasum of the ranks' gradients;
    - model.fit with DistributedOptimizer(SGD with momentum), BroadcastGlobalVariablesCallback,
      MetricAverageCallback and a checkpoint on rank 0: with op=Adasum each process steps with its own
      momentum and the steps are combined with Adasum, with op=Average the gradients are averaged; every
      epoch's logged loss is the mean over processes.
    The ranks end bitwise alike, from different initial weights."""
    # One Keras a launch: a process's `tf.keras` is one Keras for good.
    for chained, legacy in (("keras2,keras2_fit_adasum,keras2_fit_average", "1"), ("keras3", "0")):
        worker = ["-m", "tests.workers.keras2", str(tmp_path), chained]
        code = launch(launcher, 2, tmp_path, worker, extra_env={"TF_USE_LEGACY_KERAS": legacy})
        assert code == 0, log_tail(tmp_path)
    finals = {}
    for mode in ("keras2", "keras3", "keras2_fit_adasum", "keras2_fit_average"):
        ranks = [np.load(tmp_path / f"{mode}{r}.npz") for r in range(2)]
        for name in ("w", "b"):
            np.testing.assert_array_equal(ranks[0][name], ranks[1][name], err_msg=f"{mode}: {name}")
        if mode.startswith("keras2_fit"):
            assert str(ranks[0]["optimizer"]).startswith("tf_keras."), ranks[0]["optimizer"]
            params, losses = _fit_reference(ranks, mode.rsplit("_", 1)[1])
            np.testing.assert_allclose(ranks[0]["loss"], ranks[1]["loss"], rtol=0, atol=0)
            np.testing.assert_allclose(ranks[0]["loss"], losses, rtol=1e-5, err_msg=mode)
            assert (tmp_path / f"{mode}.weights.h5").exists(), "rank 0's checkpoint"
        else:
            params = [ranks[0]["start"].astype(np.float64), ranks[0]["start_bias"].astype(np.float64)]
            for _ in range(3):
                grads = [
                    mse_grads(params, r["x"].astype(np.float64), r["y"].astype(np.float64)) for r in ranks
                ]
                params = [p - 0.1 * g for p, g in zip(params, oracle.tree(grads), strict=True)]
        np.testing.assert_allclose(ranks[0]["w"], params[0], rtol=1e-5, atol=1e-6, err_msg=mode)
        np.testing.assert_allclose(ranks[0]["b"], params[1], rtol=1e-5, atol=1e-6, err_msg=mode)
        finals[mode] = ranks[0]["w"]
    np.testing.assert_allclose(finals["keras2"], finals["keras3"], rtol=1e-6, atol=1e-7)
