"""AdasumStrategy: MirroredStrategy whose replicas combine their updates with Adasum.

Use it where MirroredStrategy goes. A plain Keras optimizer compiled under its scope becomes an
AdasumOptimizer, so each replica steps on its own and the deltas are combined with Adasum; metrics,
losses and BatchNorm statistics keep MirroredStrategy's sums and means.

Custom training loops work too (TensorFlow's "Custom training with tf.distribute.Strategy" with the
one-line change): a plain optimizer whose apply_gradients runs inside strategy.run steps as an
AdasumOptimizer's inner optimizer (adasum_for), built on its first step; nothing under this strategy
sums the replicas' gradients (refuse_gradient_mean).

Across processes (mpirun, horovodrun, or TF_CONFIG), each process holds one replica (Horovod's layout,
one process per GPU) or several (MultiWorkerMirroredStrategy's, one process per machine), and the
counts may differ. The model updates cross processes inside the optimizer (the tree over every
replica of every process); each process reads its contiguous share of every global batch, in
proportion to its replicas; num_replicas_in_sync counts every replica of every process, as under
MultiWorkerMirroredStrategy, so loss scaling and tf.nn.compute_average_loss mean the global batch;
the logs of Keras's train and test steps, and BatchNorm's statistics after each train step, are
averaged over every replica of every process. No part of this goes through
MultiWorkerMirroredStrategy's fit path, which Keras 3 breaks (keras-team/keras#20585).

A tf_keras (Keras 2) model compiled under the scope trains alike: its optimizer's apply_gradients runs
each replica's own step and the sync (training/keras2_sync.py).
"""

from __future__ import annotations

import collections
import contextlib
from typing import Any

import keras
import tensorflow as tf

from tf_adasum import _compat, distributed
from tf_adasum.algorithm import agreement
from tf_adasum.algorithm.compression import check_compression
from tf_adasum.common.errors import HookError
from tf_adasum.common.variables import have_values
from tf_adasum.training import keras2_sync, loss_scaling, model_sync, optimizer_options
from tf_adasum.training.keras_consensus import (
    average_logs,
    average_state_over_processes,
    reduce_over_processes,
)
from tf_adasum.training.optimizer import AdasumOptimizer, WrappedOptimizer

# How many of its latest distributed iterators an AdasumStrategy holds on to (its _recent_iterators).
#
# Why: Keras's fit and evaluate take one batch from a fresh iterator (their symbolic build) and drop it
# at once. Every MirroredStrategy dataset is read through TensorFlow's MultiDeviceIterator, and
# destroying one while its background thread is inside the host iterator's GetNext kills the process
# (SIGSEGV in MultiDeviceBuffer::BackgroundThread, a jump to address 0x1, while the main thread is in
# ~MultiDeviceIterator): 7 of 15 two-process runs of 40 fit-and-evaluate rounds crashed, and CI lost a
# test to it. Held a few iterators longer, the background thread has normally filled its buffer or
# reached the end of the data and waits, and destroying the iterator is safe (0 of 11 such runs
# crashed). A mitigation by count, not a guarantee. It costs each held iterator its prefetched batches.
KEPT_ITERATORS = 4


def _reduced_across_processes(strategy: AdasumStrategy, reduce_op: Any, local: list[Any]) -> list[Any] | None:
    """The strategy's batched reductions made global over every replica of every process, as
    MultiWorkerMirroredStrategy's are: ReplicaContext.all_reduce (global-norm clipping, a custom loop's
    metrics, BatchNormalization(synchronized=True)) and extended.batch_reduce_to (installed through
    _compat.install_batch_reduction). None keeps the local results.

    MirroredStrategy reduces inside its process only, and a custom loop across processes silently got
    one process's sum. Each local result is reduced over processes in one collective per call (a MEAN
    weighs each process by its replicas). Inside model_sync.within_processes they stay local: tf_adasum's own
    local reductions. extended.reduce_to, which TensorFlow also uses for a variable's aggregation inside
    a replica, stays local.
    """
    if strategy.comm.size == 1 or strategy.reductions_within_processes or _compat.in_symbolic_build():
        return None
    # Every local replica holds the process's result: the first's, dense (IndexedSlices too).
    firsts = [tf.convert_to_tensor(strategy.experimental_local_results(r)[0]) for r in local]
    mean = reduce_op == tf.distribute.ReduceOp.MEAN
    return reduce_over_processes(firsts, mean, strategy.process_weights())


