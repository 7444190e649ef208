"""This process's engine: which one the environment launched it for, starting it once, and its ranks.

The engines are communicators (comm/): MPI through mpi4py (mpirun, horovodrun in MPI mode),
TensorFlow's collective runtime (TF_CONFIG, horovodrun's Gloo mode, python -m tf_adasum.run), or a
world of one. tf_adasum.distributed re-exports init, rank, size and the rest, which are public.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from tf_adasum import timeline
from tf_adasum.algorithm.vhdd import tree_blocks
from tf_adasum.comm.base import Communicator, SingleProcessCommunicator
from tf_adasum.common import settings

_comm: Communicator | None = None
# Engines stay started after shutdown(): neither MPI nor TensorFlow's collective runtime can be
# configured twice in one process, so init() after shutdown() picks the same one up again.
_started: dict[str, Communicator] = {}


def detect_engine(environ: Mapping[str, str] | None = None) -> str:
    """The engine the environment was launched for.

    $TF_ADASUM_ENGINE wins; then Open MPI's variables (mpirun, and horovodrun in MPI mode, which runs
    mpirun); then TF_CONFIG; otherwise a single process.
    """
    env = os.environ if environ is None else environ
    forced = settings.forced_engine(env)
    if forced:
        return forced
    if "OMPI_COMM_WORLD_SIZE" in env or "PMIX_RANK" in env:
        return "mpi"
    if "HOROVOD_GLOO_RENDEZVOUS_ADDR" in env or "TF_CONFIG" in env:
        return "tf"
    return "single"


def launched_for_the_tf_engine(environ: Mapping[str, str] | None = None) -> bool:
    """Whether horovodrun (Gloo mode) or `python -m tf_adasum.run` started this process for the TF engine.

    TensorFlow's collective runtime must be configured before TensorFlow runs its first op, so such a
    process starts the engine when tf_adasum is imported (see tf_adasum/__init__.py). A process with a
    TF_CONFIG of its own calls tf_adasum.init() itself, at the top of its script.
    """
    env = os.environ if environ is None else environ
    launcher = "HOROVOD_GLOO_RENDEZVOUS_ADDR" in env or settings.launched_by_tf_adasum(env)
    return launcher and detect_engine(env) == "tf"


def init(engine: str | None = None) -> Communicator:
    """Starts (once) and returns this process's communicator.

    Args:
        engine: "mpi", "tf" or "single"; default detect_engine(). Calling again with the same engine,
            or none, returns the same communicator.

    Raises:
        ValueError: an unknown engine, or another engine than the one already started.
    """
    global _comm
    wanted = engine or detect_engine()
    if wanted not in settings.ENGINES:
        raise ValueError(f"unknown engine {wanted!r}; expected one of {settings.ENGINES}")
    if _comm is not None:
        if engine is not None and engine != _comm.engine:
            raise ValueError(f"tf_adasum is already initialised with engine {_comm.engine!r}, not {engine!r}")
        return _comm
    if wanted in _started:
        _comm = _started[wanted]
        return _comm
    if wanted == "mpi":
        from tf_adasum.comm.mpi import MPICommunicator

        mpi = MPICommunicator()
        mpi.prepare_groups(tree_blocks(mpi.size))
        _comm = mpi
    elif wanted == "tf":
        from tf_adasum.comm import tf_collective

        if "TF_CONFIG" in os.environ:
            workers, task = tf_collective.cluster_from_tf_config()
        elif "HOROVOD_GLOO_RENDEZVOUS_ADDR" in os.environ:
            workers, task = tf_collective.cluster_from_horovodrun()
        else:
            raise ValueError(
                "the TF engine needs a cluster: set TF_CONFIG, or launch with horovodrun (Gloo mode) or "
                "`python -m tf_adasum.run`"
            )
        _comm = tf_collective.TFCollectiveCommunicator(workers, task)
    else:
        _comm = SingleProcessCommunicator()
    _started[_comm.engine] = _comm
    timeline.start_from_environment(_comm.rank, _comm.size)  # HOROVOD_TIMELINE, as Horovod's init reads it
    return _comm


def current() -> Communicator | None:
    """This process's communicator, or None before init() (or after shutdown())."""
    return _comm


def shutdown() -> None:
    """Marks tf_adasum as not initialised, as horovod's shutdown(); init() starts using it again."""
    global _comm
    _comm = None


def is_initialized() -> bool:
    return _comm is not None


def rank() -> int:
    return init().rank


def size() -> int:
    return init().size


def local_rank() -> int:
    return init().local_rank


def local_size() -> int:
    return init().local_size


def cross_rank() -> int:
    return init().cross_rank


def cross_size() -> int:
    return init().cross_size
