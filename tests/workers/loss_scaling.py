"""The worker of tests/test_loss_scaling_processes.py: one SGD step under AdasumStrategy across processes,
one replica each, with the losses of tests/test_loss_scaling.py (its data, models and numpy prediction).

Modes (each writes OUT/<mode><rank>.npz, the dense layer's weights after the step):
    hand_built      fit with a train_step whose loss is ops.mean of a loss function
    mixed           fit with compute_loss plus a regularizer added by hand
    average_loss    a custom loop (strategy.run) with tf.nn.compute_average_loss
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import keras
import numpy as np
import tensorflow as tf

import tf_adasum
from tests.support.loss_scaling import HandBuilt, Mixed, custom_loop, data, fit_once, linear
from tests.workers.dispatch import main


def _save(out: Path, mode: str, weights: list[np.ndarray]) -> None:
    np.savez(out / f"{mode}{tf_adasum.rank()}.npz", *weights)


def _fit(out: Path, mode: str, cls: type, compiled: dict[str, Any]) -> None:
    size = tf_adasum.init().size
    model, _ = fit_once(
        tf_adasum.AdasumStrategy(),
        size,
        lambda w, b: linear(w, b, cls),
        lambda: {"optimizer": keras.optimizers.SGD(0.1), **compiled},
    )
    _save(out, mode, model.get_layer("dense").get_weights())


def hand_built(out: Path) -> None:
    _fit(out, "hand_built", HandBuilt, {})


def mixed(out: Path) -> None:
    _fit(out, "mixed", Mixed, {"loss": "mse"})


def average_loss(out: Path) -> None:
    def loss_of(labels: Any, predictions: Any) -> Any:
        return tf.nn.compute_average_loss(keras.losses.mean_squared_error(labels, predictions))

    weights, _ = custom_loop(tf_adasum.init().size, loss_of, tf_adasum.AdasumStrategy())
    _save(out, "average_loss", weights)


MODES = {"hand_built": hand_built, "mixed": mixed, "average_loss": average_loss}

if __name__ == "__main__":
    assert data  # the same rows on every process: the strategy takes each process's share
    main(MODES)
