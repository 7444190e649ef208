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

Under MPI (a communicator with host buffers) the whole algorithm runs on one numpy buffer per dtype
(vhdd_host): eagerly that buffer is the memory of a fresh TensorFlow tensor, filled once from the
inputs, combined in place by the same core through C entry points, and the gather receives straight
into it; inside tf.function the whole sync (fusing, agreement, algorithm) is one host call. vhdd_fused,
on TensorFlow tensors, serves the TensorFlow engine, whose exchanges are ops in the graph; there small
buffers go by one all-gather instead (gather_fused; see algorithm()).

With several replicas in each process, tree_across_processes computes the same tree over every replica
of every process (distributed.allreduce_replicas chooses it).

Every tensor starts, and every halving point falls, on a 64-byte boundary of the fused buffer. A slice
of a TensorFlow tensor that starts on such a boundary shares its memory, so cutting halves off and
taking the tensors back out of the result copy nothing. The zero padding between tensors belongs to
the tensor before it: zeros add nothing to a dot product or a norm, and stay zero when combined.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import tensorflow as tf

from tf_adasum import _compat, agreement, ops
from tf_adasum.comm.base import Communicator, NonFiniteUpdateError
from tf_adasum.tree import Span, evaluate, fold_size, indices_by_dtype, pair_on_left_device, roots_within


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


class _Level(NamedTuple):
    """One halving level, as one rank sees it."""

    peer: int
    lower: bool  # this rank keeps the lower half
    lo: int  # the segment [lo, hi) both hold before the level
    keep: tuple[int, int]
    give: tuple[int, int]
    block: list[int]  # the ranks whose partial sums are added at this level


def _halving(v: int, r: int, p2: int, total: int, align: int) -> list[_Level]:
    """The halving levels of virtual rank v; the gather walks them back in reverse. Every halving
    point is aligned, so both halves of a segment are views."""
    levels = []
    lo, hi, level = 0, total, 1
    while level < p2:
        mid = lo + (hi - lo) // 2 // align * align
        lower = (v & level) == 0
        keep, give = ((lo, mid), (mid, hi)) if lower else ((mid, hi), (lo, mid))
        start = v - v % (2 * level)
        block = [virtual_to_real(u, r) for u in range(start, start + 2 * level)]
        levels.append(_Level(virtual_to_real(v ^ level, r), lower, lo, keep, give, block))
        lo, hi = keep
        level *= 2
    return levels


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

    levels = _halving(v, r, p2, total, align)
    for level in levels:  # buffer holds the segment that starts at level.lo
        (klo, khi), (glo, ghi), lo = level.keep, level.give, level.lo
        mine = buffer[klo - lo : khi - lo]
        theirs = comm.exchange(level.peer, buffer[glo - lo : ghi - lo], khi - klo, "adasum halving")
        left, right = (mine, theirs) if level.lower else (theirs, mine)
        buffer = _combine_segment(comm, left, right, _pieces(offsets, klo, khi), n, level.block)

    for level in reversed(levels):  # buffer holds level.keep; the peer sends back what was given
        theirs = comm.exchange(level.peer, buffer, level.give[1] - level.give[0], "adasum gather")
        buffer = tf.concat([buffer, theirs] if level.lower else [theirs, buffer], 0)

    if rank < 2 * r:
        comm.exchange(rank + 1, buffer, 0, "adasum result to folded rank")
    return buffer


def _combine_host(
    comm: Any,
    left: np.ndarray,
    right: np.ndarray,
    out: np.ndarray,
    pieces: list[tuple[int, int, int]],
    n: int,
    block: list[int],
    threads: int,
) -> None:
    """_combine_segment on numpy buffers, written into `out`."""
    flat = np.zeros([n, 3], np.float64)
    if pieces:
        bounds = [0] + [e for _, _, e in pieces]
        index = [t for t, _, _ in pieces]
        partial = ops.host_segment_dot_norms(left, right, bounds, threads)
        flat[index] = partial
    total = flat if len(block) == 1 else comm.group_sum_host(flat.reshape(-1), block, "adasum block sum")
    if pieces:
        ops.host_segment_combine(left, right, total.reshape(n, 3)[index], out, bounds, threads)


