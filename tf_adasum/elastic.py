"""Elastic training: Horovod's elastic API (`hvd.elastic`), on the restarts of `tf_adasum.run --elastic`.

Neither TensorFlow's collective runtime nor MPI can shrink or grow a running group, so a membership
change ends the group and the launcher starts a new one (torchrun's design):

- A process keeps its committed state in host memory: `state.commit()` copies the model's and the
  optimizer's variables (every replica's) and the state's Python attributes, and keeps the commit before
  it too.
- When a peer is lost (PeerError: it died, hangs past TF_ADASUM_TIMEOUT_SECONDS, or its link broke), or
  when the launcher reports more slots (checked in `commit()`, by rank 0, for every rank at once), every
  survivor writes its two commits to its own file and exits with RESTART_EXIT_CODE.
- The launcher starts the next group: the survivors first, in their old rank order, then new processes.
  Each runs the script from the top; `run` calls `state.sync()`, which resumes: the survivors agree on
  the newest commit they all hold (a peer lost during a commit can leave one survivor a commit ahead:
  it goes back one), each survivor loads its own copy of it, and a process with no state of its own
  (new, or every process at the job's start) takes rank 0's. Under Adasum that keeps each survivor's
  own optimizer state; the learning rate is not touched (a reset callback may; Horovod's guide rescales
  it there for the average).
- What is lost: the steps since the last commit.

Outside the elastic launcher the same API works in one group that does not change: `run` syncs and
calls the function, and a lost peer raises PeerError as anywhere else.
"""

from __future__ import annotations

import functools
import os
import pickle
import shutil
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tf_adasum import agreement, distributed, engine, errors
from tf_adasum.elastic_launcher import RESTART_EXIT_CODE
from tf_adasum.errors import PeerError
from tf_adasum.variables import replica_values, variable_name

__all__ = [
    "RESTART_EXIT_CODE",
    "CommitStateCallback",
    "HostsUpdatedInterrupt",
    "KerasState",
    "ObjectState",
    "State",
    "TensorFlowKerasState",
    "TensorFlowState",
    "UpdateBatchStateCallback",
    "UpdateEpochStateCallback",
    "run",
]


# What the elastic launcher tells each process.
ENV_ELASTIC = "TF_ADASUM_ELASTIC"  # "1" under the elastic launcher
ENV_GENERATION = "TF_ADASUM_ELASTIC_GENERATION"  # 0, 1, ...: the group's number
ENV_STATE_FILE = "TF_ADASUM_ELASTIC_STATE_FILE"  # where this process writes its commits when it leaves
ENV_RESUME_FILE = "TF_ADASUM_ELASTIC_RESUME_FILE"  # a survivor's commits from the last group ("" if none)
ENV_DRIVER = "TF_ADASUM_ELASTIC_DRIVER"  # host:port of the launcher's slot notices

# How often rank 0 asks the launcher whether slots were added.
POLL_SECONDS = 1.0


class HostsUpdatedInterrupt(RuntimeError):
    """The launcher reported more slots: every rank leaves at the same commit, and the job grows."""


def launched() -> bool:
    """Whether `python -m tf_adasum.run --elastic` started this process."""
    return os.environ.get(ENV_ELASTIC) == "1"


def generation() -> int:
    """This group's number under the elastic launcher: 0 for the first, one more at every reset."""
    return int(os.environ.get(ENV_GENERATION, "0"))


class _SlotNotices:
    """Rank 0's view of the launcher's notices: a thread asks every POLL_SECONDS, so that a commit
    reads the latest answer without waiting on the network."""

    def __init__(self, address: str, group: int) -> None:
        self.latest = 0
        self._url = f"http://{address}/updates?generation={group}"
        threading.Thread(target=self._poll, daemon=True, name="tf_adasum-elastic-notices").start()

    def _poll(self) -> None:
        while True:
            try:
                with urllib.request.urlopen(self._url, timeout=5) as answer:
                    self.latest = max(self.latest, int(answer.read().decode() or 0))
            except (OSError, ValueError):
                pass  # the launcher is gone or busy: the next poll asks again
            time.sleep(POLL_SECONDS)


