"""The private Keras hooks tf_adasum relies on, in one place, each checked when it is installed.

- `TensorFlowTrainer.make_train_function` / `make_test_function`: the functions they build run the
  compiled steps; tf_adasum wraps them (distributed.translate_errors) so that its errors raised inside a
  step reach `fit`'s caller as tf_adasum.PeerError, NonFiniteUpdateError or UnevenDataError, naming the
  rank, instead of tf.errors.UnknownError. Errors that are not tf_adasum's pass through unchanged.
- `tensorflow.python.data.ops.multi_device_iterator_ops._create_device_dataset`: the per-device
  prefetch datasets of a distributed dataset. tf_adasum turns tf.data autotuning off on them (see
  quiet_per_device_iterators).
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import tensorflow as tf

from tf_adasum import distributed


def install_error_translation() -> None:
    """Makes every Keras train and test function translate tf_adasum's errors (once per process)."""
    try:
        from keras.src.backend.tensorflow.trainer import TensorFlowTrainer
    except ImportError as error:  # a Keras release that moved its TensorFlow trainer
        warnings.warn(
            f"tf_adasum could not find Keras's TensorFlow trainer ({error}); errors raised inside compiled "
            "steps reach you as tf.errors.UnknownError instead of tf_adasum.PeerError",
            stacklevel=2,
        )
        return
    for maker, attribute in (
        ("make_train_function", "train_function"),
        ("make_test_function", "test_function"),
    ):
        original = getattr(TensorFlowTrainer, maker, None)
        if original is None or getattr(original, "_tf_adasum", False):
            continue

        @functools.wraps(original)
        def make(
            self: Any, force: bool = False, _original: Any = original, _attribute: str = attribute
        ) -> Any:
            _original(self, force)
            function = getattr(self, _attribute, None)
            if function is not None:
                setattr(self, _attribute, distributed.translate_errors(function))
            return getattr(self, _attribute)

        make._tf_adasum = True  # type: ignore[attr-defined]
        setattr(TensorFlowTrainer, maker, make)


def quiet_per_device_iterators() -> None:
    """Turns tf.data autotuning off on the per-device prefetch datasets of distributed datasets.

    Why: MirroredStrategy (and so AdasumStrategy) feeds each replica through a per-device prefetch
    dataset with a fixed one-element buffer, and each of their iterators starts an autotuning thread.
    Keras makes a new distributed iterator every epoch; destroying the old one waits for every such
    thread to end (RootDataset::Iterator::~Iterator), and an autotuning thread can sleep through its
    cancellation for a whole optimisation period, up to 60 s, each. With 32 replicas on 2 cores the
    epoch boundary then stalls for minutes at 0% CPU (stack: the main thread in
    ~MultiDeviceIterator -> ~RootDataset::Iterator -> ~LogicalThreadWrapper; the threads it waits for
    in Model::OptimizeLoop). A one-element buffer has nothing to tune, so nothing is lost. The source
    dataset keeps its own options.
    """
    try:
        from tensorflow.python.data.ops import multi_device_iterator_ops as module
    except ImportError:
        return
    original = getattr(module, "_create_device_dataset", None)
    if original is None or getattr(original, "_tf_adasum", False):
        return

    @functools.wraps(original)
    def create_device_dataset(*args: Any, **kwargs: Any) -> Any:
        options = tf.data.Options()
        options.autotune.enabled = False
        return original(*args, **kwargs).with_options(options)

    create_device_dataset._tf_adasum = True  # type: ignore[attr-defined]
    module._create_device_dataset = create_device_dataset
