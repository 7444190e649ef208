"""Adasum across processes: vector-halving, distance-doubling (VHDD) on the communicator interface.

For P ranks (any P >= 1), with p2 the largest power of two <= P and r = P - p2:

1. Fold: rank 2i+1 sends its buffer to rank 2i, which combines them (i < r). The p2 remaining ranks
   get virtual ranks 0..p2-1 (rank 2i -> i for i < r, rank j -> j - r above), so the pairs of the
   contract tree (tree.py) are neighbours in virtual rank.
2. Halving: at levels L = 1, 2, ..., p2/2 a rank and its peer (virtual rank XOR L) hold the same
   segment; the lower keeps the first half and sends the second, the upper the opposite. Each computes
   per-tensor partial (a.b, |a|^2, |b|^2) on its half, where a is the lower block's vector; the partials
   are summed over the aligned block of 2L ranks, which together hold both subtrees' whole tensors;
   then each combines its half.
3. Gather: distance-halving all-gather of the segments.
4. The folded ranks get the result from their partner.

All tensors of one dtype are fused into one buffer, so every level is one exchange. Each segment is
computed by exactly one rank and then copied, so every rank ends with bitwise identical results.

Every tensor starts, and every halving point falls, on a 64-byte boundary of the fused buffer. A slice
of a TensorFlow tensor that starts on such a boundary shares its memory, so cutting halves off and
taking the tensors back out of the result copy nothing. The zero padding between tensors belongs to
the tensor before it: zeros add nothing to a dot product or a norm, and stay zero when combined.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import tensorflow as tf

from tf_adasum import agreement, ops
from tf_adasum.comm.base import Communicator
from tf_adasum.tree import fold_size, indices_by_dtype


def virtual_to_real(v: int, r: int) -> int:
    return 2 * v if v < r else v + r


def tree_blocks(p: int) -> list[list[int]]:
    """Every block of ranks whose partial sums are added at some level, level by level."""
    p2, r = fold_size(p)
    blocks = []
    level = 1
    while level < p2:
        for start in range(0, p2, 2 * level):
            blocks.append([virtual_to_real(v, r) for v in range(start, start + 2 * level)])
        level *= 2
    return blocks


ALIGN_BYTES = 64  # TensorFlow's allocation alignment (EIGEN_MAX_ALIGN_BYTES)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _pieces(offsets: np.ndarray, lo: int, hi: int) -> list[tuple[int, int, int]]:
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


def _combine_segment(
    comm: Communicator,
    left: tf.Tensor,
    right: tf.Tensor,
    pieces: list[tuple[int, int, int]],
    n: int,
    block: list[int],
) -> tf.Tensor:
    """Adasum of the segment's pieces, with dot products and norms summed over `block`."""
    if not pieces:  # this rank's segment is empty, but the block sum needs its zeros
        if len(block) > 1:
            comm.group_sum(tf.zeros([3 * n], tf.float64), block, "adasum block sum")
        return left
    bounds = tf.constant([0] + [e for _, _, e in pieces], tf.int64)
    partial = ops.adasum_segment_dot_norms(left, right, bounds)
    index = tf.constant([[t] for t, _, _ in pieces], tf.int64)
    # One row per tensor on every rank of the block, zero where this rank holds none of it.
    flat = tf.reshape(tf.scatter_nd(index, partial, [n, 3]), [-1])
    total = flat if len(block) == 1 else comm.group_sum(flat, block, "adasum block sum")
    rows = tf.gather(tf.reshape(total, [n, 3]), index[:, 0])
    return ops.adasum_segment_combine(left, right, rows, bounds)


