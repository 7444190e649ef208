"""Elastic state and its restarts, for any framework state: State, ObjectState and `run` (Horovod's
horovod/common/elastic.py). A commit, the agreement on a commit when a group starts, and leaving a group
with one's commits for the next (see tf_adasum/elastic.py for the whole design).

A process leaves its commits in a private file (private_files: mode 0600, in folders no other user can
write, written whole and made durable), sealed under the job's key; the next group's process checks the
seal before it unpickles a byte, so a file another user replaced is refused, never run.
"""

from __future__ import annotations

import functools
import os
import pickle
import sys
from collections.abc import Callable, Iterable
from typing import Any

import tensorflow as tf

from tf_adasum import _compat
from tf_adasum.algorithm import agreement
from tf_adasum.comm import engine
from tf_adasum.common import errors
from tf_adasum.common.errors import PeerError
from tf_adasum.launch.private_files import private_directory, read_private, write_private
from tf_adasum.launch.protocol import (
    ENV_RESUME_COPY,
    ENV_RESUME_FILE,
    ENV_STATE_FILE,
    RESTART_EXIT_CODE,
    fetch_state,
    generation,
    latest_notice,
    launched,
    watch_for_end,
)
from tf_adasum.launch.secret import ENV_SECRET, seal, unseal


def write_commits(path: str, commits: dict[int, Any], key: str) -> None:
    """Writes `commits` (commit number: snapshot) to `path`, private and sealed under the job's `key`."""
    private_directory(os.path.dirname(path), "the elastic state folder")
    write_private(path, seal(key, pickle.dumps(commits, protocol=pickle.HIGHEST_PROTOCOL)))


def read_commits(data: bytes, key: str, where: str) -> dict[int, Any]:
    """The commits that write_commits() sealed into `data` (read from `where`), once the seal checks.

    Raises:
        AuthenticationError: `data` was not sealed under `key`: it is not unpickled.
    """
    return dict(pickle.loads(unseal(key, data, f"the elastic commits {where}")))


class HostsUpdatedInterrupt(RuntimeError):
    """The launcher reported more slots: every rank leaves at the same commit, and the job grows."""


