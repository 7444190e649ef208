"""The process-level API: init, rank, size, allreduce and broadcast over the detected engine."""

from __future__ import annotations

import enum
import functools
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import tensorflow as tf

from tf_adasum import agreement, ops
from tf_adasum.comm.base import ERRORS, Communicator, PeerError, SingleProcessCommunicator, timeout_seconds
from tf_adasum.tree import adasum_tree, check_replicas_match, first_mismatch, tensor_specs
from tf_adasum.vhdd import tree_across_processes, tree_blocks, vhdd_allreduce

ENGINES = ("mpi", "tf", "single")


class ReduceOp(enum.Enum):
    ADASUM = "adasum"
    SUM = "sum"
    AVERAGE = "average"


Adasum, Sum, Average = ReduceOp.ADASUM, ReduceOp.SUM, ReduceOp.AVERAGE

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
    forced = env.get("TF_ADASUM_ENGINE")
    if forced:
        if forced not in ENGINES:
            raise ValueError(f"TF_ADASUM_ENGINE={forced!r}; expected one of {ENGINES}")
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
    launcher = "HOROVOD_GLOO_RENDEZVOUS_ADDR" in env or env.get("TF_ADASUM_LAUNCHER") == "1"
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
    if wanted not in ENGINES:
        raise ValueError(f"unknown engine {wanted!r}; expected one of {ENGINES}")
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


def check_same_on_all_ranks(
    comm: Communicator, tensors: list[tf.Tensor], what: str, names: Sequence[str] | None = None
) -> None:
    """Raises ValueError on every rank if some rank's tensors differ in count, shape or dtype from rank 0's.

    Runs before any data moves. Inside tf.function it runs once, when the function is traced.
    """
    everyone = comm.allgather_object(tensor_specs(tensors), f"{what} metadata check")
    mismatch = first_mismatch(everyone, "rank", names)
    if mismatch is not None:
        raise ValueError(f"{what}: {mismatch}")


