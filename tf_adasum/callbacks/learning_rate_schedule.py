"""LearningRateScheduleCallback: Horovod's learning-rate multiplier over a range of epochs."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import keras

from tf_adasum import _compat
from tf_adasum.callbacks.base import Callback


class LearningRateScheduleCallback(Callback):
    """Sets the learning rate to `initial_lr * multiplier(epoch)` (Horovod's schedule callback).

    Args:
        initial_lr: the base learning rate.
        multiplier: a constant (the rate becomes `initial_lr * multiplier ** (epoch - start_epoch)`, as
            in Horovod since 2021) or a function of the (fractional) epoch.
        start_epoch: the first epoch to adjust (inclusive).
        end_epoch: the epoch to stop adjusting at (exclusive); None for no end.
        staircase: adjust once at the start of each epoch; otherwise every batch, with a fractional epoch.
        momentum_correction: scale momentum by new_lr / old_lr for the batch in which the rate changes.
            Keras 3's SGD compiles its momentum (a Python float) into the train step, so it cannot be
            changed per batch; this then warns once and adjusts only the learning rate.
        steps_per_epoch: batches per epoch, for staircase=False; default what fit reports.

    Raises:
        ValueError: initial_lr is None, or the steps per epoch cannot be found for staircase=False.
    """

    serves_keras_2 = True  # a tf_keras optimizer's learning rate is set and read alike

    def __init__(
        self,
        initial_lr: float,
        multiplier: float | Callable[[float], float],
        start_epoch: int = 0,
        end_epoch: int | None = None,
        staircase: bool = True,
        momentum_correction: bool = True,
        steps_per_epoch: int | None = None,
    ) -> None:
        super().__init__()
        if initial_lr is None:
            raise ValueError("Parameter `initial_lr` is required")
        self.initial_lr = initial_lr
        self.multiplier = (
            multiplier if callable(multiplier) else (lambda epoch: multiplier ** (epoch - start_epoch))
        )
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch: int = steps_per_epoch or 0
        self.current_epoch = 0

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = self.params.get("steps")
            if not self.steps_per_epoch:
                raise ValueError(
                    f"{type(self).__name__} could not find the number of steps per epoch: pass "
                    "steps_per_epoch to it (or to fit)"
                )
        stepping = _compat.loss_scale_inner(self.model.optimizer)
        momentum = getattr(stepping, "inner_optimizer", stepping).__dict__.get("momentum")
        if self.momentum_correction and isinstance(momentum, float) and momentum != 0:
            warnings.warn(
                f"{type(self).__name__}: momentum_correction cannot change the momentum of a Keras "
                "optimizer, a Python float compiled into the train step; only the learning rate is "
                "adjusted. Pass momentum_correction=False to silence this.",
                stacklevel=2,
            )

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.current_epoch = epoch

    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if self.current_epoch < self.start_epoch or (
            self.end_epoch is not None and self.current_epoch >= self.end_epoch
        ):
            return
        if self.staircase and batch == 0:
            self._set_learning_rate(self.current_epoch)
        elif not self.staircase:
            self._set_learning_rate(self.current_epoch + float(batch) / self.steps_per_epoch)

    def _set_learning_rate(self, epoch: float) -> None:
        self.model.optimizer.learning_rate = self.initial_lr * self.multiplier(epoch)

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if logs is not None:
            logs["lr"] = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))
