"""The loss-scaling cases: one SGD step from known weights against numpy, the models whose losses
are built each way, and a custom loop."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from keras import ops

import tf_adasum
from tests.support import oracle

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
