"""The process-level API: init, rank, size, allreduce and broadcast over the detected engine."""

from __future__ import annotations

import enum
import os
from typing import Any

import tensorflow as tf

from tf_adasum import ops
from tf_adasum.comm.base import Communicator, SingleProcessCommunicator
from tf_adasum.vhdd import tree_blocks, vhdd_allreduce

ENGINES = ("mpi", "tf", "single")


class ReduceOp(enum.Enum):
    ADASUM = "adasum"
    SUM = "sum"
    AVERAGE = "average"


Adasum, Sum, Average = ReduceOp.ADASUM, ReduceOp.SUM, ReduceOp.AVERAGE

_comm: Communicator | None = None


def detect_engine(environ: dict[str, str] | None = None) -> str:
    """The engine the environment was launched for.

    $TF_ADASUM_ENGINE wins; then Open MPI's variables (mpirun, and horovodrun in MPI mode, which runs
    mpirun); then TF_CONFIG; otherwise a single process.
    """
    env = os.environ if environ is None else environ
    forced = env.get("TF_ADASUM_ENGINE")
    if forced:
        if forced not in ENGINES:
            raise ValueError(f"TF_ADASUM_ENGINE={forced!r}; expected one of {ENGINES}")
        return forced
    if "OMPI_COMM_WORLD_SIZE" in env or "PMIX_RANK" in env:
        return "mpi"
    if "HOROVOD_GLOO_RENDEZVOUS_ADDR" in env:
        raise RuntimeError(
            "this process was started by horovodrun in Gloo mode, which tf_adasum does not use; "
            "run `horovodrun --mpi ...` (or mpirun) instead"
        )
    if "TF_CONFIG" in env:
        return "tf"
    return "single"


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
    if wanted not in ENGINES:
        raise ValueError(f"unknown engine {wanted!r}; expected one of {ENGINES}")
    if _comm is not None:
        if engine is not None and engine != _comm.engine:
            raise ValueError(f"tf_adasum is already initialised with engine {_comm.engine!r}, not {engine!r}")
        return _comm
    if wanted == "mpi":
        from tf_adasum.comm.mpi import MPICommunicator

        mpi = MPICommunicator()
        mpi.prepare_groups(tree_blocks(mpi.size))
        _comm = mpi
    elif wanted == "tf":
        from tf_adasum.comm.tf_collective import TFCollectiveCommunicator

        _comm = TFCollectiveCommunicator()
    else:
        _comm = SingleProcessCommunicator()
    return _comm


def rank() -> int:
    return init().rank


def size() -> int:
    return init().size


def local_rank() -> int:
    return init().local_rank


def local_size() -> int:
    return init().local_size


def _describe(tensors: list[tf.Tensor]) -> list[tuple[list[int | None], str]]:
    return [(t.shape.as_list(), t.dtype.name) for t in tensors]


def check_same_on_all_ranks(comm: Communicator, tensors: list[tf.Tensor], what: str) -> None:
    """Raises ValueError on every rank if some rank's tensors differ in count, shape or dtype from rank 0's.

    Runs before any data moves. Inside tf.function it runs once, when the function is traced.
    """
    everyone = comm.allgather_object(_describe(tensors), f"{what} metadata check")
    reference = everyone[0]
    for r, described in enumerate(everyone[1:], start=1):
        if len(described) != len(reference):
            raise ValueError(
                f"{what}: rank {r} passed {len(described)} tensors but rank 0 passed {len(reference)}"
            )
        for i, (mine, theirs) in enumerate(zip(described, reference, strict=True)):
            if mine != theirs:
                raise ValueError(
                    f"{what}: tensor {i} of {len(reference)} has shape {mine[0]} and dtype {mine[1]} "
                    f"on rank {r} but shape {theirs[0]} and dtype {theirs[1]} on rank 0"
                )


# Library code runs as plain Python inside a tf.function: its branches depend only on static facts.
@tf.autograph.experimental.do_not_convert
def allreduce(tensors: Any, op: ReduceOp = Adasum) -> Any:
    """Reduces tensors over all processes; every rank gets bitwise identical results.

    Args:
        tensors: a tensor or a list of tensors, the same count, shapes and dtypes on every rank.
        op: tf_adasum.Adasum (per tensor, by the contract tree; floating dtypes only), tf_adasum.Sum
            or tf_adasum.Average (any numeric dtype; integer averages round toward negative infinity).

    Returns:
        The reduced tensors, in the structure of `tensors`.

    Raises:
        ValueError: tensors differ across ranks (on every rank, naming tensor and ranks).
        TypeError: a non-floating tensor with op=Adasum.
        PeerError: a peer died or did not answer within TF_ADASUM_TIMEOUT_SECONDS.

    Example:
        >>> tf_adasum.init()
        >>> grads = tf_adasum.allreduce(grads, op=tf_adasum.Adasum)
    """
    comm = init()
    op = ReduceOp(op)
    items, single = ops.as_tensor_list(f"allreduce(op={op.name.title()})", tensors)
    if op is Adasum:
        ops.check_float_tensors("allreduce(op=Adasum)", items, one_dtype=False)
    check_same_on_all_ranks(comm, items, f"allreduce(op={op.name.title()})")
    if op is Adasum:
        out = vhdd_allreduce(comm, items)
    else:
        out = [comm.allreduce_sum(t) for t in items]
        if op is Average:
            out = [t / comm.size if t.dtype.is_floating else t // comm.size for t in out]
    return out[0] if single else out


@tf.autograph.experimental.do_not_convert
def broadcast(tensors: Any, root: int = 0) -> Any:
    """Root's tensors on every rank, in the structure of `tensors`."""
    comm = init()
    items, single = ops.as_tensor_list("broadcast", tensors)
    check_same_on_all_ranks(comm, items, "broadcast")
    out = [comm.broadcast(t, root) for t in items]
    return out[0] if single else out
