"""fp16 compression: which compressions exist, which dtypes narrow, and narrowing and widening.

With compression "fp16", float32 and float64 tensors cross processes as float16 and come back in their
own dtype; float16 and bfloat16 travel as they are. Horovod's Compression.fp16 does the same.
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

COMPRESSIONS = ("none", "fp16")


def check_compression(compression: str) -> str:
    """Returns `compression` if tf_adasum knows it, else raises ValueError naming it."""
    if compression not in COMPRESSIONS:
        raise ValueError(f"compression must be one of {COMPRESSIONS}, got {compression!r}")
    return compression


def narrows(dtype: tf.DType) -> bool:
    """Whether fp16 compression sends tensors of `dtype` as float16."""
    return dtype in (tf.float32, tf.float64)


def narrowed(tensors: Sequence[tf.Tensor]) -> list[tf.Tensor]:
    """The tensors as fp16 compression sends them."""
    return [tf.cast(t, tf.float16) if narrows(t.dtype) else t for t in tensors]


def widened(reduced: Sequence[tf.Tensor], like: Sequence[tf.Tensor]) -> list[tf.Tensor]:
    """Reduced tensors back in the dtypes of `like`, the tensors before narrowed()."""
    return [tf.cast(r, t.dtype) for r, t in zip(reduced, like, strict=True)]
