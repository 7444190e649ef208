"""How the TF engine chooses between VHDD and one all-gather (tf_adasum/vhdd.py): by the bytes each
sends, the link's speed and the collectives each takes; MPI always takes VHDD. And where VHDD cuts a
large buffer into the chunks of its pipeline (vhdd.pipeline_cuts)."""

from __future__ import annotations

import itertools

import pytest

from tf_adasum import vhdd

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
