"""`import tf_adasum.tensorflow as hvd`: the horovod.tensorflow API, on tf_adasum, for TF2 custom loops.

Everything a Horovod TensorFlow 2 script (a GradientTape loop, as in Horovod's tensorflow2_mnist.py)
touches, with Horovod's names and signatures, so that the import line is the only change:

    tape = hvd.DistributedGradientTape(tape)          # gradients averaged over processes
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))
    if first_batch:
        hvd.broadcast_variables(model.variables, root_rank=0)

`DistributedGradientTape(tape, op=hvd.Adasum)` combines the *gradients* with Adasum, as Horovod does.
The paper's method, Adasum *after* the optimizer (each process steps with its own optimizer state,
then the model deltas are combined), is `hvd.DistributedOptimizer(opt, op=hvd.Adasum)` (an
AdasumOptimizer) with a plain tape:

    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(1e-3), op=hvd.Adasum)
    grads = tf.GradientTape().gradient(...)          # this process's own gradients
    opt.apply_gradients(zip(grads, model.trainable_variables))

Collectives return tensors, eagerly and inside tf.function, and run in program order on every engine.
An argument tf_adasum does not implement raises an error that names it; nothing is ignored.
Every other name of horovod.tensorflow 0.28.1 is here too: alltoall, the grouped and in-place
collectives, the object collectives (eager only, as Horovod's in TF2), Min/Max/Product,
PartialDistributedGradientTape, SyncBatchNormalization and the *_op queries; its TF1 session APIs
(broadcast_global_variables, BroadcastGlobalVariablesHook) raise naming the TF2 way.
tf_adasum.keras offers the same functions, and the Keras callbacks besides.
"""

from __future__ import annotations

import functools
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tf_adasum import agreement, distributed, elastic, engine, ops, shared_state, sync
from tf_adasum.comm.base import Communicator
from tf_adasum.compression import narrows
from tf_adasum.distributed import Adasum, Average, Max, Min, Product, Sum
from tf_adasum.engine import (
    cross_rank,
    cross_size,
    is_initialized,
    local_rank,
    local_size,
    rank,
    shutdown,
    size,
)
from tf_adasum.optimizer import AdasumOptimizer, AllreduceOptimizer
from tf_adasum.sync_batch_norm import SyncBatchNormalization
from tf_adasum.tensor_lists import dense, first_mismatch, tensor_specs
from tf_adasum.variables import tf_variable

__all__ = [
    "Adasum",
    "Average",
    "BroadcastGlobalVariablesHook",
    "Compression",
    "DistributedGradientTape",
    "DistributedOptimizer",
    "Max",
    "Min",
    "PartialDistributedGradientTape",
    "PartialDistributedOptimizer",
    "ProcessSet",
    "Product",
    "Sum",
    "SyncBatchNormalization",
    "add_process_set",
    "allgather",
    "allgather_object",
    "allreduce",
    "alltoall",
    "broadcast",
    "broadcast_",
    "broadcast_global_variables",
    "broadcast_object",
    "broadcast_object_fn",
    "broadcast_variables",
    "ccl_built",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "elastic",
    "global_process_set",
    "gloo_built",
    "gloo_enabled",
    "gpu_available",
    "grouped_allgather",
    "grouped_allreduce",
    "grouped_reducescatter",
    "init",
    "is_homogeneous",
    "is_initialized",
    "join",
    "local_rank",
    "local_rank_op",
    "local_size",
    "local_size_op",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "process_set_included_op",
    "rank",
    "rank_op",
    "reducescatter",
    "remove_process_set",
    "rocm_built",
    "shutdown",
    "size",
    "size_op",
    "start_timeline",
    "stop_timeline",
]


class NoneCompressor:
    """Horovod's default: tensors travel as they are."""

    name = "none"

    @staticmethod
    def compress(tensor: tf.Tensor) -> tuple[tf.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: tf.Tensor, ctx: Any) -> tf.Tensor:
        return tensor


class FP16Compressor:
    """float32 and float64 tensors travel as float16 and come back in their own dtype."""

    name = "fp16"

    @staticmethod
    def compress(tensor: tf.Tensor) -> tuple[tf.Tensor, Any]:
        if narrows(tensor.dtype):
            return tf.cast(tensor, tf.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: tf.Tensor, ctx: Any) -> tf.Tensor:
        return tf.cast(tensor, ctx) if ctx is not None else tensor


class Compression:
    """Horovod's gradient compression: `none`, or `fp16`. A compressor is a class with Horovod's static
    compress(tensor) -> (tensor, ctx) and decompress(tensor, ctx); your own works in the collectives."""

    none = NoneCompressor
    fp16 = FP16Compressor


