"""The worker of tests/test_training.py's many-replicas test: AdasumStrategy over many logical CPUs in a
fresh process (the test process has only four), no launcher:
`python -m tests.workers.training_replicas OUT MODE[,MODE...]` (tests/workers/dispatch.py), with
$TF_ADASUM_TEST_REPLICAS logical CPUs and $TF_ADASUM_TEST_EPOCHS epochs (default 8).

Modes:
    fit_then_predict  fits a one-conv CNN (SGD with momentum, 32 examples per replica, 4 steps per epoch),
                      writing the epochs done to OUT/replicas.progress as each ends, then predicts with
                      the trained model on a partial last batch; writes the epochs completed, the seconds
                      per epoch and what predict gave to OUT/replicas.json

The logical CPUs are configured before tf_adasum and Keras are imported.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np
import tensorflow as tf

from tests.workers.dispatch import main

REPLICAS, EPOCHS = "TF_ADASUM_TEST_REPLICAS", "TF_ADASUM_TEST_EPOCHS"


def configure_devices() -> None:
    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0],
        [tf.config.LogicalDeviceConfiguration()] * int(os.environ[REPLICAS]),
    )


def fit_then_predict(out: Path) -> None:
    import keras

    import tf_adasum

    replicas, epochs = int(os.environ[REPLICAS]), int(os.environ.get(EPOCHS, "8"))
    strategy = tf_adasum.AdasumStrategy()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32 * replicas * 4, 8, 8, 1)).astype(np.float32)
    y = rng.integers(0, 10, len(x))
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((8, 8, 1)),
                keras.layers.Conv2D(8, 3, activation="relu"),
                keras.layers.Flatten(),
                keras.layers.Dense(10),
            ]
        )
        model.compile(
            optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    ends: list[float] = []

    class Clock(keras.callbacks.Callback):
        def on_epoch_end(self, epoch: int, logs: object = None) -> None:
            ends.append(time.monotonic())
            (out / "replicas.progress").write_text(str(len(ends)))

    start = time.monotonic()
    model.fit(x, y, batch_size=32 * replicas, epochs=epochs, verbose=0, callbacks=[Clock()])
    seconds = np.diff([start, *ends]).tolist()
    # Two whole global batches and a last one of 3.5 rows per replica (2,160 rows at 32 replicas).
    partial = x[: 2 * 32 * replicas + (7 * replicas) // 2]
    try:
        predicted = model.predict(partial, batch_size=32 * replicas, verbose=0)
        prediction = {"rows": int(predicted.shape[0]), "error": None}
    except Exception as error:  # reported, not hidden: the test says what it expects
        prediction = {"rows": 0, "error": f"{type(error).__name__}: {str(error)[:300]}"}
    (out / "replicas.json").write_text(
        json.dumps({"epochs": len(ends), "seconds": seconds, "predict": prediction})
    )


MODES = {"fit_then_predict": fit_then_predict}

if __name__ == "__main__":
    configure_devices()  # before any op, and before Keras and tf_adasum are imported
    main(MODES)
