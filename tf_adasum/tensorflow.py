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
An argument tf_adasum does not implement raises NotImplementedError naming it.
Every other name of horovod.tensorflow 0.28.1 is here too: alltoall, the grouped and in-place
collectives, the object collectives (eager only, as Horovod's in TF2), Min/Max/Product,
PartialDistributedGradientTape, SyncBatchNormalization and the *_op queries; its TF1 session APIs
(broadcast_global_variables, BroadcastGlobalVariablesHook) raise naming the TF2 way.
tf_adasum.keras offers the same functions, and the Keras callbacks besides. Arguments that only name
an op (`name`, `ignore_name_scope`) or that tf_adasum always honours another way (`sparse_as_dense`:
sparse gradients are always reduced dense) are accepted and have no effect.

The implementation lives in tf_adasum/_horovod/, in Horovod's own file names: basics.py, mpi_ops.py,
functions.py, gradient_tape.py, optimizers.py, compression.py, process_sets.py; arguments.py holds the
argument rules its TensorFlow and Keras faces share.
"""

from __future__ import annotations

from tf_adasum import elastic
from tf_adasum._horovod.basics import (
    BroadcastGlobalVariablesHook,
    broadcast_global_variables,
    ccl_built,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    gpu_available,
    init,
    is_homogeneous,
    local_rank_op,
    local_size_op,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    process_set_included_op,
    rank_op,
    rocm_built,
    size_op,
    start_timeline,
    stop_timeline,
)
from tf_adasum._horovod.compression import (
    Compression,
)
from tf_adasum._horovod.functions import (
    allgather_object,
    broadcast_object,
    broadcast_object_fn,
    broadcast_variables,
)
from tf_adasum._horovod.gradient_tape import (
    DistributedGradientTape,
    PartialDistributedGradientTape,
)
from tf_adasum._horovod.mpi_ops import (
    allgather,
    allreduce,
    alltoall,
    broadcast,
    broadcast_,
    grouped_allgather,
    grouped_allreduce,
    grouped_reducescatter,
    join,
    reducescatter,
)
from tf_adasum._horovod.optimizers import (
    DistributedOptimizer,
    PartialDistributedOptimizer,
)
from tf_adasum._horovod.process_sets import (
    ProcessSet,
    add_process_set,
    global_process_set,
    remove_process_set,
)
from tf_adasum.comm.engine import (
    cross_rank,
    cross_size,
    is_initialized,
    local_rank,
    local_size,
    rank,
    shutdown,
    size,
)
from tf_adasum.distributed import Adasum, Average, Max, Min, Product, Sum
from tf_adasum.training.sync_batch_norm import SyncBatchNormalization

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
