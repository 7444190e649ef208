"""The algorithms that combine one fused buffer across processes by the contract tree.

For P ranks (any P >= 1), with p2 the largest power of two <= P and r = P - p2, vector-halving,
distance-doubling (VHDD):

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

Each segment is computed by exactly one rank and then copied, so every rank ends with bitwise
identical results. The one all-gather (gather_*) is the other algorithm: every rank receives every
buffer and combines the whole tree itself, with the same ops in the same order; for small buffers
under the TF engine it is faster (see algorithm()).

Each algorithm is written once per memory kind: on TensorFlow tensors (vhdd_tensors, gather_tensors),
whose exchanges are ops of any communicator, and on one numpy buffer, in place (vhdd_host, gather_host),
for a HostCommunicator (MPI), through C entry points to the same core: the same arithmetic, so the same
bits. Both walk one halving schedule (_halving). The buffer's layout is fusion.py's; fusing, agreeing
and choosing are across_processes.py's.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import tensorflow as tf

from tf_adasum import ops, timeline
from tf_adasum.algorithm.fusion import ALIGN_BYTES, pieces
from tf_adasum.algorithm.tree import fill_nodes, fold_size
from tf_adasum.comm.base import Communicator, HostCommunicator
from tf_adasum.common import settings


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


def _combine_tensors(
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
    with timeline.ops_phase("dot and norms"):
        partial = ops.adasum_segment_dot_norms(left, right, bounds)
    index = tf.constant([[t] for t, _, _ in pieces], tf.int64)
    # One row per tensor on every rank of the block, zero where this rank holds none of it.
    flat = tf.reshape(tf.scatter_nd(index, partial, [n, 3]), [-1])
    if len(block) == 1:
        total = flat
    else:
        with timeline.ops_phase("block sum", ranks=list(block)):
            total = comm.group_sum(flat, block, "adasum block sum")
    rows = tf.gather(tf.reshape(total, [n, 3]), index[:, 0])
    with timeline.ops_phase("combine"):
        return ops.adasum_segment_combine(left, right, rows, bounds)


def vhdd_tensors(
    comm: Communicator,
    buffer: tf.Tensor,
    tensor_starts: Sequence[int],
    staged: bool = False,
    gather_parts: int = 1,
) -> tf.Tensor:
    """Adasum over all ranks of a fused 1-D buffer; tensor i fills [tensor_starts[i], tensor_starts[i+1]).

    staged: each step (the fold, each halving and gather level, the result to a folded rank) is one
    step of comm's pipeline (comm.stage), as pipelined_tensors runs it.
    gather_parts: with staged, the gather goes in this many parts, each through every gather level
    (_gather_in_parts).
    """
    p2, r = fold_size(comm.size)

    def step(index: int) -> contextlib.AbstractContextManager[None]:
        # Every rank numbers a step alike: the fold 0 (where there is one), the halving levels next,
        # then the gather levels, the result to the folded rank last; a rank that sits one out skips it.
        return comm.stage(index + (1 if r else 0)) if staged else contextlib.nullcontext()

    offsets = np.asarray(tensor_starts, np.int64)
    rank, total = comm.rank, int(offsets[-1])
    n = len(offsets) - 1
    align = ALIGN_BYTES // buffer.dtype.size
    everything = pieces(offsets, 0, total)
    if total == 0:
        return buffer

    size = buffer.dtype.size
    levels = _halving(rank // 2 if rank < 2 * r else rank - r, r, p2, total, align)
    if rank < 2 * r:
        if rank % 2 == 1:  # folded away: hand over, then wait for the result
            with step(-1), timeline.ops_phase("fold", peer=rank - 1, bytes=total * size):
                comm.exchange(rank - 1, buffer, 0, "adasum fold")
            with (
                step(2 * len(levels)),
                timeline.ops_phase("result to folded rank", peer=rank - 1, bytes=total * size),
            ):
                return comm.exchange(rank - 1, buffer[:0], total, "adasum result to folded rank")
        with step(-1), timeline.ops_phase("fold", peer=rank + 1, bytes=total * size):
            other = comm.exchange(rank + 1, buffer[:0], total, "adasum fold")
            buffer = _combine_tensors(comm, buffer, other, everything, n, [rank])

    for i, level in enumerate(levels):  # buffer holds the segment that starts at level.lo
        (klo, khi), (glo, ghi), lo = level.keep, level.give, level.lo
        with step(i), timeline.ops_phase(f"halving level {i + 1}", peer=level.peer, bytes=(ghi - glo) * size):
            mine = buffer[klo - lo : khi - lo]
            theirs = comm.exchange(level.peer, buffer[glo - lo : ghi - lo], khi - klo, "adasum halving")
            left, right = (mine, theirs) if level.lower else (theirs, mine)
            buffer = _combine_tensors(comm, left, right, pieces(offsets, klo, khi), n, level.block)

    if staged and gather_parts > 1:
        segments = sorted(_halving(v, r, p2, total, align)[-1].keep for v in range(p2))
        buffer = _gather_in_parts(comm, buffer, levels, segments, gather_parts, align, step)
    else:
        for i, level in reversed(list(enumerate(levels))):  # buffer holds level.keep; the peer sends the rest
            keep_bytes = (level.keep[1] - level.keep[0]) * size
            with (
                step(2 * len(levels) - 1 - i),
                timeline.ops_phase(f"gather level {i + 1}", peer=level.peer, bytes=keep_bytes),
            ):
                theirs = comm.exchange(level.peer, buffer, level.give[1] - level.give[0], "adasum gather")
                buffer = tf.concat([buffer, theirs] if level.lower else [theirs, buffer], 0)

    if rank < 2 * r:
        with (
            step(2 * len(levels)),
            timeline.ops_phase("result to folded rank", peer=rank + 1, bytes=total * size),
        ):
            comm.exchange(rank + 1, buffer, 0, "adasum result to folded rank")
    return buffer


def _gather_in_parts(
    comm: Communicator,
    segment: tf.Tensor,
    levels: list[_Level],
    segments: list[tuple[int, int]],
    parts: int,
    align: int,
    step: Callable[[int], contextlib.AbstractContextManager[None]],
) -> tf.Tensor:
    """The gather of vhdd_tensors in `parts` parts: part k of every rank's final segment (`segments`,
    in buffer order; this rank holds `segment`, levels[-1].keep) goes through every gather level on
    its own, each level one step of comm's pipeline, so part k + 1's first level runs while part k's
    second does (at 2x2 hosts: one part on the link while another crosses the host's loopback). The
    gather moves bits only, so the result is the same bits as the gather in one part; one more copy
    puts the parts back in the buffer's order."""
    cuts = {
        (lo, hi): [lo + (hi - lo) * k // parts // align * align for k in range(parts)] + [hi]
        for lo, hi in segments
    }
    own = levels[-1].keep
    gathered = []
    for k in range(parts):
        held = segment[cuts[own][k] - own[0] : cuts[own][k + 1] - own[0]]
        for i, level in reversed(list(enumerate(levels))):  # held: part k of the segments in level.keep
            glo, ghi = level.give
            size = sum(c[k + 1] - c[k] for (lo, _), c in cuts.items() if glo <= lo < ghi)
            sent = held.shape[0] * segment.dtype.size
            with (
                step(2 * len(levels) - 1 - i),
                timeline.ops_phase(f"gather level {i + 1}", peer=level.peer, part=k, bytes=sent),
            ):
                theirs = comm.exchange(level.peer, held, size, "adasum gather")
                held = tf.concat([held, theirs] if level.lower else [theirs, held], 0)
        gathered.append(held)  # part k of every segment, in buffer order
    starts = [0] * parts
    pieces_in_order = []
    for lo, hi in segments:
        for k in range(parts):
            length = cuts[(lo, hi)][k + 1] - cuts[(lo, hi)][k]
            pieces_in_order.append(gathered[k][starts[k] : starts[k] + length])
            starts[k] += length
    return tf.concat(pieces_in_order, 0)


def pipeline_cuts(tensor_starts: Sequence[int], itemsize: int) -> list[int]:
    """Where pipelined_tensors cuts a fused buffer: indices into tensor_starts, from 0 to the last.

    Up to PIPELINE_CHUNKS chunks of about the same bytes, each of whole tensors and at least
    PIPELINE_BYTES; [0, n] (one chunk) for a buffer smaller than two such chunks or of one tensor.
    """
    offsets = np.asarray(tensor_starts, np.int64)
    n, total = len(offsets) - 1, int(offsets[-1])
    chunks = min(PIPELINE_CHUNKS, total * itemsize // PIPELINE_BYTES, n)
    cuts = [0]
    for c in range(1, max(chunks, 1)):
        # The tensor boundary nearest the c-th equal share, if it leaves a chunk behind.
        share = total * c // chunks
        cut = int(np.searchsorted(offsets, share))
        if cut > 0 and share - offsets[cut - 1] < offsets[cut] - share:
            cut -= 1
        if cut > cuts[-1] and cut < n and (offsets[cut] - offsets[cuts[-1]]) * itemsize >= PIPELINE_BYTES:
            cuts.append(cut)
    if cuts[-1] != 0 and (total - offsets[cuts[-1]]) * itemsize < PIPELINE_BYTES:
        cuts.pop()  # the last chunk would be too small: it joins the one before
    return [*cuts, n]


def pipelined_tensors(comm: Communicator, buffer: tf.Tensor, tensor_starts: Sequence[int]) -> tf.Tensor:
    """vhdd_tensors on chunks of whole tensors (pipeline_cuts), as a pipeline, where the engine runs
    one (comm.pipeline_stages): chunk c + 1's fold or first level runs while chunk c's second runs, and
    so on, so one chunk's dot products, block sums and combine, and a level over the host's loopback,
    overlap another chunk's transfer on the link. Adasum's coefficients are per tensor and each tensor
    is in one chunk, so this is the same tree, and every rank gets the same bits; only a tensor's float64
    partial dot products may be cut where one VHDD over the whole buffer would cut them otherwise.
    A buffer of one chunk goes as one VHDD whose gather alone goes in parts (_gather_in_parts)."""
    cuts = pipeline_cuts(tensor_starts, buffer.dtype.size) if comm.pipeline_stages else [0]
    if len(cuts) <= 2:
        # One chunk (one tensor, or one that would leave too little for another): its gather, which
        # moves bits only, can still go in parts, each at least PIPELINE_BYTES of the buffer and a
        # quarter of that (1 MiB) of a rank's final segment, so that many processes do not cut it into
        # parts that cost more collectives than they overlap; where the gather has two levels or more.
        total_bytes, p2 = int(tensor_starts[-1]) * buffer.dtype.size, fold_size(comm.size)[0]
        parts = min(PIPELINE_CHUNKS, total_bytes // PIPELINE_BYTES, total_bytes // (p2 * PIPELINE_BYTES // 4))
        staged = comm.pipeline_stages > 0 and parts > 1 and p2 >= 4
        return vhdd_tensors(comm, buffer, tensor_starts, staged=staged, gather_parts=parts)
    offsets = [int(s) for s in tensor_starts]
    chunks = []
    for a, b in itertools.pairwise(cuts):
        starts = [s - offsets[a] for s in offsets[a : b + 1]]
        with timeline.ops_phase("pipeline chunk", tensors=b - a, bytes=starts[-1] * buffer.dtype.size):
            chunks.append(vhdd_tensors(comm, buffer[offsets[a] : offsets[b]], starts, staged=True))
    return tf.concat(chunks, 0)


def _combine_host(
    comm: HostCommunicator,
    left: np.ndarray,
    right: np.ndarray,
    out: np.ndarray,
    pieces: list[tuple[int, int, int]],
    n: int,
    block: list[int],
    threads: int,
) -> None:
    """_combine_tensors on numpy buffers, written into `out`."""
    flat = np.zeros([n, 3], np.float64)
    if pieces:
        bounds = [0] + [e for _, _, e in pieces]
        index = [t for t, _, _ in pieces]
        with timeline.phase("dot and norms", bytes=2 * left.nbytes):
            partial = ops.host_segment_dot_norms(left, right, bounds, threads)
        flat[index] = partial
    total = flat if len(block) == 1 else comm.group_sum_host(flat.reshape(-1), block, "adasum block sum")
    if pieces:
        with timeline.phase("combine", bytes=3 * left.nbytes):
            ops.host_segment_combine(left, right, total.reshape(n, 3)[index], out, bounds, threads)


def vhdd_host(
    comm: HostCommunicator,
    buf: np.ndarray,
    tensor_starts: Sequence[int],
    threads: int = 1,
    source: np.ndarray | None = None,
) -> None:
    """vhdd_tensors on a numpy buffer, in place, for a HostCommunicator (MPI).

    The same algorithm and arithmetic as vhdd_tensors, so the same bits; but every step is a call on
    numpy memory: halves are received into one scratch buffer, combined in place, and the gather
    receives each peer's part straight into its place in `buf`.

    With `source` (this rank's input, laid out as `buf` and left unchanged), `buf` need hold nothing
    yet: the first step reads the input from `source` and writes its result into `buf`, so nobody
    copies the input into `buf` first.
    """
    p2, r = fold_size(comm.size)
    offsets = np.asarray(tensor_starts, np.int64)
    rank, total = comm.rank, int(offsets[-1])
    n = len(offsets) - 1
    align = ALIGN_BYTES // buf.itemsize
    nothing = buf[:0]
    data = buf if source is None else source  # where this rank's current values are
    if total == 0:
        return
    if rank < 2 * r:
        if rank % 2 == 1:  # folded away: hand over, then wait for the result
            with timeline.phase("fold", peer=rank - 1, bytes=data.nbytes):
                comm.sendrecv_host(rank - 1, data, nothing, "adasum fold")
            with timeline.phase("result to folded rank", peer=rank - 1, bytes=buf.nbytes):
                comm.sendrecv_host(rank - 1, nothing, buf, "adasum result to folded rank")
            return
        other = np.empty_like(buf)
        with timeline.phase("fold", peer=rank + 1, bytes=buf.nbytes):
            comm.sendrecv_host(rank + 1, nothing, other, "adasum fold")
            _combine_host(comm, data, other, buf, pieces(offsets, 0, total), n, [rank], threads)
        data, scratch = buf, other
    else:
        scratch = np.empty(total - total // 2 // align * align, buf.dtype)
    v = rank // 2 if rank < 2 * r else rank - r

    levels = _halving(v, r, p2, total, align)
    for i, level in enumerate(levels):  # each level's kept half holds the next level's segment
        (klo, khi), (glo, ghi) = level.keep, level.give
        mine, theirs = data[klo:khi], scratch[: khi - klo]
        with timeline.phase(f"halving level {i + 1}", peer=level.peer, bytes=(ghi - glo) * buf.itemsize):
            comm.sendrecv_host(level.peer, data[glo:ghi], theirs, "adasum halving")
            left, right = (mine, theirs) if level.lower else (theirs, mine)
            _combine_host(comm, left, right, buf[klo:khi], pieces(offsets, klo, khi), n, level.block, threads)
        data = buf

    for i, level in reversed(list(enumerate(levels))):  # send the part kept, receive the part given
        (klo, khi), (glo, ghi) = level.keep, level.give
        with timeline.phase(f"gather level {i + 1}", peer=level.peer, bytes=(khi - klo) * buf.itemsize):
            comm.sendrecv_host(level.peer, buf[klo:khi], buf[glo:ghi], "adasum gather")

    if rank < 2 * r:
        with timeline.phase("result to folded rank", peer=rank + 1, bytes=buf.nbytes):
            comm.sendrecv_host(rank + 1, buf, nothing, "adasum result to folded rank")


def gather_tensors(comm: Communicator, buffer: tf.Tensor, tensor_starts: Sequence[int]) -> tf.Tensor:
    """The contract tree over every rank of a fused 1-D buffer, by one all-gather.

    Every rank receives every other's whole buffer and combines the whole tree itself, with the same
    ops in the same order as the others: the same bits everywhere. Each rank sends its buffer to
    every other, (P - 1) N in all; VHDD sends 2 N (P - 1) / P. At 2 ranks that is the same bytes in one
    collective instead of VHDD's three, with twice the arithmetic; above, it is for small buffers.
    """
    if int(tensor_starts[-1]) == 0:
        return buffer
    return tree_of_rows(comm, comm.allgather(buffer), tensor_starts)


def tree_of_rows(comm: Communicator, rows: tf.Tensor, tensor_starts: Sequence[int]) -> tf.Tensor:
    """gather_tensors after its all-gather: the tree over rows[q], rank q's buffer."""
    offsets = np.asarray(tensor_starts, np.int64)
    total, n = int(offsets[-1]), len(offsets) - 1
    everything = pieces(offsets, 0, total)

    def pair(left: tf.Tensor, right: tf.Tensor) -> tf.Tensor:
        return _combine_tensors(comm, left, right, everything, n, [comm.rank])

    return fill_nodes({(q, q + 1): rows[q] for q in range(comm.size)}, comm.size, pair)[(0, comm.size)]


def gather_host(
    comm: HostCommunicator,
    buf: np.ndarray,
    tensor_starts: Sequence[int],
    threads: int = 1,
    source: np.ndarray | None = None,
) -> None:
    """gather_tensors on a numpy buffer, in place, for a HostCommunicator (MPI); with `source`, the
    input is read from there, as in vhdd_host."""
    offsets = np.asarray(tensor_starts, np.int64)
    total, n = int(offsets[-1]), len(offsets) - 1
    if total == 0:
        return
    rows = np.empty((comm.size, total), buf.dtype)
    comm.allgather_host(buf if source is None else source, rows, "adasum gather")
    everything = pieces(offsets, 0, total)

    def pair(left: np.ndarray, right: np.ndarray) -> np.ndarray:
        # Each node's result lives in its first leaf's row.
        _combine_host(comm, left, right, left, everything, n, [comm.rank], threads)
        return left

    buf[:] = fill_nodes({(q, q + 1): rows[q] for q in range(comm.size)}, comm.size, pair)[(0, comm.size)]


# pipelined_tensors: at most this many chunks, each at least this large. At 1 Gbit/s the ResNet-50 list
# (97.5 MB, 161 tensors) took 0.67-0.93x its time as one VHDD in 4 chunks, 0.60-0.93x in 8 (three jobs)
# and 0.67-0.91x in 16, on 2x1, 4x1 and 2x2 hosts (benchmarks/README.md, bench_cluster: round6).
PIPELINE_CHUNKS = 8
PIPELINE_BYTES = 4 << 20
# The all-gather at most this much in all (its memory and arithmetic grow with P).
GATHER_BELOW_BYTES = 4 << 20
# What one collective of the TF engine costs beyond its bytes (its launch, the group's resolution): the
# latency term of benchmarks/collectives/cost_model.py's model, ~1 ms on loopback and on the namespace
# cluster.
COLLECTIVE_SECONDS = 1e-3


class Algorithm(NamedTuple):
    """One algorithm, on both memory kinds: fn(comm, buffer, tensor_starts)."""

    name: str
    on_tensors: Callable[[Communicator, tf.Tensor, Sequence[int]], tf.Tensor]
    on_host: Callable[[HostCommunicator, np.ndarray, Sequence[int], int, np.ndarray | None], None]


_ALGORITHMS = {
    "vhdd": Algorithm("vhdd", pipelined_tensors, vhdd_host),
    "gather": Algorithm("gather", gather_tensors, gather_host),
}


def algorithm(comm: Communicator, nbytes: int) -> Algorithm:
    """How to combine one fused buffer of nbytes across comm's ranks: VHDD or the one all-gather.

    $TF_ADASUM_ALGORITHM=vhdd|gather forces one (for benchmarks and for checking one against the other).
    """
    forced = settings.forced_algorithm()
    if forced:
        return _ALGORITHMS[forced]
    if not comm.gathers_small_buffers:
        return _ALGORITHMS["vhdd"]
    return _ALGORITHMS["gather" if gather_is_faster(comm.size, nbytes, settings.link_gbits()) else "vhdd"]


def gather_is_faster(p: int, nbytes: int, gbits: float) -> bool:
    """Whether one all-gather beats VHDD for nbytes on p ranks of the TF engine, over a link of `gbits`.

    The all-gather sends (p - 1) N per rank in one collective; VHDD sends the bound 2 N (p - 1) / p in
    2 log2 p2 exchanges and log2 p2 block sums, 2 more exchanges for a fold. The all-gather wins where
    the time of its extra bytes on the link is less than the latency of the collectives it saves, and
    while it stays small (GATHER_BELOW_BYTES). At p = 2 the bytes are the same.
    """
    if nbytes * (p - 1) > GATHER_BELOW_BYTES:
        return False
    p2, r = fold_size(p)
    levels = p2.bit_length() - 1
    collectives = 3 * levels + (2 if r else 0)
    extra_bytes = nbytes * (p - 1) * (1 - 2 / p)
    return extra_bytes * 8 / (gbits * 1e9) <= (collectives - 1) * COLLECTIVE_SECONDS


def host_threads(comm: Communicator) -> int:
    """Threads for one rank's host arithmetic: this machine's cores shared among its ranks."""
    return max(1, (os.cpu_count() or 1) // max(1, comm.local_size))
