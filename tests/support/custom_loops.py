"""TensorFlow's custom-loop tutorial, as the tests run it: its model, its steps and its data."""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from tests.support.training import make_inner, problem

STEPS = 4


def tutorial_model(
    strategy: tf.distribute.Strategy, kind: str, build: bool = True
) -> tuple[keras.Model, Any]:
    """The tutorial's model and optimizer, created under the scope (a linear model here, for the oracle)."""
    _, _, w, b = problem()
    with strategy.scope():
        layers = [keras.Input((3,))] if build else []
        model = keras.Sequential([*layers, keras.layers.Dense(2)])
        if build:
            model.set_weights([w, b])
        optimizer = make_inner(kind)
    return model, optimizer


def tutorial_steps(
    strategy: tf.distribute.Strategy,
    model: keras.Model,
    optimizer: Any,
    global_batch: int,
    average: str = "global_batch_size",
) -> Any:
    """The tutorial's train_step and distributed_train_step, as it writes them."""
    loss_object = keras.losses.MeanSquaredError(reduction=None)

    def compute_loss(labels: tf.Tensor, predictions: tf.Tensor) -> tf.Tensor:
        per_example_loss = loss_object(labels, predictions)
        if average == "global_batch_size":
            return tf.nn.compute_average_loss(per_example_loss, global_batch_size=global_batch)
        return tf.nn.compute_average_loss(per_example_loss)  # the replica context's count

    def train_step(inputs: Any) -> tf.Tensor:
        images, labels = inputs
        with tf.GradientTape() as tape:
            predictions = model(images, training=True)
            loss = compute_loss(labels, predictions)
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables, strict=True))
        return loss

    return train_step


def dataset(global_batch: int, steps: int = STEPS, first: int = 0) -> tf.data.Dataset:
    x, y, _, _ = problem()
    rows = slice(first * global_batch, (first + steps) * global_batch)
    return tf.data.Dataset.from_tensor_slices((x[rows], y[rows])).batch(global_batch)
