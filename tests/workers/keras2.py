"""The worker of tests/test_keras2.py's test across processes: `python -m tests.workers.keras2 OUT MODE`
(tests/workers/dispatch.py), one mode a launch, where MODE names the Keras that `tf.keras` is:

    keras2   TF_USE_LEGACY_KERAS=1: `tf.keras` is tf_keras (Keras 2)
    keras3   `tf.keras` is Keras 3

The same custom loop either way, Horovod's `tf.keras` shape: a linear model, SGD, the gradients combined
by DistributedGradientTape(op=Adasum), the variables broadcast from rank 0 first. Each rank writes its
data, the start and its final weights to OUT/{MODE}{rank}.npz; the test checks them against numpy.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
if len(sys.argv) > 2 and sys.argv[2] == "keras2":
    os.environ["TF_USE_LEGACY_KERAS"] = "1"  # before TensorFlow is imported, as a Keras 2 script sets it

import numpy as np
import tensorflow as tf

import tf_adasum.tensorflow as hvd
from tests.workers.dispatch import main

LR = 0.1
STEPS = 3


def custom_loop(out: Path, expected_keras: str) -> None:
    hvd.init()
    assert tf.keras.__name__.split(".")[0] == expected_keras, tf.keras.__name__
    rank = hvd.rank()
    rng = np.random.default_rng(100 + rank)
    x = rng.standard_normal((16, 3)).astype(np.float32)
    y = rng.standard_normal((16, 2)).astype(np.float32)
    start = [rng.standard_normal((3, 2)).astype(np.float32), rng.standard_normal(2).astype(np.float32)]
    model = tf.keras.Sequential([tf.keras.Input((3,)), tf.keras.layers.Dense(2)])
    model.set_weights(start)  # rank 0's start reaches every rank through the broadcast
    optimizer = tf.keras.optimizers.SGD(LR)
    hvd.broadcast_variables(model.variables, root_rank=0)

    @tf.function
    def step() -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
        tape = hvd.DistributedGradientTape(tape, op=hvd.Adasum)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    for _ in range(STEPS):
        step()
    np.savez(out / f"{expected_keras}{rank}.npz", x=x, y=y, start=start[0], start_bias=start[1],
             w=model.get_weights()[0], b=model.get_weights()[1])  # fmt: skip
    print(f"rank {rank}: {tf.keras.__name__} custom loop done", flush=True)


if __name__ == "__main__":
    main(
        {"keras2": lambda out: custom_loop(out, "tf_keras"), "keras3": lambda out: custom_loop(out, "keras")}
    )
