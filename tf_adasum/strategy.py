"""AdasumStrategy: MirroredStrategy whose replicas combine their updates with Adasum.

Use it where MirroredStrategy goes. A plain Keras optimizer compiled under its scope becomes an
AdasumOptimizer, so each replica steps on its own and the deltas are combined with Adasum; metrics,
losses and BatchNorm statistics keep MirroredStrategy's sums and means.

Across processes (mpirun, horovodrun --mpi, or TF_CONFIG), each process holds one replica, as with
Horovod: one process per GPU or per host CPU. The model updates cross processes inside the optimizer
(tf_adasum.allreduce); each process reads its contiguous share of every global batch, as replicas do
within MirroredStrategy; the logs of Keras's train and test steps are averaged over processes. No
part of this goes through MultiWorkerMirroredStrategy's fit path, which Keras 3 breaks
(keras-team/keras#20585).
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf
from keras.src import optimizers as keras_optimizers

from tf_adasum import _compat, distributed
from tf_adasum.callbacks import average_logs
from tf_adasum.optimizer import AdasumOptimizer, check_sync_every

_keras_get_optimizer = keras_optimizers.get


def _get_optimizer(identifier: Any) -> Any:
    """keras.optimizers.get, wrapping the result in AdasumOptimizer under an AdasumStrategy's scope."""
    optimizer = _keras_get_optimizer(identifier)
    strategy = tf.distribute.get_strategy()
    if isinstance(strategy, AdasumStrategy) and not isinstance(optimizer, AdasumOptimizer):
        return AdasumOptimizer(optimizer, sync_every=strategy.sync_every)
    return optimizer


class AdasumStrategy(tf.distribute.MirroredStrategy):
    """Data parallelism over local devices (GPUs, or logical CPUs) with Adasum after the optimizer.

    Args:
        devices: device names, as for MirroredStrategy; default all GPUs, or the CPU.
        sync_every: local steps between Adasum combinations, for optimizers it wraps.
        cross_device_ops: what MirroredStrategy uses for everything but model updates (metrics, ...).

    Example:
        >>> strategy = tf_adasum.AdasumStrategy()
        >>> with strategy.scope():
        ...     model = make_model()
        ...     model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="sparse_categorical_crossentropy")
        >>> model.fit(dataset, epochs=3)
    """

    def __init__(
        self,
        devices: list[str] | None = None,
        sync_every: int = 1,
        cross_device_ops: tf.distribute.CrossDeviceOps | None = None,
    ) -> None:
        check_sync_every(sync_every)
        # First: the TF engine must configure the collective runtime before TensorFlow's context starts.
        self.comm = distributed.init()
        if cross_device_ops is None and not tf.config.list_logical_devices("GPU"):
            # NCCL needs GPUs; on CPUs reduce through one device, as MirroredStrategy's users expect.
            cross_device_ops = tf.distribute.ReductionToOneDevice()
        if self.comm.size > 1:
            devices = devices or [_local_device(self.comm)]
            if len(devices) != 1:
                raise ValueError(
                    f"across processes AdasumStrategy uses one device per process, got {len(devices)} "
                    f"({devices}); start one process per GPU (mpirun -np <GPUs>, or one TF_CONFIG task each)"
                )
        super().__init__(devices=devices, cross_device_ops=cross_device_ops)
        _compat.quiet_per_device_iterators()  # or epoch boundaries stall with many replicas
        self.sync_every = sync_every
        # Keras's compile() resolves its optimizer through this function.
        keras_optimizers.get = _get_optimizer

    def experimental_distribute_dataset(self, dataset: tf.data.Dataset, options: Any = None) -> Any:
        """Each process takes its contiguous share of every global batch, then splits it over replicas."""
        if self.comm.size > 1:
            rank, size = self.comm.rank, self.comm.size

            def share(t: tf.Tensor) -> tf.Tensor:
                n = tf.shape(t)[0]
                return t[(n * rank) // size : (n * (rank + 1)) // size]

            def my_part(*element: Any) -> Any:
                parts = tf.nest.map_structure(share, element)
                return parts[0] if len(parts) == 1 else parts

            dataset = dataset.map(my_part)
        return super().experimental_distribute_dataset(dataset, options)

    def reduce(self, reduce_op: Any, value: Any, axis: Any) -> Any:
        """As MultiWorkerMirroredStrategy: across all replicas of all processes.

        Keras reads its metrics (sync-on-read variables) through this, so epoch logs, History and
        callbacks such as EarlyStopping see the same global values on every process.
        """
        local = super().reduce(reduce_op, value, axis)
        if self.comm.size == 1:
            return local
        op = tf.distribute.ReduceOp(reduce_op) if isinstance(reduce_op, str) else reduce_op
        wide = tf.cast(local, tf.float64) if local.dtype.is_floating else local
        total = distributed.allreduce(
            wide, op=distributed.Average if op == tf.distribute.ReduceOp.MEAN else distributed.Sum
        )
        return tf.cast(total, local.dtype)

    def run(self, fn: Any, args: Any = (), kwargs: Any = None, options: Any = None) -> Any:
        if not _is_keras_train_or_test_step(fn):
            return super().run(fn, args=args, kwargs=kwargs, options=options)
        model = getattr(fn, "python_function", fn).__self__
        trains = getattr(fn, "python_function", fn).__name__ == "train_step"
        if trains:
            _check_adasum_optimizer(model.optimizer)
        if self.comm.size > 1:
            # The per-batch logs too: a callback that stops on them (TerminateOnNaN) must stop
            # everywhere. After a train step, the model's non-trained state (BatchNorm moving statistics)
            # is averaged over processes, as MirroredStrategy averages it over replicas.
            step = fn

            def step_with_global_logs(*a: Any, **k: Any) -> Any:
                logs = step(*a, **k)
                if trains:
                    _average_state_over_processes(model.non_trainable_variables)
                return average_logs(logs)

            fn = step_with_global_logs
        return super().run(fn, args=args, kwargs=kwargs, options=options)


def _check_adasum_optimizer(optimizer: Any) -> None:
    """Refuses a train step that would silently average gradients instead of combining with Adasum."""
    # Mixed precision wraps it once more: LossScaleOptimizer(AdasumOptimizer(...)).
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    if not isinstance(inner, AdasumOptimizer):
        raise ValueError(
            f"AdasumStrategy is training with {type(inner).__name__}, not an AdasumOptimizer, which would "
            "average the replicas' gradients as MirroredStrategy does: compile the model inside "
            "strategy.scope() with a plain Keras optimizer (it is wrapped for you), or pass "
            "tf_adasum.AdasumOptimizer(your_optimizer)"
        )


def _local_device(comm: Any) -> str:
    gpus = tf.config.list_logical_devices("GPU")
    if gpus:
        return gpus[comm.local_rank % len(gpus)].name
    return tf.config.list_logical_devices("CPU")[0].name


def _is_keras_train_or_test_step(fn: Any) -> bool:
    # Keras's trainer runs the model's bound train_step / test_step; their outputs are the logs.
    # predict_step and users' own functions pass untouched.
    import keras

    fn = getattr(fn, "python_function", fn)
    return isinstance(getattr(fn, "__self__", None), keras.Model) and fn.__name__ in (
        "train_step",
        "test_step",
    )


def _average_state_over_processes(variables: list[Any]) -> None:
    state = [v for v in variables if v.dtype in ("float16", "bfloat16", "float32", "float64")]
    if not state:
        return
    means = distributed.allreduce([v.value for v in state], op=distributed.Average)
    for variable, mean in zip(state, means, strict=True):
        variable.assign(mean)
