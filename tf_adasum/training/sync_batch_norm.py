"""SyncBatchNormalization: Keras's BatchNormalization with the batch statistics of every process's batch.

Horovod's layer (horovod.tensorflow.SyncBatchNormalization), for one replica per process: in training,
each process's count, sum and sum of squares per channel are summed over all processes, so that every
process normalises with, and updates its moving statistics from, the mean and variance of the global
batch. Outside training, or in a world of one, it is keras.layers.BatchNormalization.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from tf_adasum import _compat, distributed


@tf.custom_gradient
def _summed_over_processes(local: tf.Tensor) -> Any:
    """The sum over processes of `local`, whose gradient is the sum over processes of the gradients: each
    process's loss depends on every process's input through the sum (Horovod's allreduce gradient)."""

    def gradient(upstream: tf.Tensor) -> tf.Tensor:
        return distributed.allreduce(upstream, op=distributed.Sum)

    return distributed.allreduce(local, op=distributed.Sum), gradient


@keras.saving.register_keras_serializable(package="tf_adasum")
class SyncBatchNormalization(_compat.BatchNormalizationMoments):
    """keras.layers.BatchNormalization whose training-time mean and variance are the global batch's.

    The statistics are combined as counts, sums and sums of squares (in float64: a variance from
    E[x^2] - E[x]^2 would otherwise lose the digits that the mean's square cancels), so processes with
    batches of different sizes, or none at all, weigh by their number of rows (Horovod averages each
    process's moments with equal weight). Gradients flow through the global statistics, as in Horovod.

    Args:
        fused: Horovod's argument; only False (Keras 3 has no fused batch normalization anyway).
        **kwargs: keras.layers.BatchNormalization's arguments; `name` defaults to
            "sync_batch_normalization", as in Horovod.

    Raises:
        ValueError: fused=True or None, as Horovod raises; in training under a tf.distribute strategy of
            several replicas (use BatchNormalization(synchronized=True) there); or when the global batch
            is empty.

    Examples:
        >>> model = keras.Sequential([keras.layers.Dense(8), hvd.SyncBatchNormalization()])
    """

    def __init__(self, fused: bool | None = False, **kwargs: Any) -> None:
        if fused is not False:
            raise ValueError(
                f"SyncBatchNormalization does not support fused={fused!r} (nor does Horovod's): leave it "
                "False"
            )
        if not kwargs.get("name"):
            kwargs["name"] = "sync_batch_normalization"
        super().__init__(**kwargs)

    def combine_moments(self, inputs: Any, mask: Any, mean: Any, variance: Any) -> tuple[Any, Any]:
        """The global batch's mean and variance, from this process's (see the class's doc)."""
        comm = distributed.init()
        if comm.size == 1:
            return mean, variance
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        if replicas > 1:
            raise ValueError(
                f"SyncBatchNormalization runs one replica per process (Horovod's layout), but this step has "
                f"{replicas} replicas: use keras.layers.BatchNormalization(synchronized=True) under a "
                "tf.distribute strategy"
            )
        if mask is None:
            rows = tf.cast(tf.size(inputs), tf.float64) / tf.cast(tf.size(mean), tf.float64)
            count = tf.fill(tf.shape(mean), rows)
        else:  # the rows the mask keeps, per channel, as Keras's masked moments count them
            kept = tf.broadcast_to(tf.cast(tf.expand_dims(mask, -1), tf.float64), tf.shape(inputs))
            count = tf.reshape(tf.reduce_sum(kept, self.reduction_axes), tf.shape(mean))
        mean64, variance64 = tf.cast(mean, tf.float64), tf.cast(variance, tf.float64)
        # A process without rows has NaN moments: it adds zeros (multiply_no_nan), not NaN.
        local = tf.stack(
            [
                count,
                tf.math.multiply_no_nan(mean64, count),
                tf.math.multiply_no_nan(variance64 + tf.square(mean64), count),
            ]
        )
        total = _summed_over_processes(local)
        checked = tf.debugging.assert_positive(
            total[0],
            message="SyncBatchNormalization: the global batch is empty (no rows on any process)",
        )
        with tf.control_dependencies([checked]):
            global_mean = total[1] / total[0]
            # Rounding may leave a tiny negative variance where the true one is 0.
            global_variance = tf.maximum(total[2] / total[0] - tf.square(global_mean), 0.0)
        return tf.cast(global_mean, mean.dtype), tf.cast(global_variance, variance.dtype)