def wrap_under_adasum_strategy(optimizer: Any) -> Any:
    """What keras.optimizers.get returns (tf_adasum/__init__.py installs it): under an AdasumStrategy's
    scope, the optimizer wrapped in AdasumOptimizer; anywhere else, the optimizer itself.

    A LossScaleOptimizer the user passed keeps its settings and goes around the AdasumOptimizer, as
    compile() puts it under the mixed_float16 policy: LossScaleOptimizer(AdasumOptimizer(optimizer)).
    """
    strategy = tf.distribute.get_strategy()
    if not isinstance(strategy, AdasumStrategy) or not isinstance(optimizer, keras.optimizers.Optimizer):
        return optimizer
    inner = _compat.loss_scale_inner(optimizer)
    if isinstance(inner, AdasumOptimizer):
        return optimizer
    wrapper = WrappedOptimizer.wrapping(inner)
    adasum = wrapper if isinstance(wrapper, AdasumOptimizer) else strategy.adasum_optimizer(inner)
    if inner is optimizer:
        return adasum
    return keras.optimizers.LossScaleOptimizer(
        adasum,
        initial_scale=optimizer.initial_scale,
        dynamic_growth_steps=optimizer.dynamic_growth_steps,
        name=optimizer.name,
    )


def adopt_optimizer_compiled_outside(model: Any) -> None:
    """Makes the optimizer of a model created under an AdasumStrategy but compiled outside its scope an
    AdasumOptimizer, as compile() inside the scope would have (tf_adasum/__init__.py calls this before
    Keras makes a train function, so at each fit, eagerly).

    MirroredStrategy trains such a model when compile() was given a name ("sgd"), whose optimizer it
    creates outside the scope; so does this, with a copy of that optimizer made under the scope, from
    its config. (An optimizer object created outside the scope fails under both, in Keras's first
    build, with TensorFlow's "Mixing different tf.distribute.Strategy objects".) Before the first
    fit, the optimizer has not stepped: the copy loses nothing.
    """
    strategy = getattr(model, "distribute_strategy", None)
    optimizer = getattr(model, "optimizer", None)
    if not isinstance(strategy, AdasumStrategy) or not isinstance(optimizer, keras.optimizers.Optimizer):
        return
    inner = _compat.loss_scale_inner(optimizer)
    if isinstance(inner, WrappedOptimizer) or _compat.strategy_of(inner) is strategy:
        return  # compiled inside the scope; AdasumStrategy.run refuses what does not combine with Adasum
    with strategy.scope():
        copy = keras.optimizers.deserialize(keras.optimizers.serialize(optimizer))
        model.optimizer = wrap_under_adasum_strategy(copy)
        if have_values(model.trainable_variables):
            model.optimizer.build(model.trainable_variables)


def losses_unscaled_for(model: Any) -> contextlib.AbstractContextManager[Any]:
    """The context a Keras train function of `model` runs in (tf_adasum/__init__.py installs it): where
    the model runs Adasum (under an AdasumStrategy, or with an AdasumOptimizer under any strategy),
    Keras's loss scaling by the number of replicas is off, so each replica steps on its own loss
    (tf_adasum/training/loss_scaling.py). Where AdasumCallback syncs through the model's optimizer (no
    strategy, a plain optimizer: the two never meet), the step is marked as the callback's, so that a
    second plain optimizer stepping in it is refused (optimizer_options.refuse_unsynced_optimizer)."""
    strategy = getattr(model, "distribute_strategy", None)
    stepping = _compat.loss_scale_inner(getattr(model, "optimizer", None))
    if isinstance(strategy, AdasumStrategy) or isinstance(stepping, AdasumOptimizer):
        return loss_scaling.keras_losses_unscaled(strategy)
    if model_sync.extended_by_callback(stepping):
        return optimizer_options.callback_steps(stepping)
    return contextlib.nullcontext()


