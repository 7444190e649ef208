"""Each replica's local step is the step a single worker would take on that replica's batch, however its
loss was built.

Under a tf.distribute strategy Keras divides the losses that go through its Loss objects, compute_loss
and add_loss by the number of replicas N (so that summed gradients average), and TensorFlow's convention
for custom loops is that the user does (tf.nn.compute_average_loss, or a division by the global batch
size). A train_step may build its loss by hand and scale nothing. Adasum needs each replica's own
single-worker gradient, so:

- In a Keras train step of a model that runs Adasum (under AdasumStrategy, or with AdasumOptimizer under
  any strategy; model.fit with the default or a custom train_step): Keras's scaling is switched off for
  the step. Its scale and unscale by N are identities and tf.nn.compute_average_loss gives the replica's
  own mean, so every loss is the replica's own, however it was built and mixed, and AdasumOptimizer
  steps on the gradients as they are.
- In a custom loop (strategy.run, TensorFlow's convention): the loss is scaled by 1/N, and AdasumOptimizer
  multiplies the gradients by N. Where a step's loss went through no scaling tf_adasum sees (a mean or a
  sum built by hand), its scale cannot be known: tf_adasum takes TensorFlow's convention, and warns once
  with the fix.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import tensorflow as tf

# The strategies whose Keras train step of an Adasum model is running now (id -> nesting depth).
_unscaled: dict[int, int] = {}
_lock = threading.Lock()
_seen = threading.local()
_warned = False


@contextlib.contextmanager
def keras_losses_unscaled(strategy: Any) -> Iterator[None]:
    """While a Keras train function of a model that runs Adasum runs (and is traced) under `strategy`."""
    key = id(strategy)
    with _lock:
        _unscaled[key] = _unscaled.get(key, 0) + 1
    try:
        yield
    finally:
        with _lock:
            _unscaled[key] -= 1
            if not _unscaled[key]:
                del _unscaled[key]


def unscaled() -> bool:
    """Whether losses built now are each replica's own: a Keras train step of an Adasum model."""
    return bool(_unscaled) and id(tf.distribute.get_strategy()) in _unscaled


def note_scaled() -> None:
    """A loss of this replica's step was scaled by 1/N (a Keras loss, tf.nn.compute_average_loss)."""
    _seen.count = getattr(_seen, "count", 0) + 1


def gradient_factor(replicas: int, optimizer: str) -> int:
    """What to multiply a replica's gradients by for a single-worker step: 1 in a Keras train step of an
    Adasum model (its losses are unscaled), N in a custom loop (TensorFlow's convention, 1/N in the
    loss). In a custom loop whose loss no scaling was seen in, warns once."""
    global _warned
    if replicas == 1 or unscaled():
        return 1
    count = getattr(_seen, "count", 0)
    if count:
        _seen.count = count - 1
    elif not _warned:
        _warned = True
        warnings.warn(
            f"tf_adasum: {optimizer!r} steps in a custom loop of {replicas} replicas on a loss whose scale "
            "tf_adasum cannot tell (no tf.nn.compute_average_loss, no Keras loss seen in this step). It "
            "takes TensorFlow's convention, a loss divided by the global batch size, and multiplies the "
            f"gradients by {replicas} so that each replica takes a single-worker step. If this loss is "
            "each replica's own mean, every step is that many times too large: build it with "
            "tf.nn.compute_average_loss(per_example_loss), or divide its sum by the global batch size",
            stacklevel=3,
        )
    return replicas