# Library code runs as plain Python inside a tf.function: its branches depend only on static facts.
@tf.autograph.experimental.do_not_convert
def allreduce(tensors: Any, op: ReduceOp = Adasum, names: Sequence[str] | None = None) -> Any:
    """Reduces tensors over all processes; every rank gets bitwise identical results.

    Args:
        tensors: a tensor or a list of tensors, the same count, shapes and dtypes on every rank.
        op: tf_adasum.Adasum (per tensor, by the contract tree; floating dtypes only), tf_adasum.Sum
            or tf_adasum.Average (any numeric dtype; integer averages round toward negative infinity).
        names: optional names of the tensors, used in error messages.

    Returns:
        The reduced tensors, in the structure of `tensors`.

    Raises:
        ValueError: tensors differ across ranks (on every rank, naming tensor and ranks).
        TypeError: a non-floating tensor with op=Adasum.
        NonFiniteUpdateError: op=Adasum, and some rank's tensors hold NaN or Inf (on every rank,
            naming the rank and the tensor).
        UnevenDataError: op=Adasum, and some rank ended its epoch instead of calling this.
        PeerError: a peer died or did not answer within TF_ADASUM_TIMEOUT_SECONDS.

    Example:
        >>> tf_adasum.init()
        >>> grads = tf_adasum.allreduce(grads, op=tf_adasum.Adasum)
    """
    comm = init()
    op = ReduceOp(op)
    what = f"allreduce(op={op.name.title()})"
    items, single = ops.as_tensor_list(what, tensors)
    if op is Adasum:
        ops.check_float_tensors(what, items, one_dtype=False)
    if op is Adasum and tf.executing_eagerly() and comm.size > 1:
        # Eagerly the shapes are checked by fingerprint in the sync's agreement, with no round of
        # their own; how they differ is gathered only when they do.
        try:
            out = vhdd_allreduce(comm, items, names, agreement.fingerprint(items))
        except agreement.MetadataDiffers:
            check_same_on_all_ranks(comm, items, what, names)
            raise
    elif op is Adasum:  # traced: the check runs once, at trace time
        check_same_on_all_ranks(comm, items, what, names)
        out = vhdd_allreduce(comm, items, names)
    else:
        check_same_on_all_ranks(comm, items, what, names)
        out = [comm.allreduce_sum(t) for t in items]
        if op is Average:
            out = [t / comm.size if t.dtype.is_floating else t // comm.size for t in out]
    return out[0] if single else out


def allreduce_compressed(
    tensors: list[Any], op: ReduceOp, compression: str, names: Sequence[str]
) -> list[Any]:
    """allreduce; with compression "fp16", float32 and float64 tensors travel as float16."""
    if compression == "none":
        return allreduce(tensors, op=op, names=names)
    return _widened(allreduce(_narrowed(tensors), op=op, names=names), tensors)


def _narrowed(tensors: Sequence[tf.Tensor]) -> list[tf.Tensor]:
    return [tf.cast(t, tf.float16) if t.dtype in (tf.float32, tf.float64) else t for t in tensors]


def _widened(reduced: Sequence[tf.Tensor], like: Sequence[tf.Tensor]) -> list[tf.Tensor]:
    return [tf.cast(r, t.dtype) for r, t in zip(reduced, like, strict=True)]


# As allreduce: plain Python inside a tf.function.
@tf.autograph.experimental.do_not_convert
def allreduce_replicas(
    per_replica: Sequence[Sequence[Any]], names: Sequence[str] | None = None, compression: str = "none"
) -> list[tf.Tensor]:
    """Adasum over every replica of every process: the contract tree over all of them, in rank order.

    Args:
        per_replica: per_replica[j] is this process's replica j's list of tensors. Every replica of
            every process has the same tensors (shapes and dtypes); processes may hold different
            numbers of replicas. Process 0's replicas are the tree's first leaves, then process 1's...
        names: optional names of the tensors, used in error messages.
        compression: "fp16": float32 and float64 tensors cross processes as float16.

    Returns:
        The combined tensors, bitwise identical on every process.

    When every process holds the same power-of-two number L of replicas, the tree over all P*L
    replicas is the tree over the processes of each process's tree over its own L (the fold and every
    level pair whole processes), so each process combines its own and VHDD combines the processes.
    Otherwise the tree splits inside processes: vhdd.tree_across_processes.

    Raises:
        As allreduce(op=Adasum); a replica's NaN or Inf is reported by every process.
    """
    comm = init()
    local = [[tf.convert_to_tensor(t) for t in r] for r in per_replica]
    if comm.size == 1:
        return adasum_tree(local)
    # One metadata round for all of it: every process's replica count, its tensors, and what is wrong
    # with its own replicas, so that every process raises the same error, not only the one at fault.
    problem = None
    try:
        if not local:
            raise ValueError("this process has no replicas")
        check_replicas_match(local)
        ops.check_float_tensors("allreduce_replicas", local[0], one_dtype=False)
    except (ValueError, TypeError) as error:
        problem = (type(error).__name__, str(error))
    specs = tensor_specs(local[0]) if local else []
    everyone = comm.allgather_object((len(local), specs, problem), "Adasum metadata check")
    for rank, (_, _, found) in enumerate(everyone):
        if found is not None:
            kind = TypeError if found[0] == "TypeError" else ValueError
            raise kind(f"allreduce_replicas: rank {rank}: {found[1]}")
    mismatch = first_mismatch([specs for _, specs, _ in everyone], "rank", names)
    if mismatch is not None:
        raise ValueError(f"allreduce(op=Adasum): {mismatch}")
    counts = [count for count, _, _ in everyone]
    if max(counts) > 1:
        # A NaN would stop one process inside its own part of the tree and leave the others waiting:
        # every process checks all of its replicas first, and all raise the same error.
        code = agreement.first_nonfinite_of(local)
        checked = agreement.agree(comm, agreement.SYNC, code, "adasum sync", len(local[0]), names)
        if not tf.executing_eagerly():
            with tf.control_dependencies([checked]):
                local = [[tf.identity(t) for t in r] for r in local]
    if len(set(counts)) == 1 and counts[0] & (counts[0] - 1) == 0:
        combined = adasum_tree(local) if len(local) > 1 else local[0]
        if compression == "none":
            return vhdd_allreduce(comm, combined, names)
        return _widened(vhdd_allreduce(comm, _narrowed(combined), names), combined)
    return tree_across_processes(comm, local, counts, fp16=compression == "fp16")


@tf.autograph.experimental.do_not_convert
def broadcast(tensors: Any, root: int = 0) -> Any:
    """Root's tensors on every rank, in the structure of `tensors`."""
    comm = init()
    items, single = ops.as_tensor_list("broadcast", tensors)
    check_same_on_all_ranks(comm, items, "broadcast")
    out = [comm.broadcast(t, root) for t in items]
    return out[0] if single else out


def translate_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps a function that runs compiled steps so that tf_adasum's errors reach the caller as themselves.

    Inside a tf.function, a PeerError (or NonFiniteUpdateError, UnevenDataError) raised by the MPI
    engine or the agreement check surfaces as tf.errors.UnknownError, and a dead peer under the TF engine
    as UnavailableError or DeadlineExceededError. The wrapper re-raises them as tf_adasum's classes,
    naming the rank.
    """
    if getattr(fn, "_tf_adasum_translates", False):
        return fn

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except tf.errors.OpError as error:
            translated = translate(error)
            if translated is None:
                raise
            raise translated from error

    wrapped._tf_adasum_translates = True  # type: ignore[attr-defined]
    return wrapped


_RAISED_IN_GRAPH = re.compile(rf"^(?:[\w.]+\.)?({'|'.join(ERRORS)}): (.+)$", re.MULTILINE)


def translate(error: tf.errors.OpError) -> Exception | None:
    """The tf_adasum error that an OpError from a compiled step stands for, or None."""
    raised = _RAISED_IN_GRAPH.search(error.message)
    if raised:
        return ERRORS[raised.group(1)](raised.group(2))
    lost_peer = (tf.errors.UnavailableError, tf.errors.DeadlineExceededError, tf.errors.CancelledError)
    if _comm is not None and _comm.size > 1 and isinstance(error, lost_peer):
        peer = _comm.peer_of(error.message)
        who = f"rank {peer}" if peer is not None else "a peer"
        return PeerError(
            f"rank {_comm.rank}: lost {who} during a compiled step (it died, hangs, or did not answer within "
            f"TF_ADASUM_TIMEOUT_SECONDS={timeout_seconds():.0f} s): "
            f"{type(error).__name__}: {_cause(error.message)}"
        )
    return None


def _cause(message: str) -> str:
    """The line of a TensorFlow error message that says what failed, not where it was defined."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    for line in lines:  # the runtime's own account, e.g. "Collective ops is aborted by: <reason>"
        if "aborted by" in line or "check alive failed" in line or "timed out" in line.lower():
            return line
    return next((line for line in lines if "task:" in line), lines[-1] if lines else "")
