"""Watching a launch's processes until they end: the one loop both launchers run (static, and each group
of an elastic job). No TensorFlow here.

It polls every process; each exit is passed to `on_exit`. After the first non-zero exit, the others may
still end on their own (a dead peer's closed connections usually make tf_adasum raise PeerError in them
at once, naming it); `hung(now, first_exit, last_alone)` says when those still running count as hung,
and they are killed. The deadline kills everything; so does Ctrl-C. Killing a process kills its whole
session (every process starts in a session of its own, hosts.start).
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tf_adasum.launch.hosts import end_all

POLL_SECONDS = 0.05


@dataclass
class Ending:
    """How a launch's processes ended.

    Attributes:
        how: "ended" (every process exited), "hung" (those still running after a failure were killed),
            "timeout" (the deadline passed: every process was killed) or "interrupted" (Ctrl-C).
        codes: each process's returncode (Popen's: a signal's negative), in the processes' order.
        order: the processes' indices in the order they exited on their own.
        killed: the indices of the processes killed as hung.
    """

    how: str
    codes: list[int]
    order: list[int] = field(default_factory=list)
    killed: list[int] = field(default_factory=list)

    def first_failure(self) -> int | None:
        """The index of the first process to exit with a non-zero code, if any did."""
        return next((i for i in self.order if self.codes[i] != 0), None)


def supervise(
    processes: Sequence[subprocess.Popen[bytes]],
    deadline: float | None,
    hung: Callable[[float, float, float | None], bool],
    on_exit: Callable[[int, int], None] = lambda index, code: None,
    tick: Callable[[float, float | None], None] = lambda now, first_exit: None,
) -> Ending:
    """Watches `processes` (see the module's doc) until every one has exited or been killed.

    Args:
        processes: the launch's processes, each in a session of its own.
        deadline: time.monotonic() after which every process is killed; None: none.
        hung: (now, first non-zero exit, when only one was left running) -> whether those still running
            are killed as hung.
        on_exit: called with (index, returncode) as each process exits on its own.
        tick: called every poll with (now, the first non-zero exit's time or None).
    """
    codes: list[int | None] = [None] * len(processes)
    order: list[int] = []
    first_exit: float | None = None
    last_alone: float | None = None
    try:
        while True:
            now = time.monotonic()
            for i, process in enumerate(processes):
                if codes[i] is None and process.poll() is not None:
                    codes[i] = process.returncode
                    order.append(i)
                    if process.returncode != 0 and first_exit is None:
                        first_exit = now
                    on_exit(i, process.returncode)
            running = [i for i, code in enumerate(codes) if code is None]
            if not running:
                return Ending("ended", _known(codes), order)
            if first_exit is not None and len(running) == 1 and last_alone is None:
                last_alone = now
            if first_exit is not None and hung(now, first_exit, last_alone):
                return _kill("hung", processes, codes, order, running)
            if deadline is not None and now > deadline:
                return _kill("timeout", processes, codes, order, [])
            tick(now, first_exit)
            time.sleep(POLL_SECONDS)
    except KeyboardInterrupt:
        return _kill("interrupted", processes, codes, order, [])


def _kill(
    how: str,
    processes: Sequence[subprocess.Popen[bytes]],
    codes: list[int | None],
    order: list[int],
    killed: list[int],
) -> Ending:
    end_all(list(processes))
    return Ending(
        how, [p.returncode if c is None else c for p, c in zip(processes, codes, strict=True)], order, killed
    )


def _known(codes: list[int | None]) -> list[int]:
    return [c for c in codes if c is not None]