def vhdd_fused(comm: Communicator, buffer: tf.Tensor, tensor_starts: Sequence[int]) -> tf.Tensor:
    """Adasum over all ranks of a fused 1-D buffer; tensor i fills [tensor_starts[i], tensor_starts[i+1])."""
    p2, r = fold_size(comm.size)
    offsets = np.asarray(tensor_starts, np.int64)
    rank, total = comm.rank, int(offsets[-1])
    n = len(offsets) - 1
    align = ALIGN_BYTES // buffer.dtype.size
    everything = _pieces(offsets, 0, total)
    if total == 0:
        return buffer

    if rank < 2 * r:
        if rank % 2 == 1:  # folded away: hand over, then wait for the result
            comm.exchange(rank - 1, buffer, 0, "adasum fold")
            return comm.exchange(rank - 1, buffer[:0], total, "adasum result to folded rank")
        other = comm.exchange(rank + 1, buffer[:0], total, "adasum fold")
        buffer = _combine_segment(comm, buffer, other, everything, n, [rank])
    v = rank // 2 if rank < 2 * r else rank - r

    lo, hi, level = 0, total, 1
    path = []
    while level < p2:
        peer = virtual_to_real(v ^ level, r)
        mid = lo + (hi - lo) // 2 // align * align  # aligned, so both halves are views
        lower = (v & level) == 0
        keep, give = ((lo, mid), (mid, hi)) if lower else ((mid, hi), (lo, mid))
        mine = buffer[keep[0] - lo : keep[1] - lo]
        theirs = comm.exchange(peer, buffer[give[0] - lo : give[1] - lo], keep[1] - keep[0], "adasum halving")
        left, right = (mine, theirs) if lower else (theirs, mine)
        start = v - v % (2 * level)
        block = [virtual_to_real(u, r) for u in range(start, start + 2 * level)]
        buffer = _combine_segment(comm, left, right, _pieces(offsets, *keep), n, block)
        path.append((peer, lower, hi - lo))
        lo, hi = keep
        level *= 2

    for peer, lower, parent_size in reversed(path):
        theirs = comm.exchange(peer, buffer, parent_size - (hi - lo), "adasum gather")
        buffer = tf.concat([buffer, theirs] if lower else [theirs, buffer], 0)
        lo, hi = (lo, lo + parent_size) if lower else (hi - parent_size, hi)

    if rank < 2 * r:
        comm.exchange(rank + 1, buffer, 0, "adasum result to folded rank")
    return buffer


def _fuse(tensors: Sequence[tf.Tensor], index: list[int]) -> tuple[tf.Tensor, list[int], list[int]]:
    """One aligned buffer of tensors[i] for i in index; returns it, the tensor starts and the pads."""
    dtype = tensors[index[0]].dtype
    align = ALIGN_BYTES // dtype.size
    sizes = [int(np.prod(tensors[i].shape.as_list())) for i in index]
    starts = np.concatenate([[0], np.cumsum([_round_up(s, align) for s in sizes])]).astype(np.int64)
    pads = [int(end - start - size) for size, start, end in zip(sizes, starts[:-1], starts[1:], strict=True)]
    zeros = {pad: tf.zeros([pad], dtype) for pad in set(pads) if pad}
    parts = []
    for i, pad in zip(index, pads, strict=True):
        parts += [tf.reshape(tensors[i], [-1]), *([zeros[pad]] if pad else [])]
    return tf.concat(parts, 0), starts.tolist(), pads


def vhdd_allreduce(
    comm: Communicator, tensors: Sequence[tf.Tensor], names: Sequence[str] | None = None
) -> list[tf.Tensor]:
    """Adasum of every rank's tensors by the contract tree; tensors of each dtype are fused.

    First every rank agrees (agreement.py) that all ranks are at this sync with finite tensors;
    otherwise every rank raises the same error before any data moves.
    """
    if comm.size == 1:
        return list(tensors)
    groups = [(index, *_fuse(tensors, index)) for index in indices_by_dtype(tensors)]

    code = agreement.first_nonfinite([(index, buffer, starts) for index, buffer, starts, _ in groups])
    checked = agreement.agree(comm, agreement.SYNC, code, "adasum sync", len(tensors), names)

    out: list[tf.Tensor | None] = [None] * len(tensors)
    for index, buffer, starts, pads in groups:
        if not tf.executing_eagerly():  # eagerly, agree() has already raised or passed
            with tf.control_dependencies([checked]):
                buffer = tf.identity(buffer)
        combined = vhdd_fused(comm, buffer, starts)
        # One split at aligned boundaries (views, not copies); the padding pieces are dropped.
        lengths: list[int] = []
        keep: list[int] = []
        for start, end, pad in zip(starts[:-1], starts[1:], pads, strict=True):
            keep.append(len(lengths))
            lengths += [end - start - pad, pad] if pad else [end - start]
        pieces = tf.split(combined, lengths)
        for i, k in zip(index, keep, strict=True):
            out[i] = tf.reshape(pieces[k], tensors[i].shape)
    return [t for t in out if t is not None]
