"""fit, evaluate and predict free their data iterators off the training thread (_compat's `epoch
iterators`): on a busy host a tf.data iterator's destructor took 1-40 s after fit's last batch while the
other ranks of an elastic job waited in the next collective, and the group restarted for nothing.

Here an iterator whose destructor takes 3 s (a generator dataset whose finally block sleeps) stands for
it, deterministically."""

from __future__ import annotations

import threading
import time
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_adasum  # noqa: F401  (installs the release)

# Times fit's return to within a second: `make test` runs it after the rest, alone on the machine.
pytestmark = pytest.mark.alone


def slow_to_free(freed: threading.Event) -> tf.data.Dataset:
    def batches() -> Any:
        try:
            while True:
                yield np.ones((8, 4), np.float32), np.ones((8, 1), np.float32)
        finally:  # runs when the iterator is destroyed, on the thread that destroys it
            time.sleep(3)
            freed.set()

    spec = (tf.TensorSpec((8, 4), tf.float32), tf.TensorSpec((8, 1), tf.float32))
    return tf.data.Dataset.from_generator(batches, output_signature=spec)


class EndOfTraining(keras.callbacks.Callback):
    def on_train_end(self, logs: Any = None) -> None:
        self.at = time.perf_counter()


@pytest.mark.parametrize("epochs", [1, 3])
def test_fit_returns_at_once_and_the_iterator_is_freed_in_the_background(epochs: int) -> None:
    freed = threading.Event()
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.01), "mse")
    end = EndOfTraining()
    model.fit(slow_to_free(freed), epochs=epochs, steps_per_epoch=3, verbose=0, callbacks=[end])
    assert time.perf_counter() - end.at < 1.0, "fit waited for its iterator's destructor"
    assert not freed.is_set()
    assert freed.wait(30), "the iterator was never freed"


def test_evaluate_and_predict_return_at_once_too() -> None:
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.01), "mse")
    for run in (
        lambda d: model.evaluate(d, steps=2, verbose=0),
        lambda d: model.predict(d.map(lambda x, y: x), steps=2, verbose=0),
    ):
        freed = threading.Event()
        start = time.perf_counter()
        run(slow_to_free(freed))
        assert time.perf_counter() - start < 3.0
        assert freed.wait(30)


def test_a_graveyard_that_falls_behind_hands_back_what_it_cannot_take() -> None:
    """One thread frees more slowly than a loop of short fits makes iterators: past MAX_WAITING
    handovers the caller frees its own (bury says False), so what waits, and the threads it holds,
    stay bounded."""
    from tf_adasum._compat.trainer import _Graveyard

    class Tracked:
        freed = 0

        def __del__(self) -> None:
            Tracked.freed += 1

    graveyard = _Graveyard()
    try:
        taken = [graveyard.bury([Tracked()], delay=60.0) for _ in range(_Graveyard.MAX_WAITING)]
        assert taken == [True] * _Graveyard.MAX_WAITING and Tracked.freed == 0
        assert not graveyard.bury([Tracked()], delay=60.0)
        assert Tracked.freed == 1  # handed back: the caller's reference was the last
        assert graveyard.bury([], delay=60.0)  # nothing to take is never refused
    finally:
        graveyard._stop()
    assert Tracked.freed == 1 + _Graveyard.MAX_WAITING  # the rest, at its stop
