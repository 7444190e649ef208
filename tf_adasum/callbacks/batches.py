"""What AdasumCallback and MetricAverageCallback share: the batches of the epoch, counted for the epoch-end
agreement across processes, and a retrace of the train function when a callback installs or removes
something in it."""

from __future__ import annotations

from typing import Any

import keras

from tf_adasum.callbacks.base import Callback
from tf_adasum.training.keras_consensus import forget_agreed_epochs


def retrace_with(model: keras.Model) -> None:
    """Makes Keras trace a new train function now, which holds what a callback just installed."""
    model.make_train_function(force=True)


def retrace_without(model: keras.Model) -> None:
    """Makes the next fit trace a train function without what a callback installed."""
    model.train_function = None


class CountsBatches(Callback):
    """Counts the batches of the current epoch, for the epoch-end agreement."""

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        forget_agreed_epochs(self.model)  # a new fit counts its epochs from its initial epoch again

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.batches = 0

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        # With steps_per_execution > 1, `batch` is the last batch of the execution.
        self.batches = batch + 1