def init(comm: Any = None, process_sets: Any = None) -> None:
    """Starts the engine this process was launched for (mpirun, horovodrun, tf_adasum.run, TF_CONFIG)."""
    unsupported("init", comm=(comm, None), process_sets=(process_sets, None))
    engine.init()


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


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Horovod's timeline: not supported; TensorFlow's profiler shows tf_adasum's ops and collectives."""
    raise NotImplementedError(
        "hvd.start_timeline is not supported by tf_adasum: profile with TensorFlow's profiler "
        "(tf.profiler.experimental.start(logdir) ... stop(), or "
        "keras.callbacks.TensorBoard(profile_batch=...))"
    )


def stop_timeline() -> None:
    """Horovod's timeline: not supported (see start_timeline)."""
    start_timeline("")


def mpi_built() -> bool:
    """Whether the MPI engine can run here: mpi4py imports (Horovod: built with MPI)."""
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return False
    return True


def mpi_enabled() -> bool:
    """Whether this process runs the MPI engine (tf_adasum.init() chose it)."""
    comm = engine.current()
    return comm is not None and comm.engine == "mpi"


def mpi_threads_supported() -> bool:
    """Whether MPI was started with MPI_THREAD_MULTIPLE (the MPI engine; False under the others)."""
    if not mpi_enabled():
        return False
    from mpi4py import MPI

    return bool(MPI.Query_thread() == MPI.THREAD_MULTIPLE)


def gloo_built() -> bool:
    """False: tf_adasum has no Gloo; horovodrun's Gloo mode starts its TF engine (TensorFlow's
    collective runtime) instead."""
    return False


def gloo_enabled() -> bool:
    """False: see gloo_built."""
    return False


def nccl_built() -> int:
    """0, as Horovod without NCCL: tf_adasum does not link NCCL (under the TF engine TensorFlow's own
    collectives may use it on GPUs)."""
    return 0


def ddl_built() -> bool:
    """False: no IBM DDL."""
    return False


def ccl_built() -> bool:
    """False: no oneCCL."""
    return False


def cuda_built() -> bool:
    """Whether tf_adasum's compiled ops carry GPU kernels (a TF_ADASUM_CUDA=1 build)."""
    return ops.built_with_cuda()


def rocm_built() -> bool:
    """False: no ROCm kernels."""
    return False


def is_homogeneous() -> bool:
    """Whether every host runs the same number of processes (known since the engine started)."""
    return engine.init().homogeneous


def gpu_available(ext_base_name: str, verbose: bool = False) -> bool:
    """Whether the framework `ext_base_name` can run on a GPU here: for "tensorflow", whether TensorFlow
    sees one; False for any other framework, which tf_adasum has no extension for (as Horovod answers
    for an extension it was built without)."""
    if ext_base_name != "tensorflow":
        if verbose:
            print(f"tf_adasum has no {ext_base_name!r} extension, only 'tensorflow': no GPU for it")
        return False
    gpus = tf.config.list_physical_devices("GPU")
    if verbose:
        print(f"TensorFlow sees {len(gpus)} GPU(s)")
    return bool(gpus)


# Horovod's *_op functions compute their value when the graph runs, for graphs built in one environment
# and run in another; a tf_adasum process keeps its rank and size for its lifetime, so constants serve.
def rank_op(name: str | None = None) -> tf.Tensor:
    """This process's rank, as an int32 scalar tensor."""
    return tf.constant(engine.rank(), tf.int32, name=name)


def local_rank_op(name: str | None = None) -> tf.Tensor:
    """This process's rank on its host, as an int32 scalar tensor."""
    return tf.constant(engine.local_rank(), tf.int32, name=name)


def size_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    """The number of processes, as an int32 scalar tensor (process set 0, every rank, only)."""
    unsupported("size_op", process_set_id=(process_set_id, 0))
    return tf.constant(engine.size(), tf.int32, name=name)


def local_size_op(name: str | None = None) -> tf.Tensor:
    """The number of processes on this host, as an int32 scalar tensor."""
    return tf.constant(engine.local_size(), tf.int32, name=name)


def process_set_included_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    """1 as an int32 scalar tensor: every process is in process set 0, the only one tf_adasum has."""
    unsupported("process_set_included_op", process_set_id=(process_set_id, 0))
    engine.init()
    return tf.constant(1, tf.int32, name=name)


def broadcast_global_variables(root_rank: int) -> None:
    """Horovod's TF1-era broadcast of the graph's global variables: there are none in TensorFlow 2."""
    raise NotImplementedError(
        "hvd.broadcast_global_variables is TensorFlow 1's (global variables of a graph): use "
        f"hvd.broadcast_variables(model.variables, root_rank={root_rank}), or "
        f"hvd.callbacks.BroadcastGlobalVariablesCallback({root_rank}) in fit"
    )