def vhdd_host(comm: Any, buf: np.ndarray, tensor_starts: Sequence[int], threads: int = 1) -> None:
    """vhdd_fused on a numpy buffer, in place, for a communicator with host buffers (MPI).

    The same algorithm and arithmetic as vhdd_fused, so the same bits; but every step is a call on
    numpy memory: halves are received into one scratch buffer, combined in place, and the gather
    receives each peer's part straight into its place in `buf`.
    """
    p2, r = fold_size(comm.size)
    offsets = np.asarray(tensor_starts, np.int64)
    rank, total = comm.rank, int(offsets[-1])
    n = len(offsets) - 1
    align = ALIGN_BYTES // buf.itemsize
    nothing = buf[:0]
    if total == 0:
        return
    if rank < 2 * r:
        if rank % 2 == 1:  # folded away: hand over, then wait for the result
            comm.sendrecv_host(rank - 1, buf, nothing, "adasum fold")
            comm.sendrecv_host(rank - 1, nothing, buf, "adasum result to folded rank")
            return
        other = np.empty_like(buf)
        comm.sendrecv_host(rank + 1, nothing, other, "adasum fold")
        _combine_host(comm, buf, other, buf, _pieces(offsets, 0, total), n, [rank], threads)
        scratch = other
    else:
        scratch = np.empty(total - total // 2 // align * align, buf.dtype)
    v = rank // 2 if rank < 2 * r else rank - r

    levels = _halving(v, r, p2, total, align)
    for level in levels:
        (klo, khi), (glo, ghi) = level.keep, level.give
        mine, theirs = buf[klo:khi], scratch[: khi - klo]
        comm.sendrecv_host(level.peer, buf[glo:ghi], theirs, "adasum halving")
        left, right = (mine, theirs) if level.lower else (theirs, mine)
        _combine_host(comm, left, right, mine, _pieces(offsets, klo, khi), n, level.block, threads)

    for level in reversed(levels):  # send the part kept, receive the part given, in place
        (klo, khi), (glo, ghi) = level.keep, level.give
        comm.sendrecv_host(level.peer, buf[klo:khi], buf[glo:ghi], "adasum gather")

    if rank < 2 * r:
        comm.sendrecv_host(rank + 1, buf, nothing, "adasum result to folded rank")


def gather_fused(comm: Communicator, buffer: tf.Tensor, tensor_starts: Sequence[int]) -> tf.Tensor:
    """The contract tree over every rank of a fused 1-D buffer, by one all-gather.

    Every rank receives every other's whole buffer and combines the whole tree itself, with the same
    ops in the same order as the others: the same bits everywhere. Each rank sends its buffer to
    every other, (P - 1) N in all; VHDD sends 2 N (P - 1) / P. At 2 ranks that is the same bytes in one
    collective instead of VHDD's three, with twice the arithmetic; above, it is for small buffers.
    """
    offsets = np.asarray(tensor_starts, np.int64)
    total, n = int(offsets[-1]), len(offsets) - 1
    if total == 0:
        return buffer
    rows = comm.allgather(buffer)
    everything = _pieces(offsets, 0, total)

    def pair(left: tf.Tensor, right: tf.Tensor) -> tf.Tensor:
        return _combine_segment(comm, left, right, everything, n, [comm.rank])

    return evaluate({(q, q + 1): rows[q] for q in range(comm.size)}, comm.size, pair)[(0, comm.size)]


def gather_host(comm: Any, buf: np.ndarray, tensor_starts: Sequence[int], threads: int = 1) -> None:
    """gather_fused on a numpy buffer, in place, for a communicator with host buffers (MPI)."""
    offsets = np.asarray(tensor_starts, np.int64)
    total, n = int(offsets[-1]), len(offsets) - 1
    if total == 0:
        return
    rows = np.empty((comm.size, total), buf.dtype)
    comm.allgather_host(buf, rows, "adasum gather")
    everything = _pieces(offsets, 0, total)

    def pair(left: np.ndarray, right: np.ndarray) -> np.ndarray:
        # Each node's result lives in its first leaf's row.
        _combine_host(comm, left, right, left, everything, n, [comm.rank], threads)
        return left

    buf[:] = evaluate({(q, q + 1): rows[q] for q in range(comm.size)}, comm.size, pair)[(0, comm.size)]


ALGORITHMS = ("vhdd", "gather")
GATHER_BELOW_BYTES = 4 << 20


def algorithm(comm: Communicator, nbytes: int) -> str:
    """How to combine one fused buffer of nbytes across comm's ranks: "vhdd" or "gather".

    $TF_ADASUM_ALGORITHM forces one (for benchmarks and for checking one against the other).
    """
    forced = os.environ.get("TF_ADASUM_ALGORITHM")
    if forced:
        if forced not in ALGORITHMS:
            raise ValueError(f"TF_ADASUM_ALGORITHM={forced!r}; expected one of {ALGORITHMS}")
        return forced
    if getattr(comm, "host_buffers", False):
        return "vhdd"  # on host memory VHDD measured as fast at 1 MB and faster above (benchmarks/README.md)
    # The TF engine pays ~1 ms a collective: below this, latency rules and one all-gather wins.
    return "gather" if nbytes * (comm.size - 1) <= GATHER_BELOW_BYTES else "vhdd"


def host_threads(comm: Communicator) -> int:
    """Threads for one rank's host arithmetic: this machine's cores shared among its ranks."""
    return max(1, (os.cpu_count() or 1) // max(1, comm.local_size))


def _layout(tensors: Sequence[tf.Tensor], index: list[int]) -> tuple[list[int], np.ndarray, list[int]]:
    """Sizes of tensors[i] for i in index, their aligned starts in one buffer (and its end), the pads."""
    align = ALIGN_BYTES // tensors[index[0]].dtype.size
    sizes = [int(np.prod(tensors[i].shape.as_list())) for i in index]
    starts = np.concatenate([[0], np.cumsum([_round_up(s, align) for s in sizes])]).astype(np.int64)
    pads = [int(end - start - size) for size, start, end in zip(sizes, starts[:-1], starts[1:], strict=True)]
    return sizes, starts, pads


def _fill_host(
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


def _fuse_host(
    tensors: Sequence[tf.Tensor], index: list[int], threads: int
) -> tuple[tf.Tensor, list[int], list[int], np.ndarray | None, np.ndarray | None]:
    """_fuse, eagerly, into a fresh TensorFlow tensor through a writable numpy view of it: one copy of
    each tensor, its squared norm computed on the way (for the finiteness check), and no TensorFlow op
    per tensor. Returns the view and the norms too (None where TensorFlow gives no view: then this is
    _fuse)."""
    dtype = tensors[index[0]].dtype
    sizes, starts, pads = _layout(tensors, index)
    buffer = tf.raw_ops.Empty(shape=[int(starts[-1])], dtype=dtype, init=False)
    view = _compat.writable_view(buffer)
    if view is None:
        return (*_fuse(tensors, index), None, None)
    norms = _fill_host([tensors[i] for i in index], view, starts, sizes, pads, threads)
    return buffer, starts.tolist(), pads, view, norms


def _in_place(comm: Any, starts: Sequence[int], by_gather: bool) -> Any:
    """The host algorithm as a numpy_function body: on a writable copy of its input."""

    def run(x: np.ndarray) -> np.ndarray:
        buf = np.array(x)
        (gather_host if by_gather else vhdd_host)(comm, buf, starts, host_threads(comm))
        return buf

    return run


def _host_graph(
    comm: Any,
    tensors: Sequence[tf.Tensor],
    indices: list[list[int]],
    names: Sequence[str] | None,
    metadata: int,
) -> list[tf.Tensor]:
    """vhdd_allreduce inside a tf.function under MPI: one host call for all of it. It fuses the inputs
    (measuring their norms on the way), agrees with the other ranks, and runs the algorithm for every
    dtype, with no TensorFlow op copying the data in between."""
    layouts = [_layout(tensors, index) for index in indices]
    threads = host_threads(comm)

    def run(*arrays: np.ndarray) -> list[np.ndarray]:
        buffers, norms, first = [], [], 0
        for index, (sizes, starts, pads) in zip(indices, layouts, strict=True):
            sources = arrays[first : first + len(index)]
            first += len(index)
            buffers.append(np.empty(int(starts[-1]), sources[0].dtype))
            norms.append(_fill_host(sources, buffers[-1], starts, sizes, pads, threads))
        codes = np.array([agreement.SYNC, agreement.first_nonfinite_norm(indices, norms), metadata], np.int64)
        agreement.check_table(comm.agree_host(codes, "adasum sync"), len(tensors), names)
        for buf, (_, starts, _) in zip(buffers, layouts, strict=True):
            by_gather = algorithm(comm, buf.nbytes) == "gather"
            (gather_host if by_gather else vhdd_host)(comm, buf, starts.tolist(), threads)
        return buffers

    inputs = [tensors[i] for index in indices for i in index]
    dtypes = [tensors[index[0]].dtype for index in indices]
    combined = tf.numpy_function(run, inputs, dtypes, stateful=True)
    if not dtypes:  # nothing to combine, but the agreement still runs: tf.function runs stateful ops
        return []
    out: list[Any] = [None] * len(tensors)
    for index, buffer, (_, starts, pads) in zip(indices, combined, layouts, strict=True):
        buffer.set_shape([int(starts[-1])])
        shapes = [tensors[i].shape for i in index]
        for i, tensor in zip(index, _unfuse(buffer, starts.tolist(), pads, shapes), strict=True):
            out[i] = tensor
    return out


@functools.lru_cache(maxsize=4096)
def _shape_tensor(shape: tuple[int, ...]) -> tf.Tensor:
    return tf.constant(shape, tf.int64)


def _fuse(tensors: Sequence[tf.Tensor], index: list[int]) -> tuple[tf.Tensor, list[int], list[int]]:
    """One aligned buffer of tensors[i] for i in index; returns it, the tensor starts and the pads."""
    dtype = tensors[index[0]].dtype
    _, starts, pads = _layout(tensors, index)
    zeros = {pad: tf.zeros([pad], dtype) for pad in set(pads) if pad}
    parts = []
    for i, pad in zip(index, pads, strict=True):
        parts += [tf.reshape(tensors[i], [-1]), *([zeros[pad]] if pad else [])]
    return tf.concat(parts, 0), starts.tolist(), pads


def vhdd_allreduce(
    comm: Communicator, tensors: Sequence[tf.Tensor], names: Sequence[str] | None = None, metadata: int = 0
) -> list[tf.Tensor]:
    """Adasum of every rank's tensors by the contract tree; tensors of each dtype are fused.

    First every rank agrees (agreement.py) that all ranks are at this sync with finite tensors, and,
    given `metadata` (agreement.fingerprint of the tensors), with the same shapes and dtypes;
    otherwise every rank raises the same error before any data moves.
    """
    if comm.size == 1:
        return list(tensors)
    host = getattr(comm, "host_buffers", False)
    threads = host_threads(comm)
    indices = indices_by_dtype(tensors)
    if host and not tf.executing_eagerly():
        return _host_graph(comm, tensors, indices, names, metadata)
    groups = [
        _fuse_host(tensors, index, threads)
        if host and tf.executing_eagerly()
        else (*_fuse(tensors, index), None, None)
        for index in indices
    ]

    measured = [norms for *_, norms in groups if norms is not None]
    code: tf.Tensor | int
    if len(measured) == len(groups):  # the copies measured the norms: no second pass over the data
        code = agreement.first_nonfinite_norm(indices, measured)
    else:
        code = agreement.first_nonfinite(
            [(index, buffer, starts) for index, (buffer, starts, *_) in zip(indices, groups, strict=True)]
        )
    checked = agreement.agree(comm, agreement.SYNC, code, "adasum sync", len(tensors), names, metadata)

    out: list[tf.Tensor | None] = [None] * len(tensors)
    for index, (buffer, starts, pads, view, _) in zip(indices, groups, strict=True):
        if not tf.executing_eagerly():  # eagerly, agree() has already raised or passed
            with tf.control_dependencies([checked]):
                buffer = tf.identity(buffer)
        by_gather = algorithm(comm, int(starts[-1]) * buffer.dtype.size) == "gather"
        if view is not None:  # eagerly, on the host: in place in the fused tensor's memory
            (gather_host if by_gather else vhdd_host)(comm, view, starts, threads)
            combined = buffer
        elif host:  # eagerly, where TensorFlow gives no writable view
            combined = tf.numpy_function(
                _in_place(comm, starts, by_gather), [buffer], buffer.dtype, stateful=True
            )
        else:
            combined = (gather_fused if by_gather else vhdd_fused)(comm, buffer, starts)
        for i, tensor in zip(
            index, _unfuse(combined, starts, pads, [tensors[i].shape for i in index]), strict=True
        ):
            out[i] = tensor
    return [t for t in out if t is not None]


def _unfuse(
    combined: tf.Tensor, starts: Sequence[int], pads: Sequence[int], shapes: Sequence[tf.TensorShape]
) -> list[tf.Tensor]:
    """The tensors back out of a buffer that _fuse or _fuse_host laid out, as views of it where they can be.

    One split at the aligned tensor starts: every piece starts aligned, so all are views of the buffer.
    (A split that also cut the padding off would copy everything: TensorFlow shares the buffer only when
    every piece is aligned.) A padded tensor's piece is then cut at 0, a view.
    """
    pieces = tf.split(combined, np.diff(starts).tolist())
    eager = tf.executing_eagerly()
    out = []
    for piece, pad, shape in zip(pieces, pads, shapes, strict=True):
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


def _allgather(comm: Any, buffer: tf.Tensor) -> tf.Tensor:
    """comm.allgather of a 1-D buffer; with host buffers (MPI), on Adasum's own communicator and, eagerly,
    received straight into a fresh TensorFlow tensor."""
    if not getattr(comm, "host_buffers", False):
        return comm.allgather(buffer)
    shape = [comm.size, int(buffer.shape[0])]
    if tf.executing_eagerly():
        out = tf.raw_ops.Empty(shape=shape, dtype=buffer.dtype, init=False)
        view = _compat.writable_view(out)
        if view is not None:
            comm.allgather_host(np.asarray(buffer), view, "adasum gather")
            return out

    def run(x: np.ndarray) -> np.ndarray:
        rows = np.empty(shape, x.dtype)
        comm.allgather_host(x, rows, "adasum gather")
        return rows

    out = tf.numpy_function(run, [buffer], buffer.dtype, stateful=True)
    out.set_shape(shape)
    return out


def _finite(x: tf.Tensor, what: str) -> tf.Tensor:
    """x, after raising NonFiniteUpdateError if it holds NaN or Inf (eagerly, or as a graph check)."""

    def check(values: np.ndarray) -> np.ndarray:
        if not np.all(np.isfinite(values.astype(np.float32))):
            raise NonFiniteUpdateError(f"{what}; every rank stops at this step")
        return values

    if tf.executing_eagerly():
        check(np.asarray(x))
        return x
    checked = tf.numpy_function(check, [x], x.dtype, stateful=True)
    checked.set_shape(x.shape)
    return checked


def tree_across_processes(
    comm: Communicator, per_replica: Sequence[Sequence[tf.Tensor]], counts: Sequence[int], fp16: bool = False
) -> list[tf.Tensor]:
    """The contract tree over every replica of every process, for any numbers of replicas per process.

    Process q holds the leaves [counts[0] + ... + counts[q-1], ... + counts[q]) of the tree over
    sum(counts) replicas. Each process combines the nodes it can alone (tree.roots_within: where the
    tree splits inside a process, it holds two or more such roots), every process gathers every
    process's roots, and every process combines the rest of the tree from the gathered copies, with the
    same ops in the same order: the same bits on every process, and (without compression) the same
    bits as adasum_tree over all the replicas in one process. Each process receives every other's
    roots whole, so this moves more than VHDD; distributed.allreduce_replicas takes VHDD when every
    process holds the same power-of-two number of replicas, where the tree splits only between
    processes.

    Args:
        comm: the communicator.
        per_replica: this process's replicas' tensors, counts[comm.rank] lists, already checked to match
            every other process's and to be finite (no agreement runs here).
        counts: every process's number of replicas, in rank order.
        fp16: float32 and float64 roots cross processes as float16 (compression="fp16").
    """
    total = sum(counts)
    firsts = np.cumsum([0, *counts]).tolist()
    roots = [roots_within(total, firsts[q], firsts[q + 1]) for q in range(comm.size)]
    lo = firsts[comm.rank]
    mine = evaluate(
        {(lo + j, lo + j + 1): list(r) for j, r in enumerate(per_replica)}, total, pair_on_left_device
    )
    sent = [mine[span] for span in roots[comm.rank]]
    tensors = sent[0]
    width = max(len(r) for r in roots)
    values: dict[Span, list[Any]] = {span: [None] * len(tensors) for spans in roots for span in spans}
    n = len(tensors)
    rows = sent + [[tf.zeros_like(t) for t in tensors]] * (width - len(sent))  # the same width everywhere
    flat = [t for row in rows for t in row]
    for index in indices_by_dtype(tensors):
        # All roots in one buffer, one after another: one copy in, one all-gather, and every root's
        # tensors come back out as views of what arrived.
        buffer, starts, pads = _fuse(flat, [k * n + i for k in range(width) for i in index])
        narrow = fp16 and buffer.dtype in (tf.float32, tf.float64)
        gathered = _allgather(comm, tf.cast(buffer, tf.float16) if narrow else buffer)
        if narrow:  # a subtree result beyond float16's range; every process sees the same data
            gathered = _finite(gathered, "compression='fp16': a subtree result overflows float16")
        gathered = tf.reshape(tf.cast(gathered, buffer.dtype) if narrow else gathered, [-1])
        pieces = tf.split(gathered, comm.size * width)  # each root's stretch is aligned: views
        shapes = [tensors[i].shape for i in index]
        for q, spans in enumerate(roots):
            for k, span in enumerate(spans):
                root = _unfuse(pieces[q * width + k], starts[: len(index) + 1], pads[: len(index)], shapes)
                for i, t in zip(index, root, strict=True):
                    values[span][i] = t
    return evaluate(values, total, pair_on_left_device)[(0, total)]
