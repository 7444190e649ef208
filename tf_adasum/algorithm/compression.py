"""Compression: which compressions exist, which dtypes narrow, and narrowing and widening.

With compression "fp16", float32 and float64 tensors cross processes as float16 and come back in their
own dtype; float16 and bfloat16 travel as they are. Horovod's Compression.fp16 does the same. With
"bf16" they cross as bfloat16: float32's range (no overflow), 8 bits of mantissa against float16's 11.
The kernels accumulate in float32 whatever the wire's dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

COMPRESSIONS = ("none", "fp16", "bf16")
# What each compression sends float32 and float64 tensors as.
WIRE_DTYPES = {"fp16": tf.float16, "bf16": tf.bfloat16}


def check_compression(compression: str) -> str:
    """Returns `compression` if tf_adasum knows it, else raises ValueError naming it."""
    if compression not in COMPRESSIONS:
        raise ValueError(f"compression must be one of {COMPRESSIONS}, got {compression!r}")
    return compression


def narrows(dtype: tf.DType) -> bool:
    """Whether a compression sends tensors of `dtype` narrower (float32 and float64 do)."""
    return dtype in (tf.float32, tf.float64)


def narrowed(tensors: Sequence[tf.Tensor], compression: str = "fp16") -> list[tf.Tensor]:
    """The tensors as `compression` ("fp16" or "bf16") sends them."""
    wire = WIRE_DTYPES[compression]
    return [tf.cast(t, wire) if narrows(t.dtype) else t for t in tensors]


def widened(reduced: Sequence[tf.Tensor], like: Sequence[tf.Tensor]) -> list[tf.Tensor]:
    """Reduced tensors back in the dtypes of `like`, the tensors before narrowed()."""
    return [tf.cast(r, t.dtype) for r, t in zip(reduced, like, strict=True)]
