"""Horovod's basics (horovod/common/basics.py and the *_op queries of horovod/tensorflow/mpi_ops.py):
init, what is built and enabled, the rank and size as tensors, and the TensorFlow 1 session APIs, which
raise naming the TensorFlow 2 way."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from tf_adasum import ops, timeline
from tf_adasum._horovod.arguments import unsupported
from tf_adasum.comm import engine


def init(comm: Any = None, process_sets: Any = None) -> None:
    """Starts the engine this process was launched for (mpirun, horovodrun, tf_adasum.run, TF_CONFIG)."""
    unsupported("init", comm=(comm, None), process_sets=(process_sets, None))
    engine.init()


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Starts this process's timeline (tf_adasum/timeline.py): each phase of every sync written as a
    Chrome trace to `file_path`, or, in a job of several processes, to `file_path` with `.rank<r>` before
    its suffix; `python -m tf_adasum.timeline merge` joins the ranks' files. With mark_cycles, each sync's
    start is marked. HOROVOD_TIMELINE=path (and HOROVOD_TIMELINE_MARK_CYCLES=1) starts it at init."""
    comm = engine.init()
    timeline.start(file_path, comm.rank, comm.size, mark_cycles)


def stop_timeline() -> None:
    """Stops this process's timeline and closes its file."""
    timeline.stop()


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
