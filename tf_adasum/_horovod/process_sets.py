"""Horovod's process sets (horovod/common/process_sets.py): only global_process_set, every rank."""

from __future__ import annotations

from typing import Any

from tf_adasum.comm import engine


class ProcessSet:
    """Horovod's process sets (collectives over a subset of the ranks): not supported by tf_adasum, except
    global_process_set, every rank, which is what tf_adasum's collectives always use."""

    def __init__(self, ranks_or_comm: Any) -> None:
        raise NotImplementedError(
            "hvd.ProcessSet is not supported by tf_adasum: every collective runs over all processes "
            "(global_process_set). Start a separate job for a subset of the workers"
        )


class _GlobalProcessSet:
    """hvd.global_process_set: every rank. Accepted wherever Horovod takes process_set=."""

    def __repr__(self) -> str:
        return "global_process_set"

    @property
    def ranks(self) -> list[int]:
        return list(range(engine.size()))

    def size(self) -> int:
        return engine.size()

    def rank(self) -> int:
        return engine.rank()

    def included(self) -> bool:
        return True


global_process_set = _GlobalProcessSet()


def add_process_set(process_set: Any) -> None:
    """Not supported: every collective runs over all processes."""
    ProcessSet(process_set)


def remove_process_set(process_set: Any) -> None:
    """Not supported: every collective runs over all processes."""
    ProcessSet(process_set)
