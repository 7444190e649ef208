"""Hooks into Keras's layers.

`BatchNormalization._moments`
    where a BatchNormalization layer computes its batch's mean and variance in training, and
    `_reduction_axes`, the axes it reduces over. SyncBatchNormalization is built on
    BatchNormalizationMoments, which passes the batch's moments through its combine_moments; this is
    where they become the global batch's.
"""

from __future__ import annotations

from typing import Any

import keras

from tf_adasum._compat.registry import register, require, uses


@register("BatchNormalization._moments", "SyncBatchNormalization cannot combine the processes' statistics")
def _check_moments() -> str | None:
    layer = keras.layers.BatchNormalization
    if not callable(getattr(layer, "_moments", None)):
        return "BatchNormalization has no _moments"
    if not uses(layer.call, "_moments"):
        return "BatchNormalization.call no longer takes its batch's statistics from _moments"
    if not uses(layer.build, "_reduction_axes"):
        return "BatchNormalization.build no longer sets _reduction_axes"
    return None


class BatchNormalizationMoments(keras.layers.BatchNormalization):
    """keras.layers.BatchNormalization whose training-time batch moments pass through
    combine_moments(inputs, mask, mean, variance), which a subclass overrides."""

    def __init__(self, **kwargs: Any) -> None:
        require("BatchNormalization._moments")
        super().__init__(**kwargs)

    def _moments(self, inputs: Any, mask: Any) -> tuple[Any, Any]:
        mean, variance = super()._moments(inputs, mask)
        return self.combine_moments(inputs, mask, mean, variance)

    def combine_moments(self, inputs: Any, mask: Any, mean: Any, variance: Any) -> tuple[Any, Any]:
        """This batch's (mean, variance), as the subclass wants them: by default as they are."""
        return mean, variance

    @property
    def reduction_axes(self) -> list[int]:
        """The axes the built layer reduces over for its moments."""
        return list(self._reduction_axes)
