"""The base of tf_adasum's Keras callbacks: a Keras 3 callback that refuses a tf_keras (Keras 2) model
when it is given one, with what works instead, rather than failing later inside tf_keras on a private
attribute that Keras 3's callbacks do not have."""

from __future__ import annotations

from typing import Any

import keras

from tf_adasum import _compat


class Callback(keras.callbacks.Callback):
    """keras.callbacks.Callback, for Keras 3 models only (tf_adasum/_compat/keras2.py)."""

    def set_model(self, model: Any) -> None:
        _compat.require_keras_3(model, type(self).__name__)
        super().set_model(model)
