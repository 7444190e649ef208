"""Hooks into TensorFlow's object tracking, for checkpoints of state Keras does not save.

`tracking`
    tf.__internal__.tracking's Trackable and AutoTrackable, with their protected methods
    `_serialize_to_tensors`, `_restore_from_tensors` (a trackable saved as tensors) and
    `_trackable_children` (which children a checkpoint or a SavedModel sees); and TensorFlow's
    TensorProto, which reads back a tensor that tf.io.serialize_tensor wrote, whatever its dtype.
    AdasumOptimizer saves every replica's optimizer state through them
    (tf_adasum.training.replica_optimizer_state).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf

from tf_adasum._compat.registry import register, require


@register("tracking", "checkpoints would hold replica 0's optimizer state for every replica")
def _check_tracking() -> str | None:
    internal = getattr(tf, "__internal__", None)
    tracking = getattr(internal, "tracking", None)
    for name in ("Trackable", "AutoTrackable"):
        if not isinstance(getattr(tracking, name, None), type):
            return f"tf.__internal__.tracking has no {name}"
    trackable = tf.__internal__.tracking.Trackable
    for name in ("_serialize_to_tensors", "_restore_from_tensors", "_trackable_children", "_track_trackable"):
        if not callable(getattr(trackable, name, None)):
            return f"tf.__internal__.tracking.Trackable has no {name}"
    from tensorflow.core.framework import tensor_pb2

    if not callable(getattr(tensor_pb2.TensorProto, "FromString", None)):
        return "tensorflow.core.framework.tensor_pb2 has no TensorProto to parse"
    return None


def parse_tensor(serialized: bytes) -> np.ndarray:
    """The array tf.io.serialize_tensor wrote into `serialized`, of the dtype it was written with."""
    from tensorflow.core.framework import tensor_pb2

    return tf.make_ndarray(tensor_pb2.TensorProto.FromString(serialized))


def tensors_checkpoint(
    save: Callable[[], dict[str, tf.Tensor]], restore: Callable[[dict[str, tf.Tensor]], Any]
) -> Any:
    """A trackable that tf.train.Checkpoint saves as the tensors save() returns and restores through
    restore(the tensors read back)."""
    require("tracking")

    class TensorsCheckpoint(tf.__internal__.tracking.Trackable):
        def _serialize_to_tensors(self) -> dict[str, tf.Tensor]:
            return save()

        def _restore_from_tensors(self, restored_tensors: dict[str, tf.Tensor]) -> Any:
            return restore(restored_tensors)

    return TensorsCheckpoint()


def checkpoints_only(child: Any, name: str) -> Any:
    """A node that holds `child` as `name` for tf.train.Checkpoint and holds nothing for SavedModels."""
    require("tracking")

    class CheckpointsOnly(tf.__internal__.tracking.AutoTrackable):
        def _trackable_children(self, save_type: Any = "checkpoint", **kwargs: Any) -> dict[str, Any]:
            if save_type == "savedmodel":
                return {}
            return super()._trackable_children(save_type, **kwargs)

    node = CheckpointsOnly()
    node._track_trackable(child, name=name)
    return node
