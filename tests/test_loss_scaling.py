"""Each replica's local step is a single-worker step, however the loss was built
(tf_adasum/training/loss_scaling.py).

One SGD step from known weights, on N = 2 and 4 replicas (logical CPUs), against numpy: the weights plus
the contract tree over every replica's single-worker step on its own rows. The losses: the compiled loss;
a train_step with compute_loss; a train_step with a hand-built loss (ops.mean of a loss function, no
Loss object); a compiled loss plus a regularizer added by hand; add_loss; a GAN-like step with two
optimizers; AdasumOptimizer under MirroredStrategy; a custom loop with tf.nn.compute_average_loss; and a
custom loop whose loss tf_adasum cannot see scaled, which warns. tests/test_loss_scaling_processes.py runs
the hand-built case across 2 processes.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import ops

import tf_adasum
from tests import oracle
from tf_adasum.training import loss_scaling

LR, ROWS, REG = 0.1, 8, 0.05


def cpus(p: int) -> list[str]:
    return [d.name for d in tf.config.list_logical_devices("CPU")[:p]]


def data(n: int, seed: int = 0) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n * ROWS, 3)).astype(np.float32)
    y = rng.standard_normal((n * ROWS, 2)).astype(np.float32)
    w = rng.standard_normal((3, 2)).astype(np.float32)
    return x, y, w, (0.1 * rng.standard_normal(2)).astype(np.float32)


def mse_grads(w: np.ndarray, b: np.ndarray, x: np.ndarray, y: np.ndarray) -> list[np.ndarray]:
    err = x @ w + b - y
    return [2 * x.T @ err / err.size, 2 * err.sum(0) / err.size]


def expected(
    n: int, w: np.ndarray, b: np.ndarray, x: np.ndarray, y: np.ndarray, regularized: bool = False
) -> list[np.ndarray]:
    """The weights after one step: Adasum (the tree) of each replica's single-worker SGD step."""
    w, b, x, y = (a.astype(np.float64) for a in (w, b, x, y))
    steps = []
    for r in range(n):
        rows = slice(r * ROWS, (r + 1) * ROWS)
        gw, gb = mse_grads(w, b, x[rows], y[rows])
        if regularized:
            gw = gw + 2 * REG * w
        steps.append([-LR * gw, -LR * gb])
    delta = oracle.tree(steps)
    return [w + delta[0], b + delta[1]]


def linear(w: np.ndarray, b: np.ndarray, cls: type = keras.Model, **kwargs: Any) -> keras.Model:
    inputs = keras.Input((3,))
    dense = keras.layers.Dense(2, name="dense")
    model = cls(inputs, dense(inputs), **kwargs)
    dense.set_weights([w, b])
    return model


class HandBuilt(keras.Model):
    """keras-io's VAE pattern: the loss built in train_step with ops.mean and a loss function."""

    def train_step(self, data: Any) -> dict[str, Any]:
        x, y = data
        with tf.GradientTape() as tape:
            loss = ops.mean(keras.losses.mean_squared_error(y, self(x, training=True)))
        self.optimizer.apply(tape.gradient(loss, self.trainable_weights), self.trainable_weights)
        return {"loss": loss}


class WithComputeLoss(keras.Model):
    def train_step(self, data: Any) -> dict[str, Any]:
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
        self.optimizer.apply(tape.gradient(loss, self.trainable_weights), self.trainable_weights)
        return {"loss": loss}


class Mixed(keras.Model):
    """compute_loss (Keras scales it) plus a regularizer added by hand (nothing scales it)."""

    def train_step(self, data: Any) -> dict[str, Any]:
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
            loss = loss + REG * ops.sum(ops.square(self.get_layer("dense").kernel))
        self.optimizer.apply(tape.gradient(loss, self.trainable_weights), self.trainable_weights)
        return {"loss": loss}


class L2OnKernel(keras.layers.Dense):
    def call(self, inputs: Any) -> Any:
        self.add_loss(REG * ops.sum(ops.square(self.kernel)))
        return super().call(inputs)


def fit_once(
    strategy: Any, n: int, build: Callable[..., keras.Model], compiled: Callable[[], dict[str, Any]]
) -> Any:
    """One step of fit; the model and what compile takes (compiled()) are made under the strategy."""
    x, y, w, b = data(n)
    with strategy.scope():
        model = build(w, b)
        model.compile(**compiled())
    model.fit(x, y, batch_size=n * ROWS, epochs=1, shuffle=False, verbose=0)
    return model, (x, y, w, b)