class State:
    """What a job commits and resumes from (Horovod's horovod.common.elastic.State).

    Subclasses say what a snapshot holds (`_snapshot`, `_apply`); this class keeps the last two
    commits, agrees on one when a group starts, and writes them when the process leaves.
    """

    def __init__(self) -> None:
        self._reset_callbacks: list[Callable[[], Any]] = []
        self._last_notice = 0
        self._commits = 0
        # (commit number, snapshot): the last commit, and the one before it.
        self._committed: tuple[int, Any] | None = None
        self._previous: tuple[int, Any] | None = None
        # Whether the last sync completed, and what it loaded (see sync and _leave).
        self._synced = True
        self._loaded: dict[int, Any] = {}

    # Horovod's API.

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], Any]]) -> None:
        """Functions to call when a new group starts after a reset (a worker lost or added), once this
        process has loaded its commit and before rank 0's state goes to new processes: Horovod's place
        to rescale the learning rate with hvd.size(). Under Adasum there is nothing to rescale."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Saves the state in host memory, then checks for new slots (raising HostsUpdatedInterrupt on
        every rank at once if the launcher reported some). The copy becomes the last commit only once
        every rank has reached this commit (the check is their meeting point): a peer lost during a
        commit leaves the one before it as the last, whole. A commit copies every variable from the
        device: commit every few batches rather than every one where steps are short."""
        pending = self._snapshot()
        try:
            self.check_host_updates()
        except HostsUpdatedInterrupt:
            self._promote(pending)
            raise
        self._promote(pending)

    def check_host_updates(self) -> None:
        """Raises HostsUpdatedInterrupt, on every rank at the same call, if the launcher reported more
        slots since the last check. Collective: every rank must call it."""
        comm = engine.init()
        mine = latest_notice() if comm.rank == 0 else 0
        if comm.size > 1:  # one collective, the commit's meeting: a max, so rank 0's notice (Horovod's TODO)
            mine = int(comm.allreduce(tf.constant([mine], tf.int64), "max")[0])
        if mine > self._last_notice:
            self._last_notice = mine
            raise HostsUpdatedInterrupt(f"the launcher reported more slots (notice {mine})")

    def save(self) -> None:
        """Copies the state to host memory as the last commit; the one before it is kept too."""
        self._promote(self._snapshot())

    def _promote(self, snapshot: Any) -> None:
        self._commits += 1
        self._previous, self._committed = self._committed, (self._commits, snapshot)

    def restore(self) -> None:
        """Undoes every change since the last commit."""
        if self._committed is not None:
            self._apply(self._committed[1])

    def sync(self) -> None:
        """Brings every process of a new group to one commit (collective).

        A survivor of the last group loads its own commit, the newest one that every survivor holds; a
        process with no state of its own takes rank 0's (at the job's start: every process but rank 0).
        Rank 0's Python attributes are broadcast to everyone, as Horovod does.
        """
        self._sync(reset=False)

    def _sync(self, reset: bool) -> None:
        """sync(); with `reset`, the reset callbacks run between loading this process's own commit and
        handing rank 0's state to the processes that have none (Horovod's order: restore, reset, sync),
        so that what they set (a learning rate: Keras keeps it among the optimizer's variables) holds."""
        comm = engine.init()
        if launched() and not comm.survives_lost_peers:
            raise ValueError(
                f"the elastic launcher runs TensorFlow's collective engine, and this process runs "
                f"{comm.engine!r} (TF_ADASUM_ENGINE={os.environ.get('TF_ADASUM_ENGINE')!r}): MPI cannot "
                "start a group again without ending every process (mpirun kills the survivors with the "
                "lost rank), so elastic jobs do not run on it"
            )
        commits = _load_resume_file() or {}
        held = sorted(commits)
        # Until this sync completes, leaving writes what was loaded (a process with nothing loaded writes
        # nothing): never this process's unsynced start, which would pass for a commit.
        self._synced = False
        self._loaded = commits
        every = agreement.gather_objects(comm, held, "elastic state sync") if comm.size > 1 else [held]
        holders = [r for r, h in enumerate(every) if h]
        target = min(every[r][-1] for r in holders) if holders else 0
        missing = [r for r in holders if target not in every[r]]
        if missing:
            raise RuntimeError(
                f"elastic sync: the survivors' newest common commit is {target}, and rank(s) {missing} "
                f"no longer hold it (they hold {[every[r] for r in missing]})"
            )
        if commits:
            self._apply(commits[target])
        if reset:
            self.on_reset()
        if comm.size > 1:
            root = holders[0] if holders else 0
            self._take_roots(root, need=[not h for h in every])
        self._commits = target
        self._previous = None
        self._committed = (target, self._snapshot())
        self._synced = True

    # What a subclass provides.

    def _snapshot(self) -> Any:
        raise NotImplementedError

    def _apply(self, snapshot: Any) -> None:
        raise NotImplementedError

    def _take_roots(self, root: int, need: list[bool]) -> None:
        """Collective: rank `root`'s state, for the ranks where `need` is true (all ranks call it)."""
        raise NotImplementedError

    # Leaving a group.

    def _leave(self, reason: str) -> None:
        """Writes the last two commits to this process's state file and exits for the next group."""
        path = os.environ.get(ENV_STATE_FILE)
        if self._synced:
            kept = dict(commit for commit in (self._previous, self._committed) if commit is not None)
        else:
            kept = dict(self._loaded)
        where = "no commit of its own"
        if path and kept:
            write_commits(path, kept, os.environ.get(ENV_SECRET, ""))
            where = f"commit(s) {sorted(kept)} in {path}"
        sys.stderr.write(
            f"tf_adasum.elastic: rank {engine.rank()} of group {generation()} leaves for the next group "
            f"({reason}); {where}\n"
        )
        sys.stdout.flush()
        sys.stderr.flush()
        # Not sys.exit: the collective runtime's threads may still wait on the lost peer.
        os._exit(RESTART_EXIT_CODE)


_watching = False


def _watch_group() -> None:
    """Under the launcher, once per process: when the launcher says this group ended (one of its processes
    exited), abort this process's collectives, as MultiWorkerMirroredStrategy's health check does. A
    survivor whose collective waits on a peer that lives but is itself leaving then fails at once with
    a lost-peer error; TensorFlow noticed only 3.2 s later, when the coordination service's leader was
    gone (issue 42)."""
    global _watching
    if _watching or not launched():
        return
    _watching = True

    def abort(reason: str) -> None:
        _compat.abort_collectives(f"the elastic launcher ended group {generation()}: {reason}")

    watch_for_end(abort)


