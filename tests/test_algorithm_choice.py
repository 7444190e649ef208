"""How the TF engine chooses between VHDD and one all-gather (tf_adasum/vhdd.py): by the bytes each
sends, the link's speed and the collectives each takes; MPI always takes VHDD. And where VHDD cuts a
large buffer into the chunks of its pipeline (vhdd.pipeline_cuts), and one buffer's gather into parts
(vhdd._gather_in_parts)."""

from __future__ import annotations

import collections
import contextlib
import itertools
import threading

import numpy as np
import pytest
import tensorflow as tf

from tf_adasum import vhdd
from tf_adasum.tree import fold_size

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
    assert vhdd.link_gbits() == vhdd.LINK_GBITS
    monkeypatch.setenv("TF_ADASUM_LINK_GBITS", "25")
    assert vhdd.link_gbits() == 25.0
    for bad in ("fast", "0", "-1"):
        monkeypatch.setenv("TF_ADASUM_LINK_GBITS", bad)
        with pytest.raises(ValueError, match=f"TF_ADASUM_LINK_GBITS='{bad}'; expected the link's speed"):
            vhdd.link_gbits()


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


def _gather_everywhere(p: int, buffer: np.ndarray, parts: int, align: int) -> dict[int, np.ndarray]:
    """What each rank of the gather (virtual rank) holds after vhdd._gather_in_parts, each a thread."""
    p2, r = fold_size(p)
    total = buffer.size
    segments = sorted(vhdd._halving(u, r, p2, total, align)[-1].keep for u in range(p2))
    pairs, finals, errors = _Pairs(), {}, []

    def rank_of(v: int) -> None:
        try:
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
        except BaseException as error:  # reported below, with the rank
            errors.append((v, error))

    threads = [threading.Thread(target=rank_of, args=(v,)) for v in range(p2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
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
