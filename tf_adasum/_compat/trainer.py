"""Hooks into Keras's TensorFlow trainer.

`train_step / test_step`
    TensorFlowTrainer's make_train_function / make_test_function, which pass the model's bound
    train_step / test_step to strategy.run. tf_adasum wraps the functions they build (to translate its
    errors, and to know a Keras step is running) and recognises the bound steps, to average logs and
    BatchNorm statistics across processes. An unrecognised step inside a Keras train or test function
    raises HookError.
`epoch iterators`
    TFEpochIterator._get_iterator, through which fit, evaluate and predict make their data iterators:
    tf_adasum frees those iterators on a thread of its own (install_iterator_release).
`_maybe_symbolic_build`
    TensorFlowTrainer's build of the model on one batch before fit, evaluate and predict. Where a
    process holds several replicas it reduces that batch through strategy.reduce, for its shapes only; a
    process with one replica has no per-replica batch and calls nothing. tf_adasum marks the build
    (in_symbolic_build), so that AdasumStrategy.reduce stays inside the process there: a reduce across
    processes would meet nothing on the one-replica process (install_symbolic_build_mark).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import keras

from tf_adasum._compat.registry import hook_problem, mark, original, register, replaced, uses


def _trainer() -> Any:
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

    return TensorFlowTrainer


@register("train_step / test_step", "logs and BatchNorm statistics would not be averaged across processes")
def _check_steps() -> str | None:
    trainer = _trainer()
    for maker, step in (("make_train_function", "train_step"), ("make_test_function", "test_step")):
        function = getattr(trainer, maker, None)
        if function is None:
            return f"TensorFlowTrainer has no {maker}"
        if not uses(original(function), step):
            return f"TensorFlowTrainer.{maker} no longer runs the model's {step}"
    return None


@register(
    "_maybe_symbolic_build",
    "a process with one replica beside processes with several fails at fit's first batch",
    required=False,
)
def _check_symbolic_build() -> str | None:
    build = getattr(_trainer(), "_maybe_symbolic_build", None)
    if build is None:
        return "TensorFlowTrainer has no _maybe_symbolic_build"
    if not uses(original(build), "reduce"):
        return "TensorFlowTrainer._maybe_symbolic_build no longer reduces its batch through the strategy"
    return None


# --- train_step / test_step -------------------------------------------------------------------------

_running = threading.local()


def keras_step(fn: Any) -> tuple[Any, str] | None:
    """(model, "train" or "test") when fn is a model's bound train_step or test_step, else None."""
    fn = getattr(fn, "python_function", fn)
    model = getattr(fn, "__self__", None)
    if isinstance(model, keras.Model) and getattr(fn, "__name__", None) in ("train_step", "test_step"):
        return model, fn.__name__[: -len("_step")]
    return None


def keras_function_running() -> str | None:
    """ "train" or "test" while a Keras train or test function runs (and is traced) on this thread."""
    return getattr(_running, "kind", None)


@contextlib.contextmanager
def _running_keras_function(kind: str) -> Iterator[None]:
    outer = keras_function_running()
    _running.kind = kind
    try:
        yield
    finally:
        _running.kind = outer


def install_step_hooks(
    translate_errors: Callable[[Any], Any],
    before_train_function: Callable[[Any], None],
    around_train_function: Callable[[Any], contextlib.AbstractContextManager[Any]] | None = None,
) -> None:
    """Wraps the functions Keras's make_train_function / make_test_function build, once per process.

    Args:
        translate_errors: wraps a train or test function so that tf_adasum's errors raised inside a
            compiled step reach the caller as tf_adasum.PeerError, NonFiniteUpdateError or
            UnevenDataError, naming the rank (instead of tf.errors.UnknownError).
        before_train_function: called with the model before Keras makes its train function (tf_adasum
            turns XLA off there for a model whose optimizer syncs).
        around_train_function: with the model, a context the train function runs (and is traced) in
            (tf_adasum switches Keras's loss scaling off there for a model that runs Adasum).

    The wrapped function also marks the thread as running a Keras step, so that AdasumStrategy.run
    can tell an unrecognised step from a user's own function.
    """
    if hook_problem("train_step / test_step") is not None:
        return
    trainer = _trainer()
    for maker, attribute, kind in (
        ("make_train_function", "train_function", "train"),
        ("make_test_function", "test_function", "test"),
    ):
        before = getattr(trainer, maker)
        if replaced(before):
            continue
        made = _step_maker(
            before, attribute, kind, translate_errors, before_train_function, around_train_function
        )
        setattr(trainer, maker, mark(made, before))


