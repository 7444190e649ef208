"""numpy views of eager tensors.

`numpy views of eager tensors`
    the MPI engine receives into a fresh tensor through np.asarray's view of its memory (checked on first
    use; without it the engine copies, which is slower but the same).
"""

from __future__ import annotations

import ctypes
import functools
import warnings

import numpy as np
import tensorflow as tf


def _view(tensor: tf.Tensor) -> np.ndarray:
    shared = np.asarray(tensor)
    raw = (ctypes.c_char * shared.nbytes).from_address(shared.ctypes.data)
    return np.frombuffer(memoryview(raw).cast("B"), dtype=shared.dtype)


@functools.cache
def numpy_views_share_memory() -> bool:
    """Whether writing through np.asarray(eager tensor)'s memory changes the tensor (checked once)."""
    tensor = tf.raw_ops.Empty(shape=[4], dtype=tf.float32, init=True)
    try:
        _view(tensor)[:] = np.arange(1, 5, dtype=np.float32)
    except (TypeError, ValueError, BufferError):
        return False
    shared = bool(np.array_equal(tensor.numpy(), np.arange(1, 5, dtype=np.float32)))
    if not shared:
        warnings.warn(
            "tf_adasum: np.asarray no longer shares an eager tensor's memory; the MPI engine copies each "
            "received buffer instead (slower, same results)",
            stacklevel=2,
        )
    return shared


def writable_view(tensor: tf.Tensor) -> np.ndarray | None:
    """A writable numpy view of a fresh eager tensor that nothing else references yet, or None.

    np.asarray(tensor) shares the tensor's memory but is marked read-only; the buffer is ours to fill,
    since the tensor was just allocated for this receive. None when TensorFlow no longer shares it.
    """
    return _view(tensor) if numpy_views_share_memory() else None