def assert_weights(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    for g, e in zip(got, want, strict=True):
        np.testing.assert_allclose(g, e, rtol=2e-5, atol=2e-6)


CASES = {
    "compiled loss": (lambda w, b: linear(w, b), {"loss": "mse"}, False),
    "train_step with compute_loss": (lambda w, b: linear(w, b, WithComputeLoss), {"loss": "mse"}, False),
    "train_step with a hand-built loss": (lambda w, b: linear(w, b, HandBuilt), {}, False),
    "compiled loss plus a hand-built regularizer": (lambda w, b: linear(w, b, Mixed), {"loss": "mse"}, True),
}


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_fit_under_adasum_strategy_steps_single_workers(case: str, n: int) -> None:
    build, kwargs, regularized = CASES[case]
    model, (x, y, w, b) = fit_once(
        tf_adasum.AdasumStrategy(devices=cpus(n)),
        n,
        build,
        lambda: {"optimizer": keras.optimizers.SGD(LR), **kwargs},
    )
    assert_weights(model.get_layer("dense").get_weights(), expected(n, w, b, x, y, regularized))


@pytest.mark.parametrize("n", [2, 4])
def test_add_loss_steps_single_workers(n: int) -> None:
    x, y, w, b = data(n)
    with tf_adasum.AdasumStrategy(devices=cpus(n)).scope():
        inputs = keras.Input((3,))
        model = keras.Model(inputs, L2OnKernel(2, name="dense")(inputs))
        model.get_layer("dense").set_weights([w, b])
        model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse")
    model.fit(x, y, batch_size=n * ROWS, epochs=1, shuffle=False, verbose=0)
    assert_weights(model.get_layer("dense").get_weights(), expected(n, w, b, x, y, regularized=True))


class TwoOptimizers(keras.Model):
    """A GAN's shape: two parts, each with its own optimizer and its own loss, one a Loss object and one
    built by hand, stepped in one train_step (keras-io's DCGAN compiles its optimizers this way)."""

    def __init__(self, first: keras.Model, second: keras.Model) -> None:
        super().__init__()
        self.first, self.second = first, second

    def compile(self, first_optimizer: Any, second_optimizer: Any) -> None:
        super().compile()
        self.first_optimizer, self.second_optimizer = first_optimizer, second_optimizer
        self.loss_fn = keras.losses.MeanSquaredError()

    def call(self, x: Any) -> Any:
        return self.first(x) + self.second(x)

    def train_step(self, data: Any) -> dict[str, Any]:
        x, y = data
        with tf.GradientTape() as tape:
            first_loss = self.loss_fn(y, self.first(x, training=True))
        self.first_optimizer.apply(
            tape.gradient(first_loss, self.first.trainable_weights), self.first.trainable_weights
        )
        with tf.GradientTape() as tape:
            second_loss = ops.mean(ops.square(self.second(x, training=True) - y))
        grads = tape.gradient(second_loss, self.second.trainable_weights)
        self.second_optimizer.apply(grads, self.second.trainable_weights)
        return {"first": first_loss, "second": second_loss}


@pytest.mark.parametrize("n", [2, 4])
def test_a_gans_two_optimizers_step_single_workers(n: int) -> None:
    x, y, w, b = data(n)
    _, _, w2, b2 = data(n, seed=1)
    with tf_adasum.AdasumStrategy(devices=cpus(n)).scope():
        model = TwoOptimizers(linear(w, b), linear(w2, b2))
        model.compile(keras.optimizers.SGD(LR), keras.optimizers.SGD(LR))
    model.fit(x, y, batch_size=n * ROWS, epochs=1, shuffle=False, verbose=0)
    assert_weights(model.first.get_layer("dense").get_weights(), expected(n, w, b, x, y))
    assert_weights(model.second.get_layer("dense").get_weights(), expected(n, w2, b2, x, y))


@pytest.mark.parametrize("n", [2, 4])
def test_adasum_optimizer_under_mirrored_strategy_with_a_hand_built_loss(n: int) -> None:
    model, (x, y, w, b) = fit_once(
        tf.distribute.MirroredStrategy(cpus(n)),
        n,
        lambda w, b: linear(w, b, HandBuilt),
        lambda: {"optimizer": tf_adasum.AdasumOptimizer(keras.optimizers.SGD(LR))},
    )
    assert_weights(model.get_layer("dense").get_weights(), expected(n, w, b, x, y))


def custom_loop(
    n: int, loss_of: Callable[[Any, Any], Any], strategy: Any = None
) -> tuple[list[np.ndarray], tuple[np.ndarray, ...]]:
    """One step of TensorFlow's custom-training tutorial under AdasumStrategy (strategy.run, a tape, a
    plain optimizer's apply_gradients); n replicas in all."""
    x, y, w, b = data(n)
    strategy = strategy or tf_adasum.AdasumStrategy(devices=cpus(n))
    with strategy.scope():
        model = linear(w, b)
        optimizer = keras.optimizers.SGD(LR)
    batches = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(n * ROWS)
    )

    @tf.function
    def train(batch: Any) -> None:
        def step(inputs: Any) -> None:
            features, labels = inputs
            with tf.GradientTape() as tape:
                loss = loss_of(labels, model(features, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))

        strategy.run(step, args=(batch,))

    for batch in batches:
        train(batch)
    return model.get_layer("dense").get_weights(), (x, y, w, b)


@pytest.mark.parametrize("n", [2, 4])
def test_a_custom_loop_with_compute_average_loss_steps_single_workers(n: int) -> None:
    def loss_of(labels: Any, predictions: Any) -> Any:
        return tf.nn.compute_average_loss(keras.losses.mean_squared_error(labels, predictions))

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the scale is known: no warning
        got, (x, y, w, b) = custom_loop(n, loss_of)
    assert_weights(got, expected(n, w, b, x, y))


def test_a_custom_loop_whose_scale_cannot_be_known_warns_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loss_scaling, "_warned", False)

    def loss_of(labels: Any, predictions: Any) -> Any:  # each replica's own mean, built by hand
        return tf.reduce_mean(tf.square(predictions - labels))

    with pytest.warns(UserWarning, match="a loss whose scale tf_adasum cannot tell") as warned:
        custom_loop(2, loss_of)
    assert len([w for w in warned if "cannot tell" in str(w.message)]) == 1
    assert "tf.nn.compute_average_loss" in str(warned[0].message)
