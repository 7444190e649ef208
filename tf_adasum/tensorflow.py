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
tf_adasum.keras offers the same functions, and the Keras callbacks besides.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

from tf_adasum import agreement, distributed, engine, ops, shared_state, sync
from tf_adasum.compression import narrows
from tf_adasum.distributed import Adasum, Average, Sum
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
from tf_adasum.tensor_lists import dense

__all__ = [
    "Adasum",
    "Average",
    "Compression",
    "DistributedGradientTape",
    "DistributedOptimizer",
    "PartialDistributedOptimizer",
    "ProcessSet",
    "Sum",
    "add_process_set",
    "allgather",
    "allreduce",
    "broadcast",
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
    "grouped_allreduce",
    "init",
    "is_initialized",
    "join",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "rank",
    "reducescatter",
    "remove_process_set",
    "rocm_built",
    "shutdown",
    "size",
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


class _Elastic:
    """horovod.tensorflow(.keras).elastic: not supported; any use of it says so and what to do instead."""

    def __init__(self, module: str) -> None:
        self._module = module

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise NotImplementedError(
            f"{self._module}.elastic.{name}: elastic training (workers joining and leaving a running job) "
            "is not supported by tf_adasum. Run a fixed number of processes, and resume a job that lost "
            "one with keras.callbacks.BackupAndRestore (each process its own directory) or "
            "tf.train.CheckpointManager, restarting the same command"
        )


elastic = _Elastic("hvd")


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
    chosen = distributed.ReduceOp(op)
    if chosen is Adasum:
        raise NotImplementedError(
            "reducescatter(op=Adasum) is not supported (nor by Horovod): use Sum or Average"
        )
    reduced = allreduce(
        tensor,
        device_dense=device_dense,
        compression=compression,
        op=chosen,
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
        process_set=process_set,
    )
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
    value = tf.convert_to_tensor(tensor)
    comm = engine.init()
    if value.shape.rank == 0:
        raise ValueError("allgather needs a tensor of rank 1 or more, got a scalar")
    if comm.size == 1:
        return value
    # Each rank's first dimension, then every rank's tensor padded to the longest: one gather each.
    (length,) = agreement.announce(
        comm, agreement.ALLGATHER, [tf.shape(value, out_type=tf.int64)[:1]], "allgather"
    )
    rows = comm.allgather(length)[:, 0]
    longest = tf.reduce_max(rows)
    padding = [[0, longest - tf.shape(value, out_type=tf.int64)[0]]] + [[0, 0]] * (value.shape.rank - 1)
    padded = tf.pad(value, padding)
    agreement.check_same_on_all_ranks(comm, [padded], "allgather")
    (padded,) = agreement.announce(comm, agreement.ALLGATHER, [padded], "allgather")
    gathered = comm.allgather(padded)
    return tf.boolean_mask(gathered, tf.sequence_mask(rows, longest))


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
        device_dense, device_sparse, num_groups, groups, process_set, scale_local_gradients: defaults
            only (tf_adasum reduces all gradients in one fused call).
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
        unsupported(
            where, process_set=(process_set, None), scale_local_gradients=(scale_local_gradients, True)
        )
        self.op = distributed.ReduceOp(op)
        if gradient_predivide_factor != 1.0 and self.op is not Average:
            raise ValueError(
                f"gradient_predivide_factor={gradient_predivide_factor} applies to op=Average only, got "
                f"op={self.op.name.title()}"
            )
        self._tape = gradtape
        self.compression = compression
        self.gradient_predivide_factor = gradient_predivide_factor
        engine.init()

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
        present = [i for i, g in enumerate(flat) if g is not None]
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
        return tf.nest.pack_sequence_as(local, out)


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
    layers = (
        [] if local_layers is None else local_layers if isinstance(local_layers, list) else [local_layers]
    )
    for layer in layers:
        for variable in layer.trainable_weights:
            wrapped.register_local_var(variable)
    return wrapped