def adasum_for(optimizer: Any, trainable_variables: Any) -> WrappedOptimizer | None:
    """The optimizer whose step a Keras optimizer's apply runs instead, or None for its own
    (tf_adasum/__init__.py installs this as _compat.install_optimizer_apply's route).

    - An optimizer a tf_adasum wrapper wraps runs as that wrapper's step, unless the wrapper is taking
      it now: a script that kept the optimizer it wrapped still syncs.
    - Under an AdasumStrategy, in replica context (inside strategy.run), a plain optimizer's step would
      be MirroredStrategy's mean of gradients; it runs as the inner step of an AdasumOptimizer instead,
      created on the optimizer's first step.
    - In a train step AdasumCallback syncs through the model's optimizer (losses_unscaled_for marks it),
      another plain optimizer's step is refused (optimizer_options.refuse_unsynced_optimizer).
    """
    wrapper = WrappedOptimizer.wrapping(optimizer)
    if wrapper is not None:
        return None if wrapper.is_stepping() else wrapper
    optimizer_options.refuse_unsynced_optimizer(optimizer)
    strategy = tf.distribute.get_strategy()
    if not isinstance(strategy, AdasumStrategy) or tf.distribute.in_cross_replica_context():
        return None
    # Created once, in cross-replica context: every replica's thread meets this merge_call on its first step.
    return tf.distribute.get_replica_context().merge_call(lambda s: s.adasum_optimizer_for(optimizer))


def refuse_gradient_mean(optimizer: Any) -> None:
    """Raises where an optimizer would sum its replicas' gradients under an AdasumStrategy (installed by
    tf_adasum/__init__.py as _compat.install_gradient_sum_guard's check): never a silent mean."""
    strategy = tf.distribute.get_strategy()
    if isinstance(strategy, AdasumStrategy) and not tf.distribute.in_cross_replica_context():
        raise ValueError(
            f"AdasumStrategy: optimizer {optimizer.name!r} ({type(optimizer).__name__}) would average its "
            "replicas' gradients as MirroredStrategy does, not run Adasum after its step. Wrap it: "
            f"`optimizer = tf_adasum.AdasumOptimizer(keras.optimizers.{type(optimizer).__name__}(...))`, and "
            "step the wrapper"
        )


def _refuse_keras_2_gradient_sum(optimizer: Any) -> None:
    """Raises where a tf_keras optimizer would still sum its replicas' gradients under an AdasumStrategy:
    its steps are routed to each replica's own (keras2_sync), so this is tf_keras's LossScaleOptimizer,
    or a script's own call of aggregate_gradients."""
    strategy = tf.distribute.get_strategy()
    if isinstance(strategy, AdasumStrategy) and not tf.distribute.in_cross_replica_context():
        _compat.refuse_keras_2("AdasumStrategy", f"optimizer {type(optimizer).__name__}")


