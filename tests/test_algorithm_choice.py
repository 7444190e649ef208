"""How the TF engine chooses between VHDD and one all-gather (tf_adasum/vhdd.py): by the bytes each
sends, the link's speed and the collectives each takes; MPI always takes VHDD."""

from __future__ import annotations

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
