"""The base of tf_adasum's Keras callbacks: a Keras 3 callback that serves a tf_keras (Keras 2) model only
where its behaviour there is built and tested (serves_keras_2), and otherwise refuses one when it is
given it, with what works instead, rather than failing later inside tf_keras."""

from __future__ import annotations

from typing import Any

import keras

from tf_adasum import _compat


class Callback(_compat.Keras2CallbackProtocol, keras.callbacks.Callback):
    """keras.callbacks.Callback, for Keras 3 models, and for tf_keras's where serves_keras_2 says so."""

    serves_keras_2 = False

    def set_model(self, model: Any) -> None:
        if not self.serves_keras_2:
            _compat.require_keras_3(model, type(self).__name__)
        super().set_model(model)
