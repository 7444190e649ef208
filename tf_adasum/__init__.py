"""tf_adasum: Adasum (adaptive summation) for TensorFlow 2 and Keras 3."""

from tf_adasum import ops

__all__ = ["ops"]
__version__ = "0.1.0"
