"""What the benchmarks and examples/resnet50_gradients.py share: the timer, the baseline and the shapes.

TensorFlow is imported inside the functions: a benchmark sets TensorFlow's environment (log level,
allocator) before TensorFlow starts.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

# kernels/adasum_core.h's kZeroNormGuard, sqrt(DBL_MIN): a squared norm below it counts as zero, and
# its coefficient is exactly 1, so a zero vector leaves the other unchanged and 0/0 never happens.
ZERO_NORM_GUARD = 1.4916681462400413e-154

# Trainable tensor shapes of ResNet-50 as its reference benchmarks count them (no conv biases):
# 53 convolution kernels, 53 batch-norm scales and offsets, and the classifier: 161 tensors, 25.5M
# parameters.
RESNET50_STAGES = [(3, 64, 256), (4, 128, 512), (6, 256, 1024), (3, 512, 2048)]


def resnet50_shapes() -> list[tuple[int, ...]]:
    convs: list[tuple[int, ...]] = [(7, 7, 3, 64)]
    channels = 64
    for blocks, width, out in RESNET50_STAGES:
        for block in range(blocks):
            if block == 0:
                convs.append((1, 1, channels, out))  # projection shortcut
            convs += [(1, 1, channels, width), (3, 3, width, width), (1, 1, width, out)]
            channels = out
    shapes: list[tuple[int, ...]] = []
    for kernel in convs:
        shapes += [kernel, (kernel[-1],), (kernel[-1],)]
    return [*shapes, (2048, 1000), (1000,)]


def median_ms(
    fn: Callable[[], Any], repeats: int, before: Callable[[], Any] | None = None, warmup: int = 2
) -> float:
    """The median wall time of fn() in milliseconds, over `repeats` calls after `warmup` untimed ones.

    Args:
        fn: the call to time. It must wait for its result: np.asarray on an output (not .numpy(), which
            copies it).
        repeats: how many calls are timed.
        before: called before every call, outside the timing; for example a barrier, so that every
            rank starts each call together.
        warmup: untimed calls first, for tracing and allocation.
    """
    times = []
    for i in range(warmup + repeats):
        if before is not None:
            before()
        start = time.perf_counter()
        fn()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def composite_pair(a: list[Any], b: list[Any], accumulate: Any = None) -> list[Any]:
    """tf_adasum.ops.adasum_pair as composite TensorFlow ops: the baseline of the fused kernels.

    Args:
        a, b: lists of tensors that pair up.
        accumulate: the dtype of the sums and the combination; default float64, as the kernels.
            tf.float32 is the usual shortcut, less accurate.
    """
    import tensorflow as tf

    accumulate = accumulate or tf.float64
    out = []
    for x, y in zip(a, b, strict=True):
        xw, yw = tf.cast(x, accumulate), tf.cast(y, accumulate)
        dot, xx, yy = tf.reduce_sum(xw * yw), tf.reduce_sum(xw * xw), tf.reduce_sum(yw * yw)
        ca = tf.where(xx >= ZERO_NORM_GUARD, 1 - dot / (2 * xx), tf.ones_like(dot))
        cb = tf.where(yy >= ZERO_NORM_GUARD, 1 - dot / (2 * yy), tf.ones_like(dot))
        out.append(tf.cast(ca * xw + cb * yw, x.dtype))
    return out
