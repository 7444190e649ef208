"""BestModelCheckpoint: Horovod's ModelCheckpoint that keeps the best model, written by rank 0."""

from __future__ import annotations

from typing import Any

import keras

from tf_adasum import distributed
from tf_adasum.callbacks.base import Callback


class BestModelCheckpoint(Callback, keras.callbacks.ModelCheckpoint):
    """Horovod's BestModelCheckpoint: a ModelCheckpoint that keeps only the best model so far
    (save_best_only=True), written by rank 0 alone.

    Horovod's takes no file path (its Spark estimator sets one); here pass `filepath=` (a `.keras` path,
    or `.weights.h5` with save_weights_only=True), or set `.filepath` before fit. Put
    MetricAverageCallback before it, so that rank 0 judges the metric over every process.
    """

    serves_keras_2 = True  # Keras's ModelCheckpoint calls a tf_keras model's save and save_weights alike

    def __init__(
        self,
        monitor: str = "val_loss",
        verbose: int = 0,
        save_weights_only: bool = False,
        mode: str = "auto",
        save_freq: Any = "epoch",
        filepath: str | None = None,
    ) -> None:
        # Keras checks the path's extension here; with none given, a placeholder passes that check.
        placeholder = "best.weights.h5" if save_weights_only else "best.keras"
        super().__init__(
            filepath=filepath or placeholder,
            monitor=monitor,
            verbose=verbose,
            save_best_only=True,
            save_weights_only=save_weights_only,
            mode=mode,
            save_freq=save_freq,
        )
        if filepath is None:
            self.filepath = None

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        if self.filepath is None:
            raise ValueError(
                "BestModelCheckpoint has no file to write: pass filepath='best.keras' (Horovod's Spark "
                "estimator sets it; a script must)"
            )
        super().on_train_begin(logs)

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if distributed.init().rank == 0:
            super().on_train_batch_end(batch, logs)

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if distributed.init().rank == 0:
            super().on_epoch_end(epoch, logs)
