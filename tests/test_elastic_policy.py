"""The elastic launcher's membership rules (tf_adasum/launch/elastic/policy.py), without processes: who
forms the next group, how processes and groups end, when a process still running is hung."""

from __future__ import annotations

import signal

import pytest

from tf_adasum.launch.elastic import policy as policy
from tf_adasum.launch.protocol import RESTART_EXIT_CODE


def test_survivors_keep_their_slots_in_rank_order_and_new_processes_fill_up_to_the_target() -> None:
    chosen = policy.choose_members({"a": 2, "b": 2}, {}, ["b", "a"], target=4)
    assert chosen.kept == [0, 1] and chosen.new_hosts == ["a", "b"] and chosen.size == 4


def test_a_lost_workers_slot_stays_empty() -> None:
    # Two slots on "a", one of them blocked by a lost worker: the survivor on "a" keeps the other.
    chosen = policy.choose_members({"a": 2, "b": 1}, {"a": 1}, ["a", "b"], target=3)
    assert chosen.kept == [0, 1] and chosen.new_hosts == []


def test_a_survivor_whose_host_is_gone_is_left_out() -> None:
    chosen = policy.choose_members({"b": 2}, {}, ["a", "b"], target=2)
    assert chosen.kept == [1] and chosen.new_hosts == ["b"]


def test_survivors_are_never_dropped_for_the_target() -> None:
    chosen = policy.choose_members({"a": 4}, {}, ["a", "a", "a"], target=2)
    assert chosen.kept == [0, 1, 2] and chosen.new_hosts == []


def test_growth_needs_free_slots_beyond_the_group_and_room_below_max_np() -> None:
    assert policy.has_more_slots({"a": 3}, {}, in_use=2, max_np=4)
    assert not policy.has_more_slots({"a": 3}, {"a": 1}, in_use=2, max_np=4)  # the free one is blocked
    assert not policy.has_more_slots({"a": 8}, {}, in_use=4, max_np=4)
    assert not policy.has_more_slots({"a": 2}, {}, in_use=2, max_np=4)


def test_exit_codes_tell_done_restart_and_lost() -> None:
    assert policy.process_outcome(0) == policy.DONE
    assert policy.process_outcome(RESTART_EXIT_CODE) == policy.RESTART
    assert policy.process_outcome(1) == "lost: exited with 1"
    assert policy.process_outcome(-signal.SIGKILL) == "lost: killed by SIGKILL"


@pytest.mark.parametrize(
    ("outcomes", "end"),
    [
        ([policy.DONE, policy.DONE], policy.GroupEnd.DONE),
        ([policy.DONE, policy.RESTART], policy.GroupEnd.FINISHED),
        ([policy.DONE, "lost: exited with 1"], policy.GroupEnd.FINISHED),
        (["lost: exited with 1", "lost: killed by SIGKILL"], policy.GroupEnd.ALL_FAILED),
        ([policy.RESTART, "lost: killed by SIGKILL"], policy.GroupEnd.RESET),
        ([policy.RESTART, policy.RESTART], policy.GroupEnd.RESET),
    ],
)
def test_a_groups_end(outcomes: list[str], end: policy.GroupEnd) -> None:
    assert policy.group_end(outcomes) is end


def test_a_process_still_running_is_hung_after_the_timeout_or_when_left_alone() -> None:
    assert not policy.hung(now=100.0, first_exit=None, last_alone=None, peer_timeout=60, grace=10)
    assert not policy.hung(now=100.0, first_exit=50.0, last_alone=None, peer_timeout=60, grace=10)
    assert policy.hung(now=121.0, first_exit=50.0, last_alone=None, peer_timeout=60, grace=10)
    assert not policy.hung(now=100.0, first_exit=50.0, last_alone=95.0, peer_timeout=60, grace=10)
    assert policy.hung(now=106.0, first_exit=50.0, last_alone=95.0, peer_timeout=60, grace=10)


def test_discovery_output_is_parsed_and_bad_lines_are_refused() -> None:
    assert policy.parse_slots("a:2\n# comment\n\nb\na:1\n") == {"a": 3, "b": 1}
    assert policy.parse_slots("10.0.0.1:2\nnode-3.cluster_x:1\n") == {"10.0.0.1": 2, "node-3.cluster_x": 1}
    with pytest.raises(ValueError, match=r"expected host:slots lines .* got line 1: 'a:x'"):
        policy.parse_slots("a:x")


@pytest.mark.parametrize(
    "line",
    [
        "Using cached credentials",  # a script's chatter: once ssh'd to as a host
        "-oProxyCommand=touch /tmp/owned:1",  # an option for ssh
        "host;reboot:1",
        "$(id):2",
        "host name:1",
    ],
)
def test_a_line_that_is_not_a_host_is_refused_with_its_text(line: str) -> None:
    with pytest.raises(ValueError, match="not starting with '-'") as refused:
        policy.parse_slots(f"a:1\n{line}\n")
    assert f"got line 2: {line!r}" in str(refused.value)