class BroadcastGlobalVariablesHook:
    """Horovod's TF1-era SessionRunHook (tf.estimator, MonitoredTrainingSession): TensorFlow 2 has none."""

    def __init__(self, root_rank: int, device: str = "", process_set: Any = None) -> None:
        raise NotImplementedError(
            "hvd.BroadcastGlobalVariablesHook is TensorFlow 1's (a SessionRunHook of tf.estimator): in "
            f"TensorFlow 2 call hvd.broadcast_variables(model.variables, root_rank={root_rank}) (and the "
            "optimizer's variables) after the first step, or use "
            f"tf_adasum.keras.callbacks.BroadcastGlobalVariablesCallback({root_rank}) in fit"
        )


def unsupported(where: str, **arguments: tuple[Any, Any]) -> None:
    """Raises naming every argument whose value differs from the one default that tf_adasum implements."""
    for name, (value, default) in arguments.items():
        if name == "process_set" and value is global_process_set:
            continue  # every rank: what tf_adasum's collectives do
        same = value is default if default is None else value == default
        if not same:
            raise NotImplementedError(
                f"{where}({name}={value!r}) is not supported by tf_adasum; only {name}={default!r} is"
            )


def reduce_op(where: str, average: bool | None, op: Any) -> distributed.ReduceOp:
    """Horovod's rule: op wins; average=False means Sum; neither given means Average."""
    if op is not None and average is not None:
        raise ValueError(f"{where}: pass op or average, not both (got op={op!r}, average={average!r})")
    if op is not None:
        return distributed.ReduceOp(op)
    return Sum if average is False else Average


def _scaled(tensor: tf.Tensor, factor: float) -> tf.Tensor:
    """tensor * factor; integer tensors are scaled in float64 and cast back, as Horovod scales them."""
    if factor == 1.0:
        return tensor
    if tensor.dtype.is_floating:
        return tensor * tf.cast(factor, tensor.dtype)
    return tf.cast(tf.cast(tensor, tf.float64) * factor, tensor.dtype)


def grouped_allreduce(
    tensors: Sequence[Any],
    average: bool | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
    ignore_name_scope: bool = False,
    name: str | None = None,
    names: Sequence[str] | None = None,
) -> list[tf.Tensor]:
    """Reduces a list of tensors over all processes in one fused call: Average (default), Sum or Adasum.

    Tensors of one dtype travel in one buffer; Adasum is still per tensor. prescale_factor multiplies
    each tensor before the reduction, postscale_factor the result.
    """
    where = "grouped_allreduce"
    unsupported(where, device_dense=(device_dense, ""), device_sparse=(device_sparse, ""))
    unsupported(where, process_set=(process_set, None))
    chosen = reduce_op(where, average, op)
    compressed = [compression.compress(tf.convert_to_tensor(dense(t))) for t in tensors]
    items = [c for c, _ in compressed]
    items = [_scaled(t, prescale_factor) for t in items]
    reduced = distributed.allreduce(items, op=chosen, names=names) if items else []
    reduced = [_scaled(t, postscale_factor) for t in reduced]
    return [compression.decompress(t, ctx) for t, (_, ctx) in zip(reduced, compressed, strict=True)]


def allreduce(
    tensor: Any,
    average: bool | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    name: str | None = None,
    process_set: Any = None,
    ignore_name_scope: bool = False,
) -> tf.Tensor:
    """Reduces a tensor over all processes: Average (the default), Sum, or Adasum. Returns a tensor."""
    return grouped_allreduce(
        [tensor],
        average=average,
        device_dense=device_dense,
        device_sparse=device_sparse,
        compression=compression,
        op=op,
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
        process_set=process_set,
    )[0]