def _step_maker(
    maker: Any,
    attribute: str,
    kind: str,
    translate_errors: Callable[[Any], Any],
    before_train_function: Callable[[Any], None],
    around_train_function: Callable[[Any], contextlib.AbstractContextManager[Any]] | None,
) -> Any:
    """make_train_function or make_test_function, wrapped: see install_step_hooks."""

    @functools.wraps(maker)
    def make(self: Any, force: bool = False) -> Any:
        if kind == "train":
            before_train_function(self)
        maker(self, force)
        function = getattr(self, attribute, None)
        if function is not None and not replaced(function):
            translated = translate_errors(function)

            model = self

            @functools.wraps(function)
            def run(*args: Any, **kwargs: Any) -> Any:
                around = around_train_function if kind == "train" and around_train_function else None
                with _running_keras_function(kind), around(model) if around else contextlib.nullcontext():
                    return translated(*args, **kwargs)

            setattr(self, attribute, mark(run, function))
        return getattr(self, attribute)

    return make


# --- _maybe_symbolic_build ------------------------------------------------------------------------

_building = threading.local()


def in_symbolic_build() -> bool:
    """Whether Keras is building a model on one batch (before fit, evaluate, predict) on this thread."""
    return getattr(_building, "active", False)


def install_symbolic_build_mark() -> None:
    """Marks TensorFlowTrainer._maybe_symbolic_build's run (in_symbolic_build), once per process."""
    if hook_problem("_maybe_symbolic_build") is not None:
        return
    trainer = _trainer()
    before = trainer._maybe_symbolic_build
    if replaced(before):
        return

    @functools.wraps(before)
    def build(self: Any, *args: Any, **kwargs: Any) -> Any:
        outer = in_symbolic_build()
        _building.active = True
        try:
            return before(self, *args, **kwargs)
        finally:
            _building.active = outer

    trainer._maybe_symbolic_build = mark(build, before)


# --- epoch iterators ------------------------------------------------------------------------------


def _epoch_iterator() -> Any:
    from keras.src.backend.tensorflow.trainer import TFEpochIterator

    return TFEpochIterator


@register(
    "epoch iterators",
    "fit, evaluate and predict can return late: their data iterators are freed on the calling thread",
    required=False,
)
def _check_epoch_iterators() -> str | None:
    from keras.src.trainers.epoch_iterator import EpochIterator

    iterator = _epoch_iterator()
    if not callable(getattr(iterator, "_get_iterator", None)):
        return "TFEpochIterator has no _get_iterator"
    if not uses(EpochIterator._enumerate_iterator, "_get_iterator"):
        return "EpochIterator no longer makes its iterators through _get_iterator"
    return None


# Objects a forked child inherited from its parent's graveyard: never freed in the child.
_FROM_THE_PARENT: list[Any] = []