_notices: _SlotNotices | None = None


def _latest_notice() -> int:
    global _notices
    address = os.environ.get(ENV_DRIVER)
    if not address:
        return 0
    if _notices is None:
        _notices = _SlotNotices(address, generation())
    return _notices.latest


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
        mine = _latest_notice() if comm.rank == 0 else 0
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
        if launched() and comm.engine != "tf":
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
            os.makedirs(os.path.dirname(path), exist_ok=True)
            partial = f"{path}.partial"
            with open(partial, "wb") as f:
                pickle.dump(kept, f, protocol=pickle.HIGHEST_PROTOCOL)
            os.replace(partial, path)  # whole or absent: a kill while writing leaves the last file
            where = f"commit(s) {sorted(kept)} in {path}"
        sys.stderr.write(
            f"tf_adasum.elastic: rank {engine.rank()} of group {generation()} leaves for the next group "
            f"({reason}); {where}\n"
        )
        sys.stdout.flush()
        sys.stderr.flush()
        # Not sys.exit: the collective runtime's threads may still wait on the lost peer.
        os._exit(RESTART_EXIT_CODE)


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
            os.makedirs(os.path.dirname(path), exist_ok=True)
            shutil.copyfile(resume, f"{path}.partial")
            os.replace(f"{path}.partial", path)
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
    path = os.environ.get(ENV_RESUME_FILE)
    if not path:
        return None
    if not os.path.exists(path):
        sys.stderr.write(f"tf_adasum.elastic: no state file {path}: this process takes rank 0's state\n")
        return None
    with open(path, "rb") as f:
        return pickle.load(f)


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


def _values(variables: list[Any]) -> list[list[np.ndarray]]:
    """Every replica's value of every variable, on the host."""
    return [[np.array(part) for part in replica_values(v)] for v in variables]


def _assign(variables: list[Any], values: list[list[np.ndarray]], what: str) -> None:
    if len(values) != len(variables):
        raise ValueError(f"elastic state: {what} has {len(variables)} variables, the commit {len(values)}")
    for variable, parts in zip(variables, values, strict=True):
        replicas = replica_values(variable)
        if len(parts) != len(replicas):  # another process's replicas: each of mine takes the first
            parts = [parts[0]] * len(replicas)
        for replica, value in zip(replicas, parts, strict=True):
            if tuple(replica.shape) != value.shape:
                raise ValueError(
                    f"elastic state: {what} variable {variable_name(variable)} has shape "
                    f"{tuple(replica.shape)}, the commit {value.shape}"
                )
            replica.assign(value)


class TensorFlowState(ObjectState):
    """A list of TensorFlow variables and Python attributes (Horovod's TensorFlowState)."""

    def __init__(self, variables: list[Any] | None = None, session: Any = None, **kwargs: Any) -> None:
        if session is not None:
            raise ValueError("TensorFlowState(session=...) is TensorFlow 1's; TensorFlow 2 has no sessions")
        if variables is None:
            raise ValueError("TensorFlowState needs its variables: TensorFlow 2 has no global variables")
        self.variables = list(variables)
        super().__init__(**kwargs)

    def _own_variables(self) -> list[tuple[str, list[Any]]]:
        return [("variables", self.variables)]

    def _snapshot(self) -> Any:
        snapshot = super()._snapshot()
        for key, variables in self._own_variables():
            snapshot[key] = _values(variables)
        return snapshot

    def _apply(self, snapshot: Any) -> None:
        super()._apply(snapshot)
        for key, variables in self._own_variables():
            _assign(variables, snapshot[key], key)

    def _take_roots(self, root: int, need: list[bool]) -> None:
        super()._take_roots(root, need)
        if not any(need):  # every process resumes its own
            return
        variables = [v for _, vs in self._own_variables() for v in vs]
        if not variables:
            return
        roots = distributed.broadcast(
            [tf.convert_to_tensor(replica_values(v)[0]) for v in variables], root=root
        )
        if need[engine.rank()]:
            for variable, value in zip(variables, roots, strict=True):
                for replica in replica_values(variable):
                    replica.assign(value)