def reducescatter(
    tensor: Any,
    device_dense: str = "",
    compression: Any = Compression.none,
    op: Any = Average,
    name: str | None = None,
    process_set: Any = None,
    ignore_name_scope: bool = False,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> tf.Tensor:
    """This process's share of the first axis of the tensor reduced over all processes (Sum or Average).

    As in Horovod, rank r gets rows [r * n // size + min(r, n % size), ...): when the first dimension n
    does not divide by the number of processes, the lower ranks get one row more. Implemented as an
    all-reduce, then this rank's slice: the bandwidth of an all-reduce, not of a reduce-scatter.
    """
    return _reducescatter(
        "reducescatter",
        [tensor],
        device_dense,
        compression,
        op,
        process_set,
        prescale_factor,
        postscale_factor,
    )[0]


def grouped_reducescatter(
    tensors: Sequence[Any],
    device_dense: str = "",
    compression: Any = Compression.none,
    op: Any = Average,
    process_set: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> list[tf.Tensor]:
    """reducescatter of each tensor, all reduced in one fused all-reduce per dtype (Horovod's)."""
    return _reducescatter(
        "grouped_reducescatter",
        tensors,
        device_dense,
        compression,
        op,
        process_set,
        prescale_factor,
        postscale_factor,
    )


def _reducescatter(
    where: str,
    tensors: Sequence[Any],
    device_dense: str,
    compression: Any,
    op: Any,
    process_set: Any,
    prescale_factor: float,
    postscale_factor: float,
) -> list[tf.Tensor]:
    chosen = distributed.ReduceOp(op)
    if chosen not in (Sum, Average):
        raise NotImplementedError(
            f"{where}(op={chosen.name.title()}) is not supported (nor by Horovod, whose reducescatter "
            "takes only Sum and Average): use Sum or Average"
        )
    if not tensors:
        return []
    reduced = grouped_allreduce(
        tensors,
        device_dense=device_dense,
        compression=compression,
        op=chosen,
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
        process_set=process_set,
    )
    # Checked after the all-reduce, which has checked that every rank passed the same shapes: so a
    # scalar raises here on every rank, not on one while the others wait for it.
    for i, t in enumerate(reduced):
        if t.shape.rank == 0:
            raise ValueError(
                f"{where}: {_which(i, len(reduced))}is a scalar; a reduce-scatter splits the first "
                "dimension, so it needs tensors of rank 1 or more"
            )
    return [_my_rows(t) for t in reduced]


def _which(index: int, count: int) -> str:
    """'tensor 2 of 3 ' for messages about one of several tensors; nothing for a single one."""
    return f"tensor {index} of {count} " if count > 1 else "the tensor "


def _my_rows(reduced: tf.Tensor) -> tf.Tensor:
    """This rank's rows of a reduced tensor: Horovod's split, the extra rows on the lower ranks."""
    n, r, p = tf.shape(reduced)[0], engine.rank(), engine.size()
    base, extra = n // p, n % p
    start = r * base + tf.minimum(r, extra)
    rows = base + tf.cast(r < extra, n.dtype)
    return reduced[start : start + rows]


def broadcast(
    tensor: Any,
    root_rank: int,
    name: str | None = None,
    ignore_name_scope: bool = False,
    process_set: Any = None,
) -> tf.Tensor:
    """Rank `root_rank`'s tensor, on every process."""
    unsupported("broadcast", process_set=(process_set, None))
    return distributed.broadcast(tf.convert_to_tensor(tensor), root=root_rank)


def broadcast_variables(
    variables: Any, root_rank: int, process_set: Any = None, inplace: bool = False
) -> None:
    """Assigns rank `root_rank`'s values to `variables` (Keras or TensorFlow) on every process."""
    unsupported("broadcast_variables", process_set=(process_set, None))
    shared_state.broadcast_variables(list(variables), root_rank)


def allgather(
    tensor: Any, name: str | None = None, ignore_name_scope: bool = False, process_set: Any = None
) -> tf.Tensor:
    """Every process's tensor concatenated along the first axis, in rank order; eagerly or compiled.

    As in Horovod, the first dimension may differ between processes; the others must agree.
    """
    unsupported("allgather", process_set=(process_set, None))
    return _allgather("allgather", [tensor])[0]


def grouped_allgather(
    tensors: Sequence[Any], name: str | None = None, ignore_name_scope: bool = False, process_set: Any = None
) -> list[tf.Tensor]:
    """allgather of each tensor (Horovod's): one round for all of their first dimensions, then one
    all-gather per tensor. Each tensor's first dimension may differ between processes."""
    unsupported("grouped_allgather", process_set=(process_set, None))
    return _allgather("grouped_allgather", tensors)


def _check_all_but_first_dimension(
    comm: Communicator, where: str, values: Sequence[tf.Tensor], problem: str | None = None
) -> None:
    """Raises on every rank if some rank found a problem with its own arguments, or if the ranks'
    tensors differ in count, dtype or any dimension but the first. One metadata exchange, when Python
    runs (while a tf.function is traced), so that a rank with bad input does not leave the others
    waiting in the collective."""
    specs = [(None if s is None else [None, *s[1:]] if s else s, d) for s, d in tensor_specs(values)]
    everyone = agreement.gather_objects(comm, (problem, specs), f"{where} metadata check")
    for rank_, (found, _) in enumerate(everyone):
        if found is not None:
            raise ValueError(f"{where}: on rank {rank_}, {found}")
    mismatch = first_mismatch([s for _, s in everyone], "rank")
    if mismatch is not None:
        raise ValueError(f"{where}: {mismatch}; only the first dimension (None here) may differ")


def _rank_problem(where: str, values: Sequence[tf.Tensor]) -> str | None:
    """What is wrong with tensors that must have a first dimension, or None."""
    for i, v in enumerate(values):
        if v.shape.rank is None:
            return f"{_which(i, len(values))}has an unknown rank; {where} needs it known when traced"
        if v.shape.rank == 0:
            return f"{_which(i, len(values))}is a scalar; {where} needs tensors of rank 1 or more"
    return None


def _allgather(where: str, tensors: Sequence[Any]) -> list[tf.Tensor]:
    values = [tf.convert_to_tensor(t) for t in tensors]
    comm = engine.init()
    if not values:
        return []
    _check_all_but_first_dimension(comm, where, values, _rank_problem(where, values))
    if comm.size == 1:
        return values
    # Every tensor's first dimension on every rank, in one gather; then each tensor padded to its longest.
    (firsts,) = agreement.announce(
        comm, agreement.ALLGATHER, [tf.stack([tf.shape(v, out_type=tf.int64)[0] for v in values])], where
    )
    rows = comm.allgather(firsts)
    longest = tf.reduce_max(rows, axis=0)
    out = []
    for i, v in enumerate(values):
        padding = [[0, longest[i] - tf.shape(v, out_type=tf.int64)[0]]] + [[0, 0]] * (v.shape.rank - 1)
        (padded,) = agreement.announce(comm, agreement.ALLGATHER, [tf.pad(v, padding)], where)
        gathered = comm.allgather(padded)
        out.append(tf.boolean_mask(gathered, tf.sequence_mask(rows[:, i], longest[i])))
    return out


def alltoall(
    tensor: Any,
    splits: Any = None,
    name: str | None = None,
    ignore_name_scope: bool = False,
    process_set: Any = None,
) -> Any:
    """Sends rows of `tensor` to every process and returns the rows every process sent here (Horovod's).

    Rows are cut along the first dimension, in rank order: the first splits[0] go to rank 0, the next
    splits[1] to rank 1, and so on (rows past their sum are not sent). Without splits the first
    dimension is cut into equal parts, one per process, and must divide by their number. The other
    dimensions and the dtype must agree between processes. Implemented as an all-gather of the
    tensors, padded to the longest: the bandwidth of an all-gather, not of an all-to-all.

    Args:
        tensor: a tensor of rank 1 or more.
        splits: optional integer vector of one count per process.

    Returns:
        The received rows, concatenated in the order of the ranks that sent them; with `splits`, also
        received_splits, the int32 counts of rows received from each rank (Horovod's pair).

    Raises:
        ValueError: on every rank, when some rank's splits are not one non-negative count per process
            adding up to at most its rows, its rows do not divide evenly without splits, or the ranks'
            tensors differ in dtype or other dimensions (inside tf.function the run-time checks raise
            InvalidArgumentError with the same message).
    """
    where = "alltoall"
    unsupported(where, process_set=(process_set, None))
    value = tf.convert_to_tensor(tensor)
    comm = engine.init()
    size = comm.size
    counts = None if splits is None else tf.convert_to_tensor(splits)
    problem = _rank_problem(where, [value])
    if counts is not None and problem is None:
        if not counts.dtype.is_integer:
            problem = f"splits has dtype {counts.dtype.name}; expected integers"
        elif counts.shape.rank != 1 or counts.shape[0] not in (None, size):
            problem = f"splits has shape {counts.shape}; expected [{size}], one count per process"
    _check_all_but_first_dimension(comm, where, [value], problem)
    first = tf.shape(value, out_type=tf.int64)[0]
    sent = tf.fill([size], first // size) if counts is None else tf.cast(counts, tf.int64)
    # Every rank's (rows, splits given, splits), so that every rank checks every rank's.
    mine = tf.concat([tf.stack([first, tf.constant(int(counts is not None), tf.int64)]), sent], 0)
    (mine,) = agreement.announce(comm, agreement.ALLGATHER, [mine], where)
    table = _host_check(_check_splits, comm.allgather(mine))
    rows, matrix = table[:, 0], table[:, 2:]
    longest = tf.reduce_max(rows)
    padding = [[0, longest - first]] + [[0, 0]] * (value.shape.rank - 1)
    (padded,) = agreement.announce(comm, agreement.ALLGATHER, [tf.pad(value, padding)], where)
    gathered = comm.allgather(padded)
    # From each rank s: the rows it sends here, which start after those it sends to lower ranks.
    received = matrix[:, comm.rank]
    starts = tf.reduce_sum(matrix[:, : comm.rank], axis=1)
    position = tf.range(longest)[tf.newaxis, :]
    keep = (position >= starts[:, tf.newaxis]) & (position < (starts + received)[:, tf.newaxis])
    output = tf.boolean_mask(gathered, keep)
    return output if counts is None else (output, tf.cast(received, tf.int32))


def _check_splits(table: np.ndarray) -> np.ndarray:
    """Raises ValueError naming the first rank whose alltoall splits do not fit its tensor."""
    size = table.shape[0]
    for r, (rows, given, *sent) in enumerate(table.tolist()):
        if not given and rows % size:
            raise ValueError(
                f"alltoall: rank {r}'s tensor has {rows} rows, which do not split evenly over {size} "
                "processes; pass splits"
            )
        if min(sent) < 0:
            raise ValueError(f"alltoall: rank {r}'s splits {sent} hold a negative count")
        if sum(sent) > rows:
            raise ValueError(
                f"alltoall: rank {r}'s splits {sent} add up to {sum(sent)} rows, more than its tensor's "
                f"{rows}"
            )
    return table


def _host_check(check: Callable[[np.ndarray], np.ndarray], table: tf.Tensor) -> tf.Tensor:
    """check(table) now, eagerly; inside a tf.function, as an op whose output later work depends on."""
    if tf.executing_eagerly():
        check(table.numpy())
        return table
    checked = tf.numpy_function(check, [table], table.dtype, stateful=True)
    checked.set_shape(table.shape)
    return checked


def broadcast_(
    variables: Sequence[Any], root_rank: int, name: str | None = None, process_set: Any = None
) -> list[tf.Tensor]:
    """Assigns rank `root_rank`'s values to `variables` on every process; returns their new values.

    Horovod's in-place broadcast: one fused broadcast per dtype, then an assign to each variable
    (tf_adasum holds the received values in a buffer before assigning them, which Horovod avoids).
    """
    where = "broadcast_"
    unsupported(where, process_set=(process_set, None))
    held = [tf_variable(v) for v in variables]
    for i, v in enumerate(held):
        if not hasattr(v, "assign"):
            raise TypeError(
                f"{where} assigns in place, so it takes variables, but {_which(i, len(held))}is a "
                f"{type(v).__name__}: use broadcast(tensor, root_rank) for tensors"
            )
    if not held:
        return []
    values = distributed.broadcast(list(held), root=root_rank)
    for variable, value in zip(held, values, strict=True):
        variable.assign(value)
    return [tf.identity(v) for v in held]


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


def join() -> tf.Tensor:
    """Not supported: tf_adasum refuses uneven data instead of joining (see the README's Failures)."""
    raise NotImplementedError(
        "hvd.join() is not supported by tf_adasum: a rank that ran out of data would have to keep "
        "contributing to every collective, which Adasum cannot do honestly. Give every rank the same "
        "number of batches (equal shards, drop_remainder=True, or a fixed number of steps); a rank that "
        "ends early makes every rank raise tf_adasum.UnevenDataError"
    )


class DistributedGradientTape:
    """A tf.GradientTape whose gradient() reduces the gradients over all processes (Horovod's).

    Wrap the tape after recording: `tape = hvd.DistributedGradientTape(tape)`. gradient() computes this
    process's gradients with the wrapped tape, then reduces all of them in one fused call: Average (the
    default) or Sum, or Adasum of the gradients (as Horovod's op=Adasum). None gradients stay None; sparse
    gradients are reduced dense. Everything else (watch, stop_recording, jacobian, ...) is the wrapped
    tape's.

    For the paper's Adasum after the optimizer, keep a plain tape and use
    `hvd.DistributedOptimizer(opt, op=hvd.Adasum)`, which is tf_adasum.AdasumOptimizer.

    Args:
        gradtape: the tf.GradientTape that recorded the forward pass.
        compression: Compression.none or Compression.fp16 (or a compressor of your own).
        sparse_as_dense: accepted; sparse gradients are always reduced dense.
        op: Average, Sum or Adasum.
        gradient_predivide_factor: with op=Average, gradients are divided by it before the sum and the
            sum by size / factor after, as Horovod does.
        scale_local_gradients: divide the gradients of local sources (register_local_source) by the
            number of processes, as Horovod does.
        device_dense, device_sparse, num_groups, groups, process_set: defaults only (tf_adasum reduces
            all gradients in one fused call).
    """

    def __init__(
        self,
        gradtape: tf.GradientTape,
        device_dense: str = "",
        device_sparse: str = "",
        compression: Any = Compression.none,
        sparse_as_dense: bool = False,
        op: Any = Average,
        gradient_predivide_factor: float = 1.0,
        num_groups: int = 0,
        groups: Any = None,
        process_set: Any = None,
        scale_local_gradients: bool = True,
    ) -> None:
        where = "DistributedGradientTape"
        unsupported(where, device_dense=(device_dense, ""), device_sparse=(device_sparse, ""))
        unsupported(where, process_set=(process_set, None))
        self.op = distributed.ReduceOp(op)
        if gradient_predivide_factor != 1.0 and self.op is not Average:
            raise ValueError(
                f"gradient_predivide_factor={gradient_predivide_factor} applies to op=Average only, got "
                f"op={self.op.name.title()}"
            )
        self._tape = gradtape
        self.compression = compression
        self.gradient_predivide_factor = gradient_predivide_factor
        self.scale_local_gradients = scale_local_gradients
        # This worker's own sources (Horovod's local sources), by the identity of their tf.Variable.
        self._local_sources: dict[int, Any] = {}
        engine.init()

    def register_local_source(self, source: Any) -> None:
        """Makes `source` (a variable) this worker's own: its gradient is not reduced over processes."""
        self._local_sources[id(tf_variable(source))] = source

    def _is_local(self, source: Any) -> bool:
        return id(tf_variable(source)) in self._local_sources

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tape, name)

    def __enter__(self) -> DistributedGradientTape:
        self._tape.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._tape.__exit__(*exc)

    def gradient(
        self,
        target: Any,
        sources: Any,
        output_gradients: Any = None,
        unconnected_gradients: Any = tf.UnconnectedGradients.NONE,
    ) -> Any:
        """The gradients of `target` with respect to `sources`, reduced over all processes."""
        local = self._tape.gradient(target, sources, output_gradients, unconnected_gradients)
        flat_sources, flat = tf.nest.flatten(sources), tf.nest.flatten(local)
        mine = [self._is_local(s) for s in flat_sources]
        present = [i for i, g in enumerate(flat) if g is not None and not mine[i]]
        names = [_name(flat_sources[i]) for i in present]
        factor = self.gradient_predivide_factor
        size = engine.init().size
        reduced = grouped_allreduce(
            [flat[i] for i in present],
            op=Sum if self.op is Average else self.op,
            compression=self.compression,
            prescale_factor=1.0 / factor if self.op is Average else 1.0,
            postscale_factor=factor / size if self.op is Average else 1.0,
            names=names,
        )
        out = list(flat)
        for i, g in zip(present, reduced, strict=True):
            out[i] = g
        if self.scale_local_gradients and size > 1:  # Horovod's: a local gradient divided by the workers
            out = [_divided(g, size) if mine[i] and g is not None else g for i, g in enumerate(out)]
        return tf.nest.pack_sequence_as(local, out)

    def get_local_and_global_gradients(
        self, target: Any, sources: Any, output_gradients: Any = None
    ) -> tuple[list[tuple[Any, Any]], list[tuple[Any, Any]]]:
        """gradient(), as (source, gradient) pairs of the local sources and of the others (Horovod's)."""
        gradients = self.gradient(target, sources, output_gradients)
        pairs = list(zip(tf.nest.flatten(sources), tf.nest.flatten(gradients), strict=True))
        return [p for p in pairs if self._is_local(p[0])], [p for p in pairs if not self._is_local(p[0])]


def _divided(gradient: Any, size: int) -> Any:
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(gradient.values / size, gradient.indices, gradient.dense_shape)
    return gradient / size


def PartialDistributedGradientTape(
    gradtape: tf.GradientTape,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    sparse_as_dense: bool = False,
    op: Any = Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Any = None,
    process_set: Any = None,
    local_layers: Any = None,
    scale_local_gradients: bool = True,
) -> DistributedGradientTape:
    """DistributedGradientTape whose gradients of `local_layers`' trainable weights stay this worker's
    own (not reduced; divided by the number of processes with scale_local_gradients), as Horovod's.

    Args:
        local_layers: a keras.layers.Layer or a list of them; None: every gradient is reduced.
        The others: as DistributedGradientTape.

    Raises:
        ValueError: something in local_layers is not a Keras layer.
    """
    layers = _local_layers("PartialDistributedGradientTape", local_layers)
    tape = DistributedGradientTape(
        gradtape,
        device_dense=device_dense,
        device_sparse=device_sparse,
        compression=compression,
        sparse_as_dense=sparse_as_dense,
        op=op,
        gradient_predivide_factor=gradient_predivide_factor,
        num_groups=num_groups,
        groups=groups,
        process_set=process_set,
        scale_local_gradients=scale_local_gradients,
    )
    for layer in layers:
        for variable in layer.trainable_weights:
            tape.register_local_source(variable)
    return tape


def _name(source: Any) -> str:
    return getattr(source, "path", None) or getattr(source, "name", None) or "tensor"


def DistributedOptimizer(
    optimizer: keras.optimizers.Optimizer,
    name: str | None = None,
    use_locking: bool = False,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    sparse_as_dense: bool = False,
    backward_passes_per_step: int = 1,
    op: Any = Average,
    gradient_predivide_factor: float = 1.0,
    average_aggregated_gradients: bool = False,
    num_groups: int = 0,
    groups: Any = None,
    process_set: Any = None,
    scale_local_gradients: bool = True,
) -> keras.optimizers.Optimizer:
    """Horovod's DistributedOptimizer for a Keras 3 optimizer, in a custom loop or under model.fit.

    Args:
        optimizer: the Keras optimizer to wrap.
        name: optional name of the wrapper.
        compression: Compression.none or Compression.fp16.
        sparse_as_dense: accepted; sparse (IndexedSlices) gradients are always made dense.
        op: Average or Sum all-reduce the gradients before the optimizer; Adasum combines the model
            deltas after it (the paper's method), every `backward_passes_per_step` local steps.
        backward_passes_per_step: with op=Adasum, the local steps between two syncs (each local step
            applies its own gradient); with Average/Sum, Horovod's gradient accumulation: the passes'
            gradients summed locally, then all-reduced once and applied.
        average_aggregated_gradients: with Average/Sum, divide the accumulated gradients by
            backward_passes_per_step, as Horovod; with op=Adasum and k > 1 a ValueError (nothing is
            aggregated there).
        scale_local_gradients: with Average/Sum, divide the gradients of local variables
            (register_local_var) by the number of processes, as Horovod.
        use_locking, device_dense, device_sparse, gradient_predivide_factor, num_groups, groups,
        process_set: only their defaults are supported; anything else raises.

    Returns:
        An AdasumOptimizer (op=Adasum) or AllreduceOptimizer (op=Average/Sum) around `optimizer`.

    Raises:
        NotImplementedError: an argument that tf_adasum does not implement, named.
        ValueError: an unknown op, or a bad backward_passes_per_step.
    """
    where = "DistributedOptimizer"
    unsupported(where, use_locking=(use_locking, False), device_dense=(device_dense, ""))
    unsupported(where, device_sparse=(device_sparse, ""), process_set=(process_set, None))
    unsupported(where, gradient_predivide_factor=(gradient_predivide_factor, 1.0))
    unsupported(where, num_groups=(num_groups, 0), groups=(groups, None))
    if compression not in (Compression.none, Compression.fp16):
        raise NotImplementedError(
            f"{where}(compression={compression!r}) is not supported by tf_adasum; use Compression.none or "
            "Compression.fp16"
        )
    chosen = distributed.ReduceOp(op)
    sync.check_positive_integer("backward_passes_per_step", backward_passes_per_step)
    engine.init()
    if chosen is Adasum:
        if average_aggregated_gradients and backward_passes_per_step > 1:
            raise ValueError(
                f"{where}(op=Adasum, average_aggregated_gradients=True): with Adasum after the optimizer "
                "each of the backward_passes_per_step passes is a local step of its own, and nothing is "
                "aggregated to average; leave average_aggregated_gradients False"
            )
        return AdasumOptimizer(
            optimizer, sync_every=backward_passes_per_step, name=name, compression=compression.name
        )
    return AllreduceOptimizer(
        optimizer,
        op=chosen,
        name=name,
        compression=compression.name,
        backward_passes_per_step=backward_passes_per_step,
        average_aggregated_gradients=average_aggregated_gradients,
        scale_local_gradients=scale_local_gradients,
    )


def PartialDistributedOptimizer(
    optimizer: keras.optimizers.Optimizer,
    name: str | None = None,
    use_locking: bool = False,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    sparse_as_dense: bool = False,
    backward_passes_per_step: int = 1,
    op: Any = Average,
    gradient_predivide_factor: float = 1.0,
    average_aggregated_gradients: bool = False,
    num_groups: int = 0,
    groups: Any = None,
    process_set: Any = None,
    local_layers: Any = None,
    scale_local_gradients: bool = True,
) -> keras.optimizers.Optimizer:
    """Horovod's PartialDistributedOptimizer: DistributedOptimizer with every variable of `local_layers`
    (a layer or a list of layers) registered as this worker's own (register_local_var)."""
    wrapped = DistributedOptimizer(
        optimizer,
        name=name,
        use_locking=use_locking,
        device_dense=device_dense,
        device_sparse=device_sparse,
        compression=compression,
        sparse_as_dense=sparse_as_dense,
        backward_passes_per_step=backward_passes_per_step,
        op=op,
        gradient_predivide_factor=gradient_predivide_factor,
        average_aggregated_gradients=average_aggregated_gradients,
        num_groups=num_groups,
        groups=groups,
        process_set=process_set,
        scale_local_gradients=scale_local_gradients,
    )
    for layer in _local_layers("PartialDistributedOptimizer", local_layers):
        for variable in layer.trainable_weights:
            wrapped.register_local_var(variable)
    return wrapped


def _local_layers(where: str, local_layers: Any) -> list[Any]:
    """Horovod's local_layers (None, a Keras layer, or a list of them) as a list.

    Raises:
        ValueError: something in it is not a Keras layer.
    """
    if local_layers is None:
        return []
    layers = [local_layers] if isinstance(local_layers, keras.layers.Layer) else list(local_layers)
    for i, layer in enumerate(layers):
        if not isinstance(layer, keras.layers.Layer):
            raise ValueError(
                f"{where}: local_layers[{i}] is a {type(layer).__name__}; every local layer must be a "
                "keras.layers.Layer"
            )
    return layers
