"""Horovod's gradient compression (horovod/tensorflow/compression.py): `none`, or `fp16`."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from tf_adasum.algorithm.compression import narrows


class NoneCompressor:
    """Horovod's default: tensors travel as they are."""

    name = "none"

    @staticmethod
    def compress(tensor: tf.Tensor) -> tuple[tf.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: tf.Tensor, ctx: Any) -> tf.Tensor:
        return tensor


class FP16Compressor:
    """float32 and float64 tensors travel as float16 and come back in their own dtype."""

    name = "fp16"

    @staticmethod
    def compress(tensor: tf.Tensor) -> tuple[tf.Tensor, Any]:
        if narrows(tensor.dtype):
            return tf.cast(tensor, tf.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: tf.Tensor, ctx: Any) -> tf.Tensor:
        return tf.cast(tensor, ctx) if ctx is not None else tensor


class Compression:
    """Horovod's gradient compression: `none`, or `fp16`. A compressor is a class with Horovod's static
    compress(tensor) -> (tensor, ctx) and decompress(tensor, ctx); your own works in the collectives."""

    none = NoneCompressor
    fp16 = FP16Compressor


def check_compressor(where: str, compression: Any) -> Any:
    """`compression`, where it is one tf_adasum's optimizers can carry (Compression.none or fp16).

    Raises:
        NotImplementedError: any other compressor, named.
    """
    if compression not in (Compression.none, Compression.fp16):
        raise NotImplementedError(
            f"{where}(compression={compression!r}) is not supported by tf_adasum; use Compression.none or "
            "Compression.fp16"
        )
    return compression
