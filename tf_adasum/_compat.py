"""The private Keras hooks tf_adasum relies on, in one place, each checked when it is installed.

- `TensorFlowTrainer.make_train_function` / `make_test_function`: the functions they build run the
  compiled steps; tf_adasum wraps them (distributed.translate_errors) so that its errors raised inside a
  step reach `fit`'s caller as tf_adasum.PeerError, NonFiniteUpdateError or UnevenDataError, naming the
  rank, instead of tf.errors.UnknownError. Errors that are not tf_adasum's pass through unchanged.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

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
