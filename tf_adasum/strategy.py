"""AdasumStrategy: MirroredStrategy whose replicas combine their updates with Adasum.

Use it where MirroredStrategy goes. A plain Keras optimizer compiled under its scope becomes an
AdasumOptimizer, so each replica steps on its own and the deltas are combined with Adasum; metrics,
losses and BatchNorm statistics keep MirroredStrategy's sums and means.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf
from keras.src import optimizers as keras_optimizers

from tf_adasum.optimizer import AdasumOptimizer

_keras_get_optimizer = keras_optimizers.get


def _get_optimizer(identifier: Any) -> Any:
    """keras.optimizers.get, wrapping the result in AdasumOptimizer under an AdasumStrategy's scope."""
    optimizer = _keras_get_optimizer(identifier)
    strategy = tf.distribute.get_strategy()
    if isinstance(strategy, AdasumStrategy) and not isinstance(optimizer, AdasumOptimizer):
        return AdasumOptimizer(optimizer, sync_every=strategy.sync_every)
    return optimizer


class AdasumStrategy(tf.distribute.MirroredStrategy):
    """Data parallelism over local devices (GPUs, or logical CPUs) with Adasum after the optimizer.

    Args:
        devices: device names, as for MirroredStrategy; default all GPUs, or the CPU.
        sync_every: local steps between Adasum combinations, for optimizers it wraps.
        cross_device_ops: what MirroredStrategy uses for everything but model updates (metrics, ...).

    Example:
        >>> strategy = tf_adasum.AdasumStrategy()
        >>> with strategy.scope():
        ...     model = make_model()
        ...     model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="sparse_categorical_crossentropy")
        >>> model.fit(dataset, epochs=3)
    """

    def __init__(
        self,
        devices: list[str] | None = None,
        sync_every: int = 1,
        cross_device_ops: tf.distribute.CrossDeviceOps | None = None,
    ) -> None:
        if not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError(f"sync_every must be a positive integer, got {sync_every!r}")
        if cross_device_ops is None and not tf.config.list_logical_devices("GPU"):
            # NCCL needs GPUs; on CPUs reduce through one device, as MirroredStrategy's users expect.
            cross_device_ops = tf.distribute.ReductionToOneDevice()
        super().__init__(devices=devices, cross_device_ops=cross_device_ops)
        self.sync_every = sync_every
        # Keras's compile() resolves its optimizer through this function.
        keras_optimizers.get = _get_optimizer