def install_excepthook() -> None:
    """Under the elastic launcher: an uncaught lost-peer error outside `run` (in the script's start,
    before the sync) passes the commits this process resumed from on to the next group, and leaves for
    it; any other error is reported as usual."""
    previous = sys.excepthook

    def hook(kind: type[BaseException], error: BaseException, traceback: Any) -> None:
        if not isinstance(error, Exception) or not _lost_peer(error):
            previous(kind, error, traceback)
            return
        resume, path = os.environ.get(ENV_RESUME_FILE), os.environ.get(ENV_STATE_FILE)
        where = "no commit of its own"
        if resume and path and os.path.exists(resume):
            private_directory(os.path.dirname(path), "the elastic state folder")
            write_private(path, read_private(resume))  # sealed as they were
            where = f"its commits from {resume} in {path}"
        sys.stderr.write(
            f"tf_adasum.elastic: a process of group {generation()} lost a peer before its training "
            f"started ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}); "
            f"it leaves for the next group with {where}\n"
        )
        sys.stderr.flush()
        os._exit(RESTART_EXIT_CODE)

    sys.excepthook = hook


def _load_resume_file() -> dict[int, Any] | None:
    """This process's commits from the last group: its own file on this host, or, where this host has
    none (a new host, a lost disk), the launcher's copy of it."""
    path = os.environ.get(ENV_RESUME_FILE)
    if not path:
        return None
    key = os.environ.get(ENV_SECRET, "")
    if os.path.lexists(path):
        return read_commits(read_private(path), key, path)
    copy = fetch_state(os.environ.get(ENV_RESUME_COPY, "") or path)
    if copy is not None:
        sys.stderr.write(f"tf_adasum.elastic: no state file {path} here: resumed from the launcher's copy\n")
        return read_commits(copy, key, f"{path} (the launcher's copy)")
    sys.stderr.write(f"tf_adasum.elastic: no state file {path}: this process takes rank 0's state\n")
    return None


class ObjectState(State):
    """Python attributes committed and restored (Horovod's ObjectState): `ObjectState(epoch=0, batch=0)`
    exposes `state.epoch` and `state.batch`. Values must pickle."""

    def __init__(self, bcast_object: Callable[[Any], Any] | None = None, get_rank: Any = None, **kwargs: Any):
        self._names = list(kwargs)
        for name, value in kwargs.items():
            setattr(self, name, value)
        super().__init__()
        self._committed = (0, self._snapshot())

    def _objects(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self._names}

    def _snapshot(self) -> Any:
        return {"objects": self._objects()}

    def _apply(self, snapshot: Any) -> None:
        for name, value in snapshot["objects"].items():
            setattr(self, name, value)

    def _take_roots(self, root: int, need: list[bool]) -> None:
        comm = engine.init()
        mine = self._objects() if comm.rank == root else None
        for name, value in agreement.gather_objects(comm, mine, "elastic state objects")[root].items():
            setattr(self, name, value)


def _lost_peer(error: BaseException) -> bool:
    """Whether an error means a peer was lost (and the group must be started again)."""
    if isinstance(error, PeerError):
        return True
    if isinstance(error, tf.errors.OpError):
        translated = errors.translate(error, engine.current())
        # AbortedError: TensorFlow's coordination service gave up on a task (a heartbeat timeout, as
        # when a host stalls), and aborts the collectives of every other task.
        return isinstance(translated, PeerError) or isinstance(
            error, (*errors.LOST_PEER, tf.errors.AbortedError)
        )
    cause = error.__cause__ or error.__context__
    return cause is not None and cause is not error and _lost_peer(cause)


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorates the training function `func(state, ...)` (Horovod's hvd.elastic.run).

    The wrapper syncs the state (a new group's resume: see the module's doc), then calls func. Under the
    elastic launcher, a lost peer or new slots end this process for the next group, its last commits
    written; elsewhere they raise as usual. A group after the first calls the reset callbacks first.
    """

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        _watch_group()
        try:
            state._sync(reset=generation() > 0)
            return func(state, *args, **kwargs)
        except HostsUpdatedInterrupt as interrupt:
            if not launched():
                raise
            reason = str(interrupt)
        except Exception as error:
            if not (launched() and _lost_peer(error)):
                raise
            reason = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        state._leave(reason)
        raise AssertionError("unreachable")  # _leave exits

    return wrapper
