"""LearningRateWarmupCallback: Horovod's gradual warm-up to the learning rate times the process count."""

from __future__ import annotations

from typing import Any

import keras

from tf_adasum import distributed
from tf_adasum.callbacks.learning_rate_schedule import LearningRateScheduleCallback


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Ramps the learning rate from `initial_lr / size` to `initial_lr` over `warmup_epochs` (Horovod's).

    Horovod's recipe (Goyal et al., arXiv 1706.02677) for a learning rate scaled by the number of
    workers. With Adasum you usually need no scaling and no warm-up; it is here so that Horovod scripts
    run unchanged. At the last batch of the warm-up the rate is exactly `initial_lr`.

    Args:
        initial_lr: the learning rate at the end of the warm-up.
        warmup_epochs: how many epochs the warm-up lasts.
        momentum_correction: as for LearningRateScheduleCallback.
        steps_per_epoch: batches per epoch; default what fit reports.
        verbose: 1 prints a line on rank 0 when the warm-up ends.
    """

    def __init__(
        self,
        initial_lr: float,
        warmup_epochs: int = 5,
        momentum_correction: bool = True,
        steps_per_epoch: int | None = None,
        verbose: int = 0,
    ) -> None:
        def multiplier(epoch: float) -> float:
            # Shifted by one batch so that the last batch of every epoch lands on a round number.
            epoch += 1.0 / self.steps_per_epoch
            size = distributed.size()
            return 1.0 / size * (epoch * (size - 1) / warmup_epochs + 1)

        super().__init__(
            initial_lr,
            multiplier,
            start_epoch=0,
            end_epoch=warmup_epochs,
            staircase=False,
            momentum_correction=momentum_correction,
            steps_per_epoch=steps_per_epoch,
        )
        self.verbose = verbose
        self.warmup_epochs = warmup_epochs

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        super().on_epoch_end(epoch, logs)
        if epoch == self.warmup_epochs - 1 and self.verbose > 0 and distributed.rank() == 0:
            rate = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to {rate:g}.")
