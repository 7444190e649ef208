"""Elastic state of TensorFlow variables and Keras models, and the Keras callbacks that commit it
(Horovod's horovod/tensorflow/elastic.py and horovod/_keras/elastic.py): every replica's value of every
variable is committed, so a survivor keeps its own optimizer state.
"""

from __future__ import annotations

import weakref
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tf_adasum import _compat, distributed
from tf_adasum.callbacks.base import Callback
from tf_adasum.comm import engine
from tf_adasum.common.variables import replica_values, variable_name
from tf_adasum.elastic.state import ObjectState, State


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
        own = self._own_variables()
        # A commit of a state with other parts (an outer optimizer's) would lose one or leave it unset.
        theirs, mine = sorted(set(snapshot) - {"objects"}), sorted(key for key, _ in own)
        if theirs != mine:
            raise ValueError(
                f"elastic state: this state holds the variables of {mine}, the commit those of {theirs}: "
                "resume a commit with a state made as the one that wrote it (an outer optimizer given "
                "to both, or to neither)"
            )
        super()._apply(snapshot)
        for key, variables in own:
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
    if optimizer is not None:
        strategy = getattr(model, "distribute_strategy", None) or tf.distribute.get_strategy()
        with strategy.scope():
            _compat.build_optimizer(optimizer, model.trainable_variables)  # Keras 3's or tf_keras's


def _hung_outer(model: keras.Model, optimizer: Any, outer: Any) -> Any:
    """KerasState's `outer_optimizer`, built on the model's trainable variables and hung on its optimizer
    as AdasumCallback hangs it, and pinned there; None for none."""
    if outer is None:
        return None
    if optimizer is None:
        raise ValueError("elastic state: an outer_optimizer needs the model's optimizer: compile it first")
    stepping = _compat.loss_scale_inner(optimizer)
    horovod = hasattr(stepping, "_tf_adasum_op")  # tf_keras's is a subclass named as the class it wraps
    wrapper = "DistributedOptimizer" if horovod else type(stepping).__name__
    strategy = model.distribute_strategy is not tf.distribute.get_strategy() or tf.distribute.has_strategy()
    if horovod or getattr(type(stepping), "_tf_adasum_syncs", False) or strategy:
        raise ValueError(
            "elastic state: the outer_optimizer here is AdasumCallback's; under a strategy, or with a "
            f"tf_adasum optimizer that syncs itself (here {wrapper}), the model's optimizer steps the outer "
            "optimizer it was given, if any (AdasumStrategy(outer_optimizer=...), AdasumOptimizer(..., "
            "outer_optimizer=...)), and carries its state in every commit: make the state without "
            "outer_optimizer"
        )
    _compat.hang_outer(optimizer, outer, list(model.trainable_variables), pin=True)
    return outer


class TensorFlowKerasState(TensorFlowState):
    """A Keras model, its optimizer (every replica's state), and Python attributes (Horovod's
    TensorFlowKerasState; KerasState is the same). An optimizer not built yet is built here, so that
    every process has state to commit. A tf_keras (Keras 2) model and optimizer are served alike: one
    process per worker, as the Horovod face serves them.

    `outer_optimizer` is the outer optimizer of an `AdasumCallback(sync_every=..., outer_optimizer=...)`
    the fits of the job use, the same object: the state builds it and hangs it on the model's optimizer
    at once, so that every process, a new one too, commits and takes its state from the first sync. (An
    `AdasumStrategy`'s optimizer carries its own outer optimizer, with no keyword here.)
    """

    def __init__(
        self,
        model: keras.Model,
        optimizer: Any = None,
        backend: Any = None,
        outer_optimizer: Any = None,
        **kwargs: Any,
    ) -> None:
        self.model = model
        _model_and_optimizer_built(model, None)
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        _model_and_optimizer_built(model, self.optimizer)
        self.outer_optimizer = _hung_outer(model, self.optimizer, outer_optimizer)
        super().__init__(variables=[], **kwargs)

    def _own_variables(self) -> list[tuple[str, list[Any]]]:
        optimizer = _compat.optimizer_variables(self.optimizer) if self.optimizer is not None else []
        own = [("model", list(self.model.variables)), ("optimizer", optimizer)]
        outer = self.outer_optimizer
        stepping = _compat.loss_scale_inner(self.optimizer)
        attached: Any = _compat.attached_outer(stepping) if stepping is not None else None
        if attached is not outer:  # the state's own is pinned there (hang_outer): this is a callback's
            # AdasumCallback hangs its outer optimizer on the model's optimizer only once fit starts,
            # after a new process has taken root's state: the state must hold it from the start.
            raise ValueError(
                "an elastic state cannot commit AdasumCallback's outer optimizer "
                f"{_compat.optimizer_name(attached)!r} ({type(attached).__name__}) that it was not "
                "given: make the state with it, elastic.KerasState(model, outer_optimizer=outer, ...), "
                "the same optimizer as AdasumCallback(outer_optimizer=outer)'s"
            )
        if outer is not None:
            own.append(("outer", _compat.optimizer_variables(outer)))
        return own

    def _sync(self, reset: bool) -> None:
        super()._sync(reset)
        # Every process now holds root's trainable weights: a new one took them, and a survivor loaded
        # its own of the same commit, which Adasum kept bit for bit the same on every rank. The broadcast
        # that an AdasumOptimizer makes before its first step would send the whole model again. (Asked
        # by name: the optimizer's module stands above this one.)
        agreed = getattr(_compat.loss_scale_inner(self.optimizer), "weights_agreed", None)
        if agreed is not None:
            agreed()


