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
from typing import Any

import keras
import pytest
import tensorflow as tf
from keras import ops

import tf_adasum
from tests.support.loss_scaling import (
    LR,
    ROWS,
    HandBuilt,
    L2OnKernel,
    Mixed,
    WithComputeLoss,
    assert_weights,
    cpus,
    custom_loop,
    data,
    expected,
    fit_once,
    linear,
)
from tf_adasum.training import loss_scaling

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