class AdasumStrategy(tf.distribute.MirroredStrategy):
    """Data parallelism over local devices (GPUs, or logical CPUs) with Adasum after the optimizer.

    Args:
        devices: device names, as for MirroredStrategy; default all GPUs, or the CPU.
        sync_every: local steps between Adasum combinations, for optimizers it wraps.
        cross_device_ops: what MirroredStrategy uses for everything but model updates (metrics, ...),
            and with local_reduction="mean" for the mean of each process's replicas too.
        local_reduction: how each process's replicas combine across processes. "adasum" (default): the
            exact tree over every replica of every process. "mean": each process's replicas are averaged
            (cross_device_ops: NCCL between GPUs), then Adasum runs over the processes, Horovod's
            hierarchical Adasum (any number of processes and of replicas each); scale the one-device
            learning rate by the replicas per process, as Horovod's guide says for it.
        outer_optimizer: None, or a Keras optimizer that each sync steps, from the weights of the last
            sync, on the combined deltas (negated: a pseudo-gradient); local SGD with an outer optimizer,
            for slow links (docs/training/outer-optimizer.md). Each optimizer the strategy wraps gets
            its own copy, made under the strategy's scope; its state is saved with the model's.
        combine: how a sync combines the replicas' deltas: "adasum" (default), or "mean" (their
            average over every replica of every process, as DiLoCo publishes it, to compare with).
        compression: "none" (default), or "fp16" or "bf16": float32 and float64 deltas cross processes
            as float16 or bfloat16 (the kernels accumulate in float32), for optimizers it wraps.

    Examples:
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
        local_reduction: str = "adasum",
        outer_optimizer: Any = None,
        combine: str = "adasum",
        compression: str = "none",
    ) -> None:
        model_sync.check_sync_every(sync_every)
        self.compression = check_compression(compression)
        self.combine = model_sync.check_combine(combine)
        self.outer_optimizer = model_sync.check_outer_optimizer(outer_optimizer)
        if local_reduction not in ("adasum", "mean"):
            raise ValueError(f'local_reduction must be "adasum" or "mean", got {local_reduction!r}')
        _compat.require_tensorflow_backend("AdasumStrategy")
        _compat.require()
        # First: the TF engine must configure the collective runtime before TensorFlow's context starts.
        self.comm = distributed.init()
        if cross_device_ops is None and not own_devices("GPU", self.comm.rank):
            # NCCL needs GPUs; on CPUs reduce through one device, as MirroredStrategy's users expect.
            cross_device_ops = tf.distribute.ReductionToOneDevice()
        if self.comm.size > 1:
            if devices is None:
                # Never MirroredStrategy's default here: with TF_CONFIG set it takes every worker's devices
                # (the TF engine's, and tf_adasum.run's), and its first variable on another host's device
                # kills the process (SIGSEGV), which is how a job of one process per host died.
                devices = _default_devices(self.comm)
            _refuse_other_processes_devices(devices, self.comm.rank)
        super().__init__(devices=devices, cross_device_ops=cross_device_ops)
        _compat.install_batch_reduction(self.extended, _reduced_across_processes)
        self.reductions_within_processes = 0  # see model_sync.within_processes
        _compat.quiet_per_device_iterators()  # or epoch boundaries stall with many replicas
        self._recent_iterators: collections.deque[Any] = collections.deque(maxlen=KEPT_ITERATORS)
        self.sync_every = sync_every
        self.local_reduction = local_reduction  # read by model_sync.sync_deltas
        # Every process's number of replicas, in rank order; they may differ.
        local = len(self.extended.worker_devices)
        self.replica_counts = (
            [local]
            if self.comm.size == 1
            else agreement.gather_objects(self.comm, local, "AdasumStrategy replica count check")
        )

    # model_sync.syncs: every optimizer step under this strategy ends in an Adasum sync.
    _tf_adasum_syncs = True

    @property
    def num_replicas_in_sync(self) -> int:
        """Every replica of every process, as MultiWorkerMirroredStrategy counts them.

        tf.nn.compute_average_loss and a script's global batch size (per-replica batch times this) then
        mean the job's global batch. Each local step is still the step a single worker would take on its
        replica's batch: in Keras's train step of an Adasum model the losses are not scaled by this
        number, and in a custom loop AdasumOptimizer multiplies the gradients back by it
        (loss_scaling.gradient_factor). Each process still splits its share over its own devices.
        """
        return sum(self.replica_counts)

    def _my_rows(self) -> tuple[int, int]:
        """This process's replicas' place among all: (the first one's global index, the total)."""
        return sum(self.replica_counts[: self.comm.rank]), sum(self.replica_counts)

    def adasum_optimizer(self, inner: Any) -> AdasumOptimizer:
        """The AdasumOptimizer this strategy wraps `inner` in: its sync_every, combine, and a fresh copy
        of its outer optimizer (under its scope, so that the outer state is mirrored)."""
        with self.scope():
            outer = None if self.outer_optimizer is None else model_sync.outer_copy(self.outer_optimizer)
            return AdasumOptimizer(
                inner,
                sync_every=self.sync_every,
                outer_optimizer=outer,
                combine=self.combine,
                compression=self.compression,
            )

    def adasum_optimizer_for(self, optimizer: Any) -> WrappedOptimizer:
        """The AdasumOptimizer a plain optimizer steps through in a strategy.run loop, created on its first
        step; it builds itself there, eagerly (AdasumOptimizer._build_at_the_first_step)."""
        wrapper = WrappedOptimizer.wrapping(optimizer)
        if wrapper is None:
            with tf.init_scope():  # in cross-replica context: eagerly, under this strategy
                wrapper = self.adasum_optimizer(optimizer)
            # tf.train.Checkpoint(optimizer=optimizer) then holds every replica's optimizer state too,
            # and the outer optimizer's.
            _compat.track(optimizer, wrapper.replica_state, "tf_adasum_replica_state")
            if wrapper.outer_optimizer is not None:
                _compat.track(optimizer, wrapper.outer_optimizer, "tf_adasum_outer")
        return wrapper

    def experimental_distribute_dataset(self, dataset: tf.data.Dataset, options: Any = None) -> Any:
        """Each process takes its contiguous share of every global batch, in proportion to its replicas,
        then splits it over them: global replica i (counting every process's in rank order) takes the
        i-th of equal parts, as MultiWorkerMirroredStrategy's replicas do."""
        if self.comm.size > 1:
            first, total = self._my_rows()
            last = first + self.replica_counts[self.comm.rank]

            def share(t: tf.Tensor) -> tf.Tensor:
                n = tf.shape(t)[0]
                return t[(n * first) // total : (n * last) // total]

            def my_part(*element: Any) -> Any:
                parts = tf.nest.map_structure(share, element)
                return parts[0] if len(parts) == 1 else parts

            dataset = dataset.map(my_part)
        return _compat.hold_iterators(
            super().experimental_distribute_dataset(dataset, options), self._recent_iterators.append
        )

    def distribute_datasets_from_function(self, dataset_fn: Any, options: Any = None) -> Any:
        """As MultiWorkerMirroredStrategy: each process is one input pipeline of the job.

        dataset_fn receives a tf.distribute.InputContext whose num_input_pipelines and
        input_pipeline_id count processes and whose num_replicas_in_sync counts every replica of every
        process, so `dataset.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)` and
        `ctx.get_per_replica_batch_size(global_batch)` give each process its share.
        """
        if self.comm.size == 1:
            return _compat.hold_iterators(
                super().distribute_datasets_from_function(dataset_fn, options), self._recent_iterators.append
            )
        rank, size = self.comm.rank, self.comm.size

        def for_this_process(context: tf.distribute.InputContext) -> tf.data.Dataset:
            return dataset_fn(
                tf.distribute.InputContext(
                    num_input_pipelines=size * context.num_input_pipelines,
                    input_pipeline_id=rank * context.num_input_pipelines + context.input_pipeline_id,
                    num_replicas_in_sync=self.num_replicas_in_sync,
                )
            )

        return _compat.hold_iterators(
            super().distribute_datasets_from_function(for_this_process, options),
            self._recent_iterators.append,
        )

    def reduce(self, reduce_op: Any, value: Any, axis: Any) -> Any:
        """As MultiWorkerMirroredStrategy: across all replicas of all processes.

        Keras reads its metrics (sync-on-read variables) through this, so epoch logs, History and
        callbacks such as EarlyStopping see the same global values on every process.
        """
        # TensorFlow takes the enum's names in any case ("sum", "SUM", "Mean"), as MirroredStrategy does.
        op = tf.distribute.ReduceOp(reduce_op.upper()) if isinstance(reduce_op, str) else reduce_op
        local = super().reduce(op, value, axis)
        if self.comm.size == 1 or _compat.in_symbolic_build():
            # Keras's build before fit reduces one batch for its shapes only, and only where a process
            # has several replicas: across processes it would meet nothing where one has a single one.
            return local
        mean, weights = op == tf.distribute.ReduceOp.MEAN, self.process_weights()
        return reduce_over_processes(local, mean, weights)  # one collective per kind of dtype

    def process_weights(self) -> list[float] | None:
        """Each process's share of the replicas, where they differ (a mean over processes then weighs
        each by it); None where every process holds as many."""
        counts = self.replica_counts
        return None if len(set(counts)) == 1 else [c / sum(counts) for c in counts]

    def run(self, fn: Any, args: Any = (), kwargs: Any = None, options: Any = None) -> Any:
        # tf_keras: its optimizers' steps run as AdasumOptimizer's do (keras2_sync); a gradient sum
        # anywhere else is refused.
        _compat.install_keras_2_step_route(keras2_sync.step_under_adasum_strategy)
        _compat.install_keras_2_mixing_guard()
        _compat.install_keras_2_gradient_sum_guard(_refuse_keras_2_gradient_sum)
        step = _compat.keras_step(fn)
        running = _compat.keras_function_running()
        if step is None and running is not None:
            raise HookError(
                f"Keras's {running} function ran {fn!r} through strategy.run, not the model's bound "
                f"{running}_step that tf_adasum recognises (Keras {keras.__version__}): AdasumStrategy "
                f"cannot check its optimizer or average its logs across processes. A decorator on train_step "
                f"that hides its name does this too; otherwise, tf_adasum is tested with "
                f"keras>={_compat.TESTED_KERAS[0]},<{_compat.TESTED_KERAS[1]}"
            )
        if step is None:
            return super().run(fn, args=args, kwargs=kwargs, options=options)
        model, kind = step
        trains = kind == "train"
        if trains:
            _check_adasum_optimizer(model.optimizer)
        outputs = super().run(fn, args=args, kwargs=kwargs, options=options)
        if self.comm.size == 1:
            return outputs
        # Once per process, in cross-replica context, after every replica's step (in a replica's
        # context each replica thread would issue its own collectives): the model's non-trained state
        # (BatchNorm moving statistics, per replica under Keras 3) and the logs, every float scalar,
        # averaged over every replica of every process, so that every process holds the same model and a
        # callback that stops on the logs (TerminateOnNaN) stops everywhere.
        weights = self.process_weights()
        if trains:
            average_state_over_processes(model.non_trainable_variables, weights)
        return average_logs(self._local_means(outputs), weights)

    def _local_means(self, outputs: Any) -> Any:
        """`outputs` with each per-replica float scalar replaced by its mean over this process's
        replicas (what Keras's reduce_per_replica would take locally)."""

        def mean(value: Any) -> Any:
            parts = self.experimental_local_results(value)
            if len(parts) > 1 and all(_is_float_scalar_tensor(p) for p in parts):
                return tf.reduce_mean(tf.stack(parts))
            return value

        return tf.nest.map_structure(mean, outputs, expand_composites=False)


def _check_adasum_optimizer(optimizer: Any) -> None:
    """Refuses a train step that would silently average gradients instead of combining with Adasum."""
    # Mixed precision wraps it once more: LossScaleOptimizer(AdasumOptimizer(...)).
    inner = _compat.loss_scale_inner(optimizer)
    if not isinstance(inner, AdasumOptimizer):
        raise ValueError(
            f"AdasumStrategy is training with {type(inner).__name__}, not an AdasumOptimizer, which would "
            "average the replicas' gradients as MirroredStrategy does: compile the model inside "
            "strategy.scope() with a plain Keras optimizer (it is wrapped for you), or pass "
            "tf_adasum.AdasumOptimizer(your_optimizer)"
        )


def _refuse_other_processes_devices(devices: list[str], rank: int) -> None:
    """Under the TF engine TensorFlow lists every process's devices (tf.config.list_logical_devices):
    a replica on another process's device would run there. Raises naming them."""
    theirs = [d for d in devices if "/task:" in d and f"/task:{rank}/" not in d]
    if theirs:
        raise ValueError(
            f"AdasumStrategy(devices=...) on rank {rank} got other processes' devices {theirs}: give each "
            f"process its own (names with /task:{rank}/, or without a task), e.g. "
            f"[d.name for d in tf.config.list_logical_devices('GPU') if '/task:{rank}/' in d.name]"
        )


def _is_float_scalar_tensor(value: Any) -> bool:
    return isinstance(value, tf.Tensor) and value.dtype.is_floating and value.shape.rank == 0


def own_devices(kind: str, rank: int) -> list[str]:
    """This process's logical devices of a kind ("GPU", "CPU"), by name.

    Under the TF engine TensorFlow lists every worker's devices, this one's first
    (/job:worker/replica:0/task:R/...); only those of task `rank` are this process's. Elsewhere every
    listed device is.
    """
    names = [d.name for d in tf.config.list_logical_devices(kind)]
    return [n for n in names if "/task:" not in n or f"/task:{rank}/" in n]


def _default_devices(comm: Any) -> list[str]:
    """A process's replicas when it names none, as each layout's users expect.

    - Several processes on this host (Horovod's layout, one process per GPU): the local_rank-th of its
      GPUs, or its CPU.
    - One process on this host (MultiWorkerMirroredStrategy's, one process per machine): all of its
      GPUs, or its CPU.
    """
    gpus = own_devices("GPU", comm.rank)
    if gpus and comm.local_size > 1:
        return [gpus[comm.local_rank % len(gpus)]]
    return gpus or own_devices("CPU", comm.rank)[:1]
