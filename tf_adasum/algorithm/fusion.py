"""One aligned buffer per dtype: its layout, fusing tensors (or host memory) into it, and taking them out.

Adasum across processes moves all tensors of one dtype in one buffer, so that every level of the
algorithm is one exchange. Every tensor starts on a 64-byte boundary of the buffer (and the algorithms
cut it only on such boundaries): a slice of a TensorFlow tensor that starts on one shares its memory,
so cutting halves off and taking the tensors back out of the result copy nothing. The zero padding
between tensors belongs to the tensor before it: zeros add nothing to a dot product or a norm, and stay
zero when combined.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from tf_adasum import _compat, ops, timeline

ALIGN_BYTES = 64  # TensorFlow's allocation alignment (EIGEN_MAX_ALIGN_BYTES)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def pieces(offsets: np.ndarray, lo: int, hi: int) -> list[tuple[int, int, int]]:
    """(tensor index, start, end) of each tensor's part of [lo, hi), positions relative to lo."""
    first = int(np.searchsorted(offsets, lo, side="right")) - 1
    out = []
    for t in range(max(first, 0), len(offsets) - 1):
        start, end = max(int(offsets[t]), lo), min(int(offsets[t + 1]), hi)
        if start >= hi:
            break
        if end > start:
            out.append((t, start - lo, end - lo))
    return out


def layout(tensors: Sequence[tf.Tensor], index: list[int]) -> tuple[list[int], np.ndarray, list[int]]:
    """Sizes of tensors[i] for i in index, their aligned starts in one buffer (and its end), the pads."""
    align = ALIGN_BYTES // tensors[index[0]].dtype.size
    sizes = [int(np.prod(tensors[i].shape.as_list())) for i in index]
    starts = np.concatenate([[0], np.cumsum([round_up(s, align) for s in sizes])]).astype(np.int64)
    pads = [int(end - start - size) for size, start, end in zip(sizes, starts[:-1], starts[1:], strict=True)]
    return sizes, starts, pads


@dataclasses.dataclass
class Fused:
    """One dtype's tensors in one buffer: tensor i fills [starts[i], starts[i + 1]), pads[i] of it zeros.

    `view` is a writable numpy view of `buffer` and `norms` the squared norms measured while filling
    it, where fuse_host could give them (eagerly, on the host); otherwise None. `source`, where not
    None, is the input itself, already laid out as the buffer (one tensor, no pad): then `buffer` is
    not filled, and the algorithm reads the input from `source` (vhdd.vhdd_host).
    """

    buffer: tf.Tensor
    starts: list[int]
    pads: list[int]
    shapes: list[tf.TensorShape]
    view: np.ndarray | None = None
    norms: np.ndarray | None = None
    source: np.ndarray | None = None

    @property
    def nbytes(self) -> int:
        return self.starts[-1] * self.buffer.dtype.size

    def unfuse(self, combined: tf.Tensor) -> list[tf.Tensor]:
        """The tensors back out of `combined`, a buffer with this layout (the result of an algorithm)."""
        return unfuse(combined, self.starts, self.pads, self.shapes)


def fuse(tensors: Sequence[tf.Tensor], index: list[int]) -> Fused:
    """One aligned buffer of tensors[i] for i in index, built with TensorFlow ops."""
    dtype = tensors[index[0]].dtype
    _, starts, pads = layout(tensors, index)
    with timeline.ops_phase("copy in", tensors=len(index), bytes=int(starts[-1]) * dtype.size):
        zeros = {pad: tf.zeros([pad], dtype) for pad in set(pads) if pad}
        parts = []
        for i, pad in zip(index, pads, strict=True):
            parts += [tf.reshape(tensors[i], [-1]), *([zeros[pad]] if pad else [])]
        buffer = tf.concat(parts, 0)
    return Fused(buffer, starts.tolist(), pads, [tensors[i].shape for i in index])