def _model_and_optimizer_built(model: keras.Model, optimizer: Any) -> None:
    if not model.built:
        raise ValueError(
            "elastic state: the model must be built first (call it, or model.build(input_shape))"
        )
    if optimizer is not None and not optimizer.built:
        strategy = getattr(model, "distribute_strategy", None) or tf.distribute.get_strategy()
        with strategy.scope():
            optimizer.build(model.trainable_variables)


class TensorFlowKerasState(TensorFlowState):
    """A Keras model, its optimizer (every replica's state), and Python attributes (Horovod's
    TensorFlowKerasState; KerasState is the same). An optimizer not built yet is built here, so that
    every process has state to commit."""

    def __init__(self, model: keras.Model, optimizer: Any = None, backend: Any = None, **kwargs: Any) -> None:
        self.model = model
        _model_and_optimizer_built(model, None)
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        _model_and_optimizer_built(model, self.optimizer)
        super().__init__(variables=[], **kwargs)

    def _own_variables(self) -> list[tuple[str, list[Any]]]:
        optimizer = list(self.optimizer.variables) if self.optimizer is not None else []
        return [("model", list(self.model.variables)), ("optimizer", optimizer)]


KerasState = TensorFlowKerasState


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


class CommitStateCallback(keras.callbacks.Callback):
    """Commits the state every `batches_per_commit` batches and at every epoch's end (Horovod's).

    Put it after UpdateEpochStateCallback and UpdateBatchStateCallback, so a commit holds their counts.
    """

    def __init__(self, state: State, batches_per_commit: int = 1) -> None:
        super().__init__()
        if batches_per_commit < 1:
            raise ValueError(
                f"CommitStateCallback: batches_per_commit must be at least 1, got {batches_per_commit}"
            )
        self.state = state
        self.batches_per_commit = batches_per_commit
        self._remaining = batches_per_commit

    def on_train_begin(self, logs: Any = None) -> None:
        self._remaining = self.batches_per_commit

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self._remaining -= 1
        if self._remaining == 0:
            self.state.commit()
            self._remaining = self.batches_per_commit

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.state.commit()


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keeps `state.batch`, the number of batches of the current epoch done, and resumes there.

    A group that resumes at batch b > 0 of an epoch reads and drops the first b batches of that epoch
    (every process the same count, each its own share) and trains from batch b, so the epoch ends
    where it would have without the reset. Horovod's callback shortens the epoch instead, and its
    state.batch is the last batch's index, one less than here.
    """

    def __init__(self, state: State) -> None:
        super().__init__()
        self.state: Any = state  # an ObjectState with a `batch` attribute
        self._resume_at = 0

    def on_train_begin(self, logs: Any = None) -> None:
        self._resume_at = int(self.state.batch)

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        if self._resume_at > 0:
            _skip_batches(self.model, self._resume_at)
            self._resume_at = 0

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self.state.batch = batch + 1

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.state.batch = 0


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Keeps `state.epoch`, the number of epochs done over every group (Horovod's).

    Works with fit(..., initial_epoch=state.epoch) and with Horovod's fit(..., epochs=E - state.epoch):
    the offset is taken from the first epoch Keras reports.
    """

    def __init__(self, state: State) -> None:
        super().__init__()
        self.state: Any = state  # an ObjectState with an `epoch` attribute
        self._offset: int | None = None

    def on_train_begin(self, logs: Any = None) -> None:
        self._offset = None

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        if self._offset is None:
            self._offset = int(self.state.epoch) - epoch

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.state.epoch = (self._offset or 0) + epoch + 1


def _skip_batches(model: keras.Model, count: int) -> None:
    """The next `count` batches of fit are read and dropped: model.train_function consumes them
    without a step (steps_per_execution batches per call), then is Keras's again."""
    train_function = model.train_function
    per_call = int(getattr(model, "steps_per_execution", 1) or 1)
    left = [count]

    def skipping(iterator: Any) -> Any:
        if left[0] <= 0:
            model.train_function = train_function
            return train_function(iterator)
        for _ in range(min(per_call, left[0])):
            next(iterator)
        left[0] -= per_call
        if left[0] <= 0:
            model.train_function = train_function
        return {}

    model.train_function = skipping
