"""Horovod's functions on variables and Python objects (horovod/tensorflow/functions.py): the variables'
broadcast, and the object collectives, eager only as Horovod's in TensorFlow 2."""

from __future__ import annotations

import functools
import pickle
from collections.abc import Callable
from typing import Any

import tensorflow as tf

from tf_adasum._horovod.arguments import unsupported
from tf_adasum.algorithm import agreement
from tf_adasum.comm import engine
from tf_adasum.training import keras_consensus


def broadcast_variables(
    variables: Any, root_rank: int, process_set: Any = None, inplace: bool = False
) -> None:
    """Assigns rank `root_rank`'s values to `variables` (Keras or TensorFlow) on every process."""
    unsupported("broadcast_variables", process_set=(process_set, None))
    keras_consensus.broadcast_variables(list(variables), root_rank)


def _check_root(where: str, root_rank: int, size: int) -> None:
    if not 0 <= root_rank < size:
        raise ValueError(f"{where}: root_rank {root_rank} is not a rank of this job of {size} processes")


def _eagerly(where: str) -> None:
    if not tf.executing_eagerly():
        raise RuntimeError(
            f"{where} exchanges Python objects, so it runs eagerly only (as Horovod's does in TensorFlow "
            "2): call it outside tf.function"
        )


def _pickled(obj: Any) -> tuple[bytes | None, str | None]:
    """(pickle of obj, None), or (None, why it cannot be pickled): sent either way, so that every rank
    raises instead of waiting for a rank that could not send."""
    try:
        return pickle.dumps(obj), None
    except Exception as error:  # pickling raises PicklingError, TypeError, AttributeError, ...
        return None, f"{type(error).__name__}: {error}"


def broadcast_object(
    obj: Any, root_rank: int = 0, session: Any = None, name: str | None = None, process_set: Any = None
) -> Any:
    """Rank `root_rank`'s picklable object, on every process (eagerly only, as Horovod's in TF2).

    Root gets its own object back; the others an unpickled copy. Objects travel pickled (Horovod uses
    cloudpickle, which also takes lambdas and classes defined in functions).

    Raises:
        TypeError: on every rank, when root's object cannot be pickled.
        ValueError: root_rank is not a rank.
        RuntimeError: called inside tf.function; or the ranks named different roots.
    """
    where = "broadcast_object"
    unsupported(where, session=(session, None), process_set=(process_set, None))
    _eagerly(where)
    comm = engine.init()
    _check_root(where, root_rank, comm.size)
    if comm.size == 1:
        return obj
    payload = _pickled(obj) if comm.rank == root_rank else (None, None)
    data, problem = agreement.gather_objects(comm, payload, f"{where} from rank {root_rank}")[root_rank]
    if problem is not None:
        raise TypeError(f"{where}: rank {root_rank}'s object cannot be pickled ({problem})")
    return obj if comm.rank == root_rank else pickle.loads(data)


def broadcast_object_fn(
    root_rank: int = 0, session: Any = None, name: str | None = None, process_set: Any = None
) -> Callable[[Any], Any]:
    """A function obj -> broadcast_object(obj, root_rank). (Horovod's builds TensorFlow 1 placeholders,
    which TensorFlow 2 no longer has; this one runs eagerly, as broadcast_object.)"""
    unsupported("broadcast_object_fn", session=(session, None), process_set=(process_set, None))
    _check_root("broadcast_object_fn", root_rank, engine.size())
    return functools.partial(broadcast_object, root_rank=root_rank)


def allgather_object(
    obj: Any, session: Any = None, name: str | None = None, process_set: Any = None
) -> list[Any]:
    """Every process's picklable object, in rank order (eagerly only, as Horovod's in TF2); each an
    unpickled copy, this process's own included, as Horovod returns them.

    Raises:
        TypeError: on every rank, when some rank's object cannot be pickled (naming the ranks).
        RuntimeError: called inside tf.function.
    """
    where = "allgather_object"
    unsupported(where, session=(session, None), process_set=(process_set, None))
    _eagerly(where)
    everyone = agreement.gather_objects(engine.init(), _pickled(obj), where)
    bad = [f"rank {r}: {problem}" for r, (_, problem) in enumerate(everyone) if problem is not None]
    if bad:
        raise TypeError(f"{where}: objects that cannot be pickled ({'; '.join(bad)})")
    return [pickle.loads(data) for data, _ in everyone]
