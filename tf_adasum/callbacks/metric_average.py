"""MetricAverageCallback: Horovod's average of the epoch's logs over processes."""

from __future__ import annotations

from typing import Any

from tf_adasum._horovod.arguments import unsupported
from tf_adasum.callbacks.batches import CountsBatches
from tf_adasum.training.keras_consensus import agree_at_epoch_end, average_logs


class MetricAverageCallback(CountsBatches):
    """Averages the epoch's logs over processes at the end of every epoch (Horovod's).

    Put it before callbacks that read the logs (ReduceLROnPlateau, ModelCheckpoint, TensorBoard).
    AdasumStrategy already averages its logs; this is for one-process-per-worker scripts.
    """

    serves_keras_2 = True  # tf_keras's epoch logs are floats too

    def __init__(self, device: str = "") -> None:
        super().__init__()
        unsupported("MetricAverageCallback", device=(device, ""))

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        logs = logs if logs is not None else {}
        agree_at_epoch_end(self.model, epoch, self.batches)
        # Sorted by name, as Horovod does, so every process reduces the same values in the same order.
        names = sorted(logs)
        averaged = average_logs({name: logs[name] for name in names})
        logs.update(averaged)