class _Graveyard:
    """Frees objects on a thread of its own, `delay` seconds after they are handed over: a tf.data
    iterator's destructor waits for its threads (tf.data's autotuning thread can take up to its
    optimisation period, seconds to a minute on a busy host), and the thread that drops the last
    reference pays for it."""

    def __init__(self) -> None:
        self._reset()
        # A process forked from this one (a warm process of the elastic launcher's fork server, a test's
        # child) has none of its parent's threads: it starts its own, at its first handover. Not at the
        # fork: a thread started in the child of a process with TensorFlow's threads can crash it
        # (SIGSEGV in a child that only changed its user and checked a file).
        os.register_at_fork(after_in_child=self._forked)
        # Before the interpreter ends: a daemon thread still inside a destructor then is cut off in
        # TensorFlow's C++ ("FATAL: exception not rethrown", the process aborts at exit).
        atexit.register(self._stop)

    def _forked(self) -> None:
        # What the parent handed over stays unfreed here: an iterator's destructor waits for threads
        # that only the parent has, and would hang the child.
        _FROM_THE_PARENT.append(self._buried)
        self._reset()

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._buried: list[tuple[float, list[Any]]] = []
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None

    def _stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
        with self._lock:
            self._buried.clear()  # what is left is freed here, on the exiting thread

    # How many handovers may wait at once. Past it the caller frees what it hands over itself, as it would
    # without the graveyard: one thread frees more slowly than a loop of short fits (or short epochs)
    # makes iterators, and a 3-process loop of 0.6 s fits held 50 handovers and 4,800 threads after 280
    # fits, and its exit then freed them all for minutes.
    MAX_WAITING = 8

    def bury(self, objects: list[Any], delay: float) -> bool:
        """Takes `objects` to free `delay` s from now; False (not taken: the caller's references are the
        last) when MAX_WAITING handovers already wait."""
        if not objects:
            return True
        with self._lock:
            if len(self._buried) >= self.MAX_WAITING:
                return False
            self._buried.append((time.monotonic() + delay, objects))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, daemon=True, name="tf_adasum-iterator-release"
                )
                self._thread.start()
        self._wake.set()
        return True

    def _run(self) -> None:
        while not self._stopping:
            self._wake.wait(1.0)
            self._wake.clear()
            now = time.monotonic()
            with self._lock:
                due = [objects for when, objects in self._buried if when <= now]
                self._buried = [(when, objects) for when, objects in self._buried if when > now]
            del due  # here, off the training thread, each iterator's destructor runs


_graveyard: _Graveyard | None = None


class _ReleasedLater:
    """A dataset whose iterators are freed on the graveyard's thread, not on the thread that made them."""

    def __init__(self, dataset: Any, owner: Any) -> None:
        self.dataset, self.owner = dataset, owner

    def __iter__(self) -> Any:
        iterator = iter(self.dataset)
        held = self.owner.__dict__
        # The last epoch's iterator: its owner drops it a moment from now, when it takes this one.
        assert _graveyard is not None
        _graveyard.bury(held.get("_tf_adasum_iterators", []), delay=5.0)
        held["_tf_adasum_iterators"] = [iterator]
        return iterator

    def __getattr__(self, name: str) -> Any:
        return getattr(self.dataset, name)


def install_iterator_release() -> None:
    """Makes Keras's fit, evaluate and predict free their data iterators on a thread of their own
    (_Graveyard), once per process: on a busy host their destructors took 1-40 s on the calling thread,
    after fit's last batch, while the other ranks of a job waited in the next collective."""
    global _graveyard
    if hook_problem("epoch iterators") is not None:
        return
    iterator = _epoch_iterator()
    before = iterator._get_iterator
    if replaced(before):
        return
    _graveyard = _Graveyard()

    @functools.wraps(before)
    def _get_iterator(self: Any) -> Any:
        return _ReleasedLater(before(self), self)

    def __del__(self: Any) -> None:
        # The epoch iterator goes (at fit's end): its data iterator goes on the graveyard's thread.
        if _graveyard is not None:
            _graveyard.bury(self.__dict__.pop("_tf_adasum_iterators", []), delay=1.0)

    iterator._get_iterator = mark(_get_iterator, before)
    iterator.__del__ = __del__