KerasState = TensorFlowKerasState


def _outer_stepped(state: State) -> None:
    """Refuses, before a fit's first step, a fit that would commit a KerasState's outer optimizer without
    stepping it: only AdasumCallback(outer_optimizer=...) steps it, and this fit has none."""
    if not isinstance(state, TensorFlowKerasState):
        return
    outer = state.outer_optimizer
    if outer is not None and not _compat.stepped_by_callback(state.optimizer):
        name = _compat.optimizer_name(outer)
        raise ValueError(
            f"elastic state: it holds AdasumCallback's outer optimizer {name!r}, and this fit has no "
            "AdasumCallback to step it: add AdasumCallback(sync_every=..., outer_optimizer="
            "state.outer_optimizer) to fit's callbacks, or make the state without outer_optimizer"
        )


class CommitStateCallback(Callback):
    """Commits the state every `batches_per_commit` batches and at every epoch's end (Horovod's).

    Put it after UpdateEpochStateCallback and UpdateBatchStateCallback, so a commit holds their counts.
    """

    serves_keras_2 = True  # batch and epoch hooks only, alike in tf_keras's fit

    def __init__(self, state: State, batches_per_commit: int = 1) -> None:
        super().__init__()
        if batches_per_commit < 1:
            raise ValueError(
                f"CommitStateCallback: batches_per_commit must be at least 1, got {batches_per_commit}"
            )
        self.state = state
        self.batches_per_commit = batches_per_commit
        self._remaining = batches_per_commit
        self._checked = False

    def on_train_begin(self, logs: Any = None) -> None:
        self._remaining = self.batches_per_commit
        self._checked = False

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        if not self._checked:  # after every callback's on_train_begin, AdasumCallback's too
            self._checked = True
            _outer_stepped(self.state)

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if _SKIPPED.get(self.model, False):  # a batch a resume drops is no step: nothing to commit
            return
        self._remaining -= 1
        if self._remaining == 0:
            self.state.commit()
            self._remaining = self.batches_per_commit

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.state.commit()


class UpdateBatchStateCallback(Callback):
    """Keeps `state.batch`, the number of batches of the current epoch done, and resumes there.

    A group that resumes at batch b > 0 of an epoch reads and drops the first b batches of that epoch
    (every process the same count, each its own share) and trains from batch b, so the epoch ends
    where it would have without the reset. Horovod's callback shortens the epoch instead, and its
    state.batch is the last batch's index, one less than here.
    """

    serves_keras_2 = True  # batch and epoch hooks only, alike in tf_keras's fit

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

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        _SKIPPED[self.model] = False  # the train function says otherwise for a batch it drops

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if not _SKIPPED.get(self.model, False):  # a dropped batch leaves the count at the resume's
            self.state.batch = batch + 1

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.state.batch = 0


class UpdateEpochStateCallback(Callback):
    """Keeps `state.epoch`, the number of epochs done over every group (Horovod's).

    Works with fit(..., initial_epoch=state.epoch) and with Horovod's fit(..., epochs=E - state.epoch):
    the offset is taken from the first epoch Keras reports.
    """

    serves_keras_2 = True  # batch and epoch hooks only, alike in tf_keras's fit

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


# Whether the model's last train-function call dropped its batches (a resume's skip): Keras calls the
# batch callbacks for those calls too, and they must neither count nor commit them. Set for each batch
# by UpdateBatchStateCallback.on_train_batch_begin and the skipping train function.
_SKIPPED: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def _skip_batches(model: keras.Model, count: int) -> None:
    """The next `count` batches of fit are read and dropped: model.train_function consumes them
    without a step (steps_per_execution batches per call), then is Keras's again."""
    train_function = model.train_function
    # Keras 3's steps_per_execution; tf_keras keeps it in a variable.
    per_call = int(
        getattr(model, "steps_per_execution", None) or getattr(model, "_steps_per_execution", 1) or 1
    )
    left = [count]

    def skipping(iterator: Any) -> Any:
        if left[0] <= 0:
            model.train_function = train_function
            return train_function(iterator)
        for _ in range(min(per_call, left[0])):
            next(iterator)
        _SKIPPED[model] = True
        left[0] -= per_call
        if left[0] <= 0:
            model.train_function = train_function
        return {}

    model.train_function = skipping