def fill_or_read_host(
    sources: Sequence[Any],
    buf: np.ndarray,
    starts: np.ndarray,
    sizes: list[int],
    pads: list[int],
    threads: int,
) -> tuple[np.ndarray, np.ndarray | None]:
    """fill_host, except for a single source that needs no pad, which is already laid out as `buf`
    would be: it is not copied, its norms come from a pass that only reads it, and it is returned as
    a flat numpy view for the algorithm to read (vhdd.vhdd_host's `source`). Returns (norms, that view
    or None)."""
    if len(sources) == 1 and not pads[0]:
        source = np.asarray(sources[0]).reshape(-1)
        return ops.host_segment_dot_norms(source, source, [0, sizes[0]], threads)[:, 1], source
    return fill_host(sources, buf, starts, sizes, pads, threads), None


def fill_host(
    sources: Sequence[Any],
    buf: np.ndarray,
    starts: np.ndarray,
    sizes: list[int],
    pads: list[int],
    threads: int,
) -> np.ndarray:
    """Copies each source into its place in `buf`, zeroes the pads, and returns the squared norms
    measured on the way (float64, one per source)."""
    for start, size, pad in zip(starts[:-1], sizes, pads, strict=True):
        buf[start + size : start + size + pad] = 0
    return ops.host_copy_norms([np.ascontiguousarray(x).reshape(-1) for x in sources], buf, starts, threads)


def fresh(shape: Sequence[int], dtype: tf.DType) -> tuple[tf.Tensor, np.ndarray | None]:
    """A fresh eager tensor and a writable numpy view of its memory (None where TensorFlow gives none)."""
    tensor = tf.raw_ops.Empty(shape=list(shape), dtype=dtype, init=False)
    return tensor, _compat.writable_view(tensor)


def fuse_host(tensors: Sequence[tf.Tensor], index: list[int], threads: int) -> Fused:
    """fuse, eagerly, into a fresh TensorFlow tensor through a writable numpy view of it.

    One copy of each tensor, its squared norm computed on the way (for the finiteness check), and no
    TensorFlow op per tensor; a single tensor that needs no pad is not copied at all (Fused.source).
    Where TensorFlow gives no view, this is fuse().
    """
    sizes, starts, pads = layout(tensors, index)
    buffer, view = fresh([int(starts[-1])], tensors[index[0]].dtype)
    if view is None:
        return fuse(tensors, index)
    with timeline.phase("copy in", tensors=len(index), bytes=view.nbytes):
        norms, source = fill_or_read_host([tensors[i] for i in index], view, starts, sizes, pads, threads)
    return Fused(buffer, starts.tolist(), pads, [tensors[i].shape for i in index], view, norms, source)


@functools.lru_cache(maxsize=4096)
def _shape_tensor(shape: tuple[int, ...]) -> tf.Tensor:
    return tf.constant(shape, tf.int64)


def unfuse(
    combined: tf.Tensor, starts: Sequence[int], pads: Sequence[int], shapes: Sequence[tf.TensorShape]
) -> list[tf.Tensor]:
    """The tensors back out of a buffer laid out by layout(), as views of it where they can be.

    One split at the aligned tensor starts: every piece starts aligned, so all are views of the buffer.
    (A split that also cut the padding off would copy everything: TensorFlow shares the buffer only when
    every piece is aligned.) A padded tensor's piece is then cut at 0, a view.
    """
    with timeline.ops_phase("copy out", tensors=len(shapes)):
        return _unfuse(combined, starts, pads, shapes)


def _unfuse(
    combined: tf.Tensor, starts: Sequence[int], pads: Sequence[int], shapes: Sequence[tf.TensorShape]
) -> list[tf.Tensor]:
    parts = tf.split(combined, np.diff(starts).tolist())
    eager = tf.executing_eagerly()
    out = []
    for piece, pad, shape in zip(parts, pads, shapes, strict=True):
        size = int(np.prod(shape.as_list()))
        if eager:
            # Cached shape tensors make each eager op ~5 us instead of ~25 (converting a Python shape
            # costs more than the op): ~3 ms a call on ResNet-50's 161 tensors.
            if pad:
                piece = tf.raw_ops.Slice(input=piece, begin=_shape_tensor((0,)), size=_shape_tensor((size,)))
            out.append(tf.raw_ops.Reshape(tensor=piece, shape=_shape_tensor(tuple(shape.as_list()))))
        else:
            out.append(tf.reshape(piece[:size] if pad else piece, shape))
    return out
