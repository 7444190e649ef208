"""The elastic launcher's membership policy as pure functions: who forms the next group, how a process
and a group ended, when a process still running counts as hung. No processes, no clock, no TensorFlow:
tests/test_elastic_policy.py checks each rule on its own.
"""

from __future__ import annotations

import collections
import enum
import signal
from collections.abc import Mapping
from dataclasses import dataclass

from tf_adasum.launch.hosts import HOST_NAME_RULE, is_host_name
from tf_adasum.launch.protocol import RESTART_EXIT_CODE

DONE, RESTART = "done", "restart"


def parse_slots(text: str) -> dict[str, int]:
    """{host: slots} from a discovery script's output: `host:slots` or `host` lines (one slot).

    Raises:
        ValueError: a line that is not one of those, naming it: the whole answer is refused, since a
            stray line (a login banner, an option) must never become a host to start processes on.
    """
    slots: dict[str, int] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        host, sep, count = line.rpartition(":")
        if not sep:
            host, count = line, "1"
        if not is_host_name(host) or not count.isdigit():
            raise ValueError(
                f"expected host:slots lines (a host name is {HOST_NAME_RULE}), got line {number}: {line!r}"
            )
        slots[host] = slots.get(host, 0) + int(count)
    return slots


def free_slots(slots: Mapping[str, int], blocked: Mapping[str, int]) -> collections.Counter[str]:
    """The slots a group may use: the discovery's, less those of lost workers (blocked), per host."""
    free = collections.Counter(slots)
    free.subtract(blocked)
    return free


@dataclass
class Membership:
    kept: list[int]  # the survivors (by their index in the list given) that keep a slot, in order
    new_hosts: list[str]  # a host for each new process

    @property
    def size(self) -> int:
        return len(self.kept) + len(self.new_hosts)


def choose_members(
    slots: Mapping[str, int], blocked: Mapping[str, int], survivor_hosts: list[str], target: int
) -> Membership:
    """The next group: every survivor whose host still has a free slot, in their old rank order, then
    new processes on the free slots left, in the discovery's host order, up to `target` in all.

    Survivors are never dropped for the target: a group may start larger than it (they keep their
    state); new processes only fill up to it.
    """
    free = free_slots(slots, blocked)
    kept = []
    for i, host in enumerate(survivor_hosts):
        if free[host] > 0:
            free[host] -= 1
            kept.append(i)
    new_hosts: list[str] = []
    for host in slots:
        while free[host] > 0 and len(kept) + len(new_hosts) < target:
            free[host] -= 1
            new_hosts.append(host)
    return Membership(kept, new_hosts)


def has_more_slots(slots: Mapping[str, int], blocked: Mapping[str, int], in_use: int, max_np: int) -> bool:
    """Whether a group of `in_use` processes should grow: free slots beyond it, and room below max_np."""
    if in_use >= max_np:
        return False
    return sum(max(n, 0) for n in free_slots(slots, blocked).values()) > in_use


def describe_exit(code: int) -> str:
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exited with {code}"


def process_outcome(code: int) -> str:
    """How a process ended, from its exit code: DONE, RESTART (it survived and left its commits), or
    "lost: ..."."""
    if code == 0:
        return DONE
    if code == RESTART_EXIT_CODE:
        return RESTART
    return f"lost: {describe_exit(code)}"


class GroupEnd(enum.Enum):
    DONE = "every process finished training: the job is done"
    FINISHED = "some processes finished training while others left: the job is done"
    ALL_FAILED = "every process failed on its own: a new group would fail the same way"
    RESET = "a new group starts with the survivors"


def group_end(outcomes: list[str]) -> GroupEnd:
    """What a group's end means for the job, from its processes' outcomes."""
    if all(o == DONE for o in outcomes):
        return GroupEnd.DONE
    if any(o == DONE for o in outcomes):
        return GroupEnd.FINISHED
    if not any(o == RESTART for o in outcomes):
        return GroupEnd.ALL_FAILED
    return GroupEnd.RESET


def hung(
    now: float, first_exit: float | None, last_alone: float | None, peer_timeout: float, grace: float
) -> bool:
    """Whether the processes still running after others of their group exited count as hung: `grace`
    seconds since only one was left running (last_alone), or the peer timeout plus `grace` since the
    first exit. A live process would have met a lost peer's error within the peer timeout."""
    if first_exit is None:
        return False
    return now > first_exit + peer_timeout + grace or (last_alone is not None and now > last_alone + grace)
