"""How the TF engine chooses between VHDD and one all-gather (tf_adasum/algorithm/vhdd.py): by the bytes each
sends, the link's speed and the collectives each takes; MPI always takes VHDD. And where VHDD cuts a
large buffer into the chunks of its pipeline (vhdd.pipeline_cuts), and one buffer's gather into parts
(vhdd._gather_in_parts), and VHDD itself on any number of ranks, each rank a thread."""

from __future__ import annotations

import collections
import contextlib
import itertools
import threading
from collections.abc import Callable

import numpy as np
import pytest
import tensorflow as tf

from tests.support import oracle
from tf_adasum.algorithm import vhdd
from tf_adasum.algorithm.tree import fold_size
from tf_adasum.common import settings

MB = 1 << 20


def test_on_two_ranks_the_gather_sends_no_more_and_wins_up_to_its_size_cap() -> None:
    for gbits in (1, 10, 100):
        assert vhdd.gather_is_faster(2, 4 * MB, gbits)
        assert not vhdd.gather_is_faster(2, 4 * MB + 1, gbits)


def test_on_a_slow_link_vhdd_wins_where_the_gathers_extra_bytes_cost_more_than_its_saved_latency() -> None:
    # 4 ranks, 1 MiB: the gather sends 3 MiB, VHDD 1.5 MiB in 6 collectives (5 ms saved by the gather).
    # At 1 Gbit/s its extra 1.5 MiB take 12.6 ms; at 10 Gbit/s, 1.3 ms.
    assert not vhdd.gather_is_faster(4, MB, 1)
    assert vhdd.gather_is_faster(4, MB, 10)
    assert vhdd.gather_is_faster(4, MB // 16, 1)
    # The fold's two exchanges count: 3 ranks save 4 collectives.
    assert vhdd.gather_is_faster(3, MB, 10) and not vhdd.gather_is_faster(3, MB, 1)


def test_the_link_comes_from_the_environment_and_a_bad_value_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("TF_ADASUM_LINK_GBITS", raising=False)
    assert settings.link_gbits() == settings.LINK_GBITS
    monkeypatch.setenv("TF_ADASUM_LINK_GBITS", "25")
    assert settings.link_gbits() == 25.0
    for bad in ("fast", "0", "-1"):
        monkeypatch.setenv("TF_ADASUM_LINK_GBITS", bad)
        with pytest.raises(ValueError, match=f"TF_ADASUM_LINK_GBITS='{bad}'; expected the link's speed"):
            settings.link_gbits()


def check_cuts(starts: list[int], itemsize: int, want: list[int]) -> None:
    cuts = vhdd.pipeline_cuts(starts, itemsize)
    assert cuts == want, (starts, cuts)
    assert cuts[0] == 0 and cuts[-1] == len(starts) - 1
    assert all(a < b for a, b in itertools.pairwise(cuts)) or cuts == [0, 0]  # [0, 0]: no tensors
    assert len(cuts) - 1 <= vhdd.PIPELINE_CHUNKS
    if len(cuts) > 2:  # every chunk of a pipeline holds at least PIPELINE_BYTES
        assert all(
            (starts[b] - starts[a]) * itemsize >= vhdd.PIPELINE_BYTES for a, b in itertools.pairwise(cuts)
        )


def test_the_pipeline_cuts_between_whole_tensors_into_chunks_of_at_least_its_floor() -> None:
    floor = vhdd.PIPELINE_BYTES
    check_cuts([0], 4, [0, 0])  # no tensors
    check_cuts([0, 64 * MB], 1, [0, 1])  # one tensor goes whole, however large
    check_cuts([0, floor, 2 * floor - 1], 1, [0, 2])  # under two chunks' worth: one chunk
    check_cuts([0, floor, 2 * floor], 1, [0, 1, 2])
    # 16 tensors of a floor each: PIPELINE_CHUNKS chunks of about the same bytes.
    check_cuts([i * floor for i in range(17)], 1, [0, 2, 4, 6, 8, 10, 12, 14, 16])
    # Empty tensors at a cut and at the end: no empty chunk.
    check_cuts([0, floor, floor, 2 * floor, 2 * floor], 1, [0, 1, 4])
    # A small last tensor joins the chunk before; one large tensor last takes a chunk of its own.
    check_cuts([0, floor, 2 * floor, 2 * floor + 5], 1, [0, 1, 3])
    check_cuts([0, floor // 2, floor, 20 * floor], 1, [0, 2, 3])
    # The boundary nearest the half leaves half a floor behind it: one chunk, not a chunk too small.
    check_cuts([0, floor * 8 // 5, floor * 21 // 10], 1, [0, 2])
    # In float32 elements: 4 bytes each.
    check_cuts([0, floor // 4, floor // 2], 4, [0, 1, 2])


def test_the_pipeline_takes_at_most_its_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    floor = vhdd.PIPELINE_BYTES
    monkeypatch.setattr(vhdd, "PIPELINE_CHUNKS", 1)
    check_cuts([i * floor for i in range(17)], 1, [0, 16])
    monkeypatch.setattr(vhdd, "PIPELINE_CHUNKS", 3)
    check_cuts([i * floor for i in range(17)], 1, [0, 5, 11, 16])  # the boundaries nearest 16/3, 32/3


class _Pairs:
    """Ranks as threads of this process whose exchanges meet in one mailbox: the nth exchange of rank a
    with rank b gets the nth of b with a, as the collective runtime matches them."""

    def __init__(self) -> None:
        self.box: dict[tuple[int, int, int], np.ndarray] = {}
        self.sums: dict[tuple[tuple[int, ...], int, int], np.ndarray] = {}  # (block, nth sum, rank)
        self.changed = threading.Condition()


class _ThreadRank:
    def __init__(self, rank: int, pairs: _Pairs) -> None:
        self.rank, self.pairs, self.count = rank, pairs, collections.Counter[int]()

    def exchange(self, peer: int, send: tf.Tensor, recv_size: int, what: str) -> tf.Tensor:
        n = self.count[peer]
        self.count[peer] += 1
        with self.pairs.changed:
            self.pairs.box[(self.rank, peer, n)] = send.numpy()
            self.pairs.changed.notify_all()
            arrived = self.pairs.changed.wait_for(lambda: (peer, self.rank, n) in self.pairs.box, timeout=30)
            assert arrived, f"rank {self.rank}: exchange {n} with rank {peer} never came"
            got = self.pairs.box[(peer, self.rank, n)]
        assert got.size == recv_size, (self.rank, peer, n, got.size, recv_size)
        return tf.constant(got)


def _each_rank_a_thread(ranks: int, run: Callable[[int], None]) -> None:
    """run(rank) for every rank at once, each in a thread; fails naming each rank that raised."""
    errors = []

    def guarded(rank: int) -> None:
        try:
            run(rank)
        except BaseException as error:  # reported below, with the rank
            errors.append((rank, error))

    threads = [threading.Thread(target=guarded, args=(rank,)) for rank in range(ranks)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors


def _gather_everywhere(p: int, buffer: np.ndarray, parts: int, align: int) -> dict[int, np.ndarray]:
    """What each rank of the gather (virtual rank) holds after vhdd._gather_in_parts, each a thread."""
    p2, r = fold_size(p)
    total = buffer.size
    segments = sorted(vhdd._halving(u, r, p2, total, align)[-1].keep for u in range(p2))
    pairs, finals = _Pairs(), {}

    def rank_of(v: int) -> None:
        levels = vhdd._halving(v, r, p2, total, align)
        lo, hi = levels[-1].keep
        finals[v] = vhdd._gather_in_parts(
            _ThreadRank(vhdd.virtual_to_real(v, r), pairs),  # type: ignore[arg-type]
            tf.constant(buffer[lo:hi]),
            levels,
            segments,
            parts,
            align,
            lambda step: contextlib.nullcontext(),
        ).numpy()

    _each_rank_a_thread(p2, rank_of)
    return finals


@pytest.mark.parametrize("p", [4, 5, 6, 7, 8, 12])
def test_a_gather_in_parts_gives_every_rank_the_whole_buffer_in_order(p: int) -> None:
    """vhdd._gather_in_parts itself, with each rank that takes part in the gather (the fold's
    survivors: virtual ranks 0..p2-1) a thread: whatever the parts, the totals and the alignment, every
    rank ends with the buffer as it was, each exchange receiving what its peer sent."""
    p2 = fold_size(p)[0]
    for total, parts, align in [(196613, 8, 16), (1001, 3, 16), (64, 2, 16), (4097, 5, 1), (12345, 8, 32)]:
        buffer = np.arange(total, dtype=np.float32)
        finals = _gather_everywhere(p, buffer, parts, align)
        assert sorted(finals) == list(range(p2)), (total, parts, align)
        for v in range(p2):
            np.testing.assert_array_equal(finals[v], buffer, err_msg=f"p {p}, total {total}, rank {v}")


class _ThreadComm(_ThreadRank):
    """A rank of _Pairs with what vhdd_tensors needs beside exchanges: its size, block sums that meet in
    the mailbox too (every member adds the block's values in rank order: one collective, the same bits
    for all), and a pipeline's steps (which only order collectives, so here they do nothing)."""

    def __init__(self, rank: int, size: int, pairs: _Pairs) -> None:
        super().__init__(rank, pairs)
        self.size, self.calls = size, collections.Counter[str]()
        self.sums = collections.Counter[tuple[int, ...]]()

    def exchange(self, peer: int, send: tf.Tensor, recv_size: int, what: str) -> tf.Tensor:
        self.calls["exchange"] += 1
        return super().exchange(peer, send, recv_size, what)

    def group_sum(self, values: tf.Tensor, group: list[int], what: str) -> tf.Tensor:
        self.calls["block sum"] += 1
        key = tuple(sorted(group))
        n = self.sums[key]
        self.sums[key] += 1
        with self.pairs.changed:
            self.pairs.sums[(key, n, self.rank)] = values.numpy()
            self.pairs.changed.notify_all()
            arrived = self.pairs.changed.wait_for(
                lambda: all((key, n, q) in self.pairs.sums for q in key), timeout=30
            )
            assert arrived, f"rank {self.rank}: block sum {n} over {key} never completed"
            total = self.pairs.sums[(key, n, key[0])].copy()
            for q in key[1:]:
                total += self.pairs.sums[(key, n, q)]
        return tf.constant(total)

    def stage(self, step: int) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


def _vhdd_everywhere(
    rows: list[np.ndarray], starts: list[int], gather_parts: int = 1
) -> tuple[list[np.ndarray], list[collections.Counter[str]]]:
    """vhdd.vhdd_tensors on every rank's row, each rank a thread (staged, with gather_parts > 1): each
    rank's result and the calls it made."""
    p = len(rows)
    pairs, results = _Pairs(), [np.empty(0)] * p
    comms = [_ThreadComm(rank, p, pairs) for rank in range(p)]

    def rank_of(rank: int) -> None:
        results[rank] = vhdd.vhdd_tensors(
            comms[rank],  # type: ignore[arg-type]
            tf.constant(rows[rank]),
            starts,
            staged=gather_parts > 1,
            gather_parts=gather_parts,
        ).numpy()

    _each_rank_a_thread(p, rank_of)
    return results, [c.calls for c in comms]


@pytest.mark.parametrize("p", [2, 3, 4, 5, 6, 7, 8, 12])
def test_vhdd_on_any_number_of_ranks_gives_the_tree_with_the_same_bits_everywhere(p: int) -> None:
    """vhdd_tensors itself, each rank a thread: the fold, every halving level's exchange, dot products,
    block sum and combine, the gather, the result to the folded ranks. Every rank gets the same bits and
    the contract tree's values, with tensors cut across segments; each rank makes the exchanges and
    block sums VHDD takes; and from 4 ranks its gather in 3 parts gives the same bits. (The processes of
    tests/test_multiprocess.py check it on TensorFlow's runtime at 3 and 4.)"""
    rng = np.random.default_rng(p)
    sizes = [0, 7, 1000, 33, 4096, 1, 250]  # an empty tensor, odd sizes: tensors cut across segments
    starts = [0, *itertools.accumulate(sizes)]
    rows = [rng.standard_normal(starts[-1]).astype(np.float32) for _ in range(p)]
    got, calls = _vhdd_everywhere(rows, starts)
    for rank in range(p):
        np.testing.assert_array_equal(got[rank], got[0], err_msg=f"rank {rank}")
    want = np.concatenate(oracle.tree([[row[a:b] for a, b in itertools.pairwise(starts)] for row in rows]))
    np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=1e-5 * np.max(np.abs(want)))
    p2, r = fold_size(p)
    levels = p2.bit_length() - 1
    for rank in range(p):
        if rank < 2 * r and rank % 2 == 1:  # folded away: its buffer there, the result back
            assert calls[rank] == {"exchange": 2}, (rank, calls[rank])
        else:  # the fold's survivors take the fold and the result too
            folds = 2 if rank < 2 * r else 0
            assert calls[rank] == {"exchange": 2 * levels + folds, "block sum": levels}, (rank, calls[rank])
    if p2 >= 4:
        parted, _ = _vhdd_everywhere(rows, starts, gather_parts=3)
        for rank in range(p):
            np.testing.assert_array_equal(parted[rank], got[0], err_msg=f"rank {rank}, in parts")
