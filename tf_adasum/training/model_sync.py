"""The model sync every entry point runs: anchor + Adasum(deltas) every k steps, and what goes with it.

AdasumOptimizer, AdasumCallback (and so tf_adasum.keras's DistributedOptimizer(op=Adasum)) and
AdasumStrategy all open their optimizer step with start_window and end it in sync_if_due (with use_ema,
just before the moving average: optimizer_options.step_then_sync): every `sync_every` steps (with
gradient accumulation, updates) the deltas of every replica since the window's first step are combined
by the contract tree over every replica of every process, and every replica takes anchor + the combined
delta. The anchors are taken from the weights at the window's first step, and again wherever
something other than the optimizer wrote a weight (set_weights, assign, a restore), so the combined
update is always the sum of the optimizer's own steps. Also here: the statistics
OrthogonalityMonitor reads, the global overflow decision of mixed precision, which optimizers sync,
and the argument checks the entry points share.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tf_adasum import _compat, distributed
from tf_adasum.algorithm import agreement
from tf_adasum.algorithm.compression import narrowed, widened
from tf_adasum.common.errors import NonFiniteUpdateError
from tf_adasum.common.variables import replica_values, tf_variable, variable_name
from tf_adasum.ops import squared_norms

# The mark of an optimizer that syncs: a class attribute of tf_adasum's wrappers and of AdasumStrategy
# (under which every optimizer step syncs), and an attribute of the apply that AdasumCallback installs
# on the user's optimizer during fit.
SYNCS = "_tf_adasum_syncs"


def check_positive_integer(name: str, value: Any) -> int:
    """Returns value if it is a positive int (not a bool), else raises ValueError naming it."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def check_sync_every(sync_every: Any) -> int:
    """The one check of `sync_every` for AdasumOptimizer, AdasumStrategy and AdasumCallback."""
    return check_positive_integer("sync_every", sync_every)


COMBINES = ("adasum", "mean")


def check_combine(combine: Any) -> str:
    """The one check of `combine`: how a sync combines the replicas' deltas, "adasum" (the contract
    tree) or "mean" (their average over every replica of every process: local SGD as DiLoCo publishes
    it, to compare with)."""
    if combine not in COMBINES:
        raise ValueError(f"combine must be one of {COMBINES}, got {combine!r}")
    return str(combine)


def check_outer_optimizer(outer: Any, keras_2: bool = False) -> Any:
    """None, or a Keras 3 optimizer to step the combined deltas with (a name or a config, as
    keras.optimizers.get takes them, is made into one); with `keras_2`, a tf_keras optimizer too
    (AdasumCallback's, for a tf_keras model). Returns the optimizer."""
    if outer is None:
        return None
    if isinstance(outer, dict):
        outer = keras.optimizers.deserialize(outer)
    elif isinstance(outer, str):
        outer = keras.optimizers.get(outer)
    if keras_2 and _compat.keras_2_name(outer) is not None:
        return outer  # checked against the model it steps, before the first step (_compat.hang_outer)
    _compat.require_keras_3(outer, "outer_optimizer")
    if not isinstance(outer, keras.optimizers.Optimizer) or isinstance(
        outer, keras.optimizers.LossScaleOptimizer
    ):
        got = f"{type(outer).__module__}.{type(outer).__name__}"
        raise TypeError(
            "outer_optimizer is a plain Keras optimizer that steps the combined deltas (keras.optimizers."
            f"SGD(0.5, momentum=0.5, nesterov=True), ...), got {got}"
        )
    if getattr(outer, "_tf_adasum_syncs", False):
        raise ValueError(
            f"outer_optimizer {outer.name!r} is a tf_adasum wrapper: the outer step runs once the replicas "
            "are combined, on every process alike; pass the plain optimizer"
        )
    return outer


def outer_copy(outer: Any) -> Any:
    """A fresh outer optimizer of `outer`'s config, created here (under the caller's strategy scope,
    where its state must live): an optimizer made before the strategy cannot keep mirrored state."""
    return keras.optimizers.deserialize(keras.optimizers.serialize(outer))


class SyncStats:
    """Per variable, at the last sync: the sum over every replica of |d_i|^2, and |adasum(d_1..d_n)|^2.

    Their ratio is the orthogonality OrthogonalityMonitor reports: 1 when the replicas' updates were
    orthogonal (Adasum adds them), 1/n when they were equal (Adasum returns one of them). Recorded only
    while a monitor asks (enable_sync_stats), at the cost of one norm pass over each delta and over the
    result, and across processes one all-reduce of one float64 per variable; the updates are not
    reduced a second time.
    """

    def __init__(self, variables: list[Any]) -> None:
        n = len(variables)
        self.names = [variable_name(v) for v in variables]
        # Created under the model's strategy: assigned once per sync, in cross-replica context.
        self.deltas_sq = tf.Variable(tf.zeros([n], tf.float64), trainable=False, name="adasum_deltas_sq")
        self.combined_sq = tf.Variable(tf.zeros([n], tf.float64), trainable=False, name="adasum_combined_sq")
        self.syncs = tf.Variable(tf.constant(0, tf.int64), trainable=False, name="adasum_syncs")

    def record(self, deltas_sq: tf.Tensor, combined_sq: tf.Tensor) -> None:
        self.deltas_sq.assign(deltas_sq)
        self.combined_sq.assign(combined_sq)
        self.syncs.assign_add(1)


_STATS: weakref.WeakKeyDictionary[Any, SyncStats] = weakref.WeakKeyDictionary()


def enable_sync_stats(optimizer: Any, stats: SyncStats | None) -> None:
    """Makes the syncs of `optimizer` (an AdasumOptimizer, or one AdasumCallback extends) record stats.

    Takes effect in train functions traced from now on; None stops the recording.
    """
    if stats is None:
        _STATS.pop(optimizer, None)
    else:
        _STATS[optimizer] = stats


def sync_stats(optimizer: Any) -> SyncStats | None:
    return _STATS.get(optimizer)


def sync_deltas(
    distribution: tf.distribute.Strategy,
    variables: list[Any],
    anchors: list[Any],
    compression: str = "none",
    stats: SyncStats | None = None,
    outer: Any = None,
    combine: str = "adasum",
) -> tf.Tensor:
    """Replaces every replica's weights by `anchor + Adasum(w_replica - anchor)`.

    The deltas since the last sync are combined with the contract tree over every replica of every
    process (distributed.allreduce_replicas); every replica and every process then holds the same
    weights, bitwise. Runs in cross-replica context (or with no strategy). With `stats`, also
    records the squared norms OrthogonalityMonitor reads.

    With combine="mean", the deltas are averaged over every replica of every process instead. With an
    `outer` optimizer (built on `variables`), the weights go back to the anchors and the outer optimizer
    steps them on the pseudo-gradient `-combined` (DiLoCo's outer step): its state is one copy, the same
    on every replica and process, since every one of them steps it on the same values.
    """
    per_variable = [replica_values(v) for v in variables]
    anchor_values = [replica_values(a)[0] for a in anchors]
    replicas = len(per_variable[0]) if per_variable else 0
    per_replica = [
        [tf.identity(values[r]) - anchor for values, anchor in zip(per_variable, anchor_values, strict=True)]
        for r in range(replicas)
    ]
    names = [variable_name(v) for v in variables]
    with agreement.one_step_of_syncs():
        if combine == "mean":
            delta = mean_over_every_replica(per_replica, names, compression)
        else:
            delta = adasum_over_every_replica(distribution, per_replica, variables, names, compression)
    deltas_sq = tf.add_n([squared_norms(d) for d in per_replica]) if stats is not None else None
    if distributed.init().size > 1:
        if deltas_sq is not None:
            deltas_sq = distributed.allreduce(deltas_sq, op=distributed.Sum)
    if stats is not None:
        stats.record(deltas_sq, squared_norms(delta))
    if outer is not None:
        outer_step(distribution, outer, variables, anchor_values, delta)
        return tf.constant(True)
    for variable, anchor_value, d in zip(variables, anchor_values, delta, strict=True):
        distribution.extended.update(
            tf_variable(variable), lambda var, new: var.assign(new), args=(anchor_value + d,), group=False
        )
    return tf.constant(True)


def adasum_over_every_replica(
    distribution: tf.distribute.Strategy,
    per_replica: list[list[tf.Tensor]],
    variables: list[Any],
    names: list[str],
    compression: str,
) -> list[tf.Tensor]:
    """Each tensor's Adasum over every replica of every process by the contract tree (per_replica[j]:
    this process's replica j's list); with AdasumStrategy(local_reduction="mean"), over each process's
    mean instead."""
    mean = len(per_replica) > 1 and getattr(distribution, "local_reduction", "adasum") == "mean"
    # In a traced step, buckets of about $TF_ADASUM_BUCKET_MB (0, the default: one call), the last
    # variables' first: each bucket's sync waits only for its own variables' updates, which wait only
    # for their own gradients, so it starts while the backward pass computes the earlier layers'.
    # Every tensor keeps its own coefficients, so no bit of the result depends on the buckets.
    delta: list[Any] = [None] * len(variables)
    for index in distributed.gradient_groups(per_replica[0] if per_replica else [], None, None, "the sync"):
        part = [[deltas[i] for i in index] for deltas in per_replica]
        if mean:
            # AdasumStrategy(local_reduction="mean"): this process's replicas averaged by TensorFlow's
            # own cross-device all-reduce (NCCL between GPUs), then Adasum over the processes.
            part = [local_mean(distribution, part, [variables[i] for i in index])]
        combined = distributed.allreduce_replicas(part, [names[i] for i in index], compression)
        for i, value in zip(index, combined, strict=True):
            delta[i] = value
    return delta


def mean_over_every_replica(
    per_replica: list[list[tf.Tensor]], names: list[str], compression: str
) -> list[tf.Tensor]:
    """Each tensor's mean over every replica of every process (per_replica[j]: this process's replica
    j's list): the local sums, this process's count of replicas, and per tensor its count of replicas
    whose delta is not finite, summed across processes in one call, so that processes holding
    different numbers of replicas weigh each replica alike, and a NaN or Inf anywhere raises
    NonFiniteUpdateError on every process before any weight is written, as the tree's does."""
    sums = [tf.add_n(list(parts)) if len(parts) > 1 else parts[0] for parts in zip(*per_replica, strict=True)]
    norms = tf.stack([squared_norms(list(r)) for r in per_replica])
    counts = tf.concat(
        [[float(len(per_replica))], tf.reduce_sum(tf.cast(~tf.math.is_finite(norms), tf.float32), 0)], 0
    )
    if distributed.init().size > 1:
        # Only the sums narrow on the wire: a count in bfloat16 is exact only up to 256 (float16 to
        # 2048), and a rounded count would scale every weight's mean wrongly without a word.
        wire = sums if compression == "none" else narrowed(sums, compression)
        *reduced, counts = distributed.allreduce(
            [*wire, counts], op=distributed.Sum, names=[*names, "the counts of replicas"]
        )
        sums = widened(reduced, sums)

    def raise_naming(bad: np.ndarray) -> np.ndarray:
        where = [f"{names[i]} ({int(n)} replica(s))" for i, n in enumerate(bad) if n > 0]
        if where:
            raise NonFiniteUpdateError(
                f"the update of some replica is not finite ({'; '.join(where)} hold NaN or Inf); every "
                f"replica stops at this step. {agreement.NONFINITE_ADVICE}"
            )
        return np.asarray(True)

    if tf.executing_eagerly():
        raise_naming(counts[1:].numpy())
        return [s / tf.cast(counts[0], s.dtype) for s in sums]
    checked = tf.numpy_function(raise_naming, [counts[1:]], tf.bool, stateful=True)
    with tf.control_dependencies([checked]):
        return [s / tf.cast(counts[0], s.dtype) for s in sums]


def outer_step(
    distribution: tf.distribute.Strategy,
    outer: Any,
    variables: list[Any],
    anchor_values: list[tf.Tensor],
    combined: list[tf.Tensor],
) -> None:
    """Every replica's weights back to the window's anchors, then one step of the outer optimizer on the
    pseudo-gradient `anchor - (anchor + combined)`, in cross-replica context (or with no strategy).

    Keras steps each replica's copy of a variable and of the outer optimizer's slots (mirrored, created
    under the strategy) with the same value, so the state stays one and the same everywhere.
    """
    # Nothing is written before the combination is through its checks (a NaN raises there): not the
    # anchors, and not the outer optimizer's iteration count, which depends on no gradient.
    with tf.control_dependencies(combined):
        for variable, anchor_value in zip(variables, anchor_values, strict=True):
            distribution.extended.update(
                tf_variable(variable), lambda var, new: var.assign(new), args=(anchor_value,), group=False
            )
        strategy = tf.distribute.has_strategy()
        with _compat.steps_in_cross_replica_context(distribution) if strategy else contextlib.nullcontext():
            if _compat.keras_2_name(outer) is None:
                outer.apply([-d for d in combined], variables)
            else:  # tf_keras's (AdasumCallback on a tf_keras model, without a strategy)
                outer.apply_gradients(zip([-d for d in combined], variables, strict=True))


def start_window(
    variables: list[Any], anchors: list[Any], iterations: Any, sync_every: int, lasts: list[Any] | None
) -> None:
    """Takes the anchors a window of `sync_every` local steps is measured from, before each local step.

    In cross-replica context (or with no strategy), before the optimizer's step; `iterations` is its
    count of steps so far. Every replica's anchor becomes its own weights:
    - at the window's first step (every step when sync_every is 1);
    - and inside a window (sync_every > 1), for each variable that something other than the optimizer
      wrote since the optimizer's last step: `lasts` holds the weights as that step (or the sync after
      it) left them (record_lasts), and any difference re-anchors the variable. set_weights, assign,
      load_weights, a restore, EarlyStopping(restore_best_weights=True) then count as the new weights,
      as under MirroredStrategy, and the steps before them as overwritten: the sync combines only the
      optimizer's own steps since. A restore that brings back `lasts` with the weights (the optimizer's
      checkpoint) resumes the window where it was.
    Costs: with sync_every 1, one copy of the weights per step, where the sync used to move the anchors;
    with sync_every > 1, at every step one comparison with `lasts`, one select into the anchors and one
    copy into `lasts`; `lasts` holds one more copy of the weights.
    """
    pairs = [
        (target, value)
        for variable, anchor in zip(variables, anchors, strict=True)
        for target, value in zip(replica_values(anchor), replica_values(variable), strict=True)
    ]

    def anchor_all() -> tf.Tensor:
        for target, value in pairs:
            target.assign(tf.identity(value))
        return tf.constant(True)

    if sync_every == 1 or lasts is None:
        anchor_all()
        return
    recorded = [before for last in lasts for before in replica_values(last)]
    # No tf.cond here: a version that rewrote the anchors only under a cond (cheaper) crashed rank 0
    # with SIGSEGV in 3 of about 45 two-process runs, under both engines. Every anchor is rewritten
    # every step instead, with the weights where the window opens or the variable was written.
    opens = tf.equal(tf.math.floormod(iterations, sync_every), 0)
    for (target, value), before in zip(pairs, recorded, strict=True):
        value = tf.identity(value)
        written = tf.reduce_any(tf.not_equal(value, tf.identity(before)))
        target.assign(tf.where(tf.logical_or(opens, written), value, tf.identity(target)))


_within_lock = threading.Lock()


@contextlib.contextmanager
def within_processes(distribution: Any) -> Iterator[None]:
    """Keeps the strategy's batched reductions (ReplicaContext.all_reduce, extended.batch_reduce_to)
    inside this process while it lasts.

    AdasumStrategy makes them global over every replica of every process, as MultiWorkerMirroredStrategy
    has them; tf_adasum's own reductions over a process's replicas run in here (the mean of
    local_reduction="mean", a local overflow count before the agreement carries it across processes).
    Every replica thread of a merge_call enters it, so it is a count, not a flag.
    """
    if not hasattr(distribution, "reductions_within_processes"):
        yield
        return
    with _within_lock:
        distribution.reductions_within_processes += 1
    try:
        yield
    finally:
        with _within_lock:
            distribution.reductions_within_processes -= 1


def local_mean(
    distribution: tf.distribute.Strategy, per_replica: list[list[tf.Tensor]], variables: list[Any]
) -> list[tf.Tensor]:
    """The mean over this process's replicas of each tensor (per_replica[j] is replica j's list), by
    the strategy's cross-device ops (MirroredStrategy's: NCCL between GPUs), in cross-replica context."""
    values = [
        distribution.experimental_distribute_values_from_function(
            lambda context, i=i: per_replica[context.replica_id_in_sync_group][i]
        )
        for i in range(len(variables))
    ]
    with within_processes(distribution):
        means = distribution.extended.batch_reduce_to(
            tf.distribute.ReduceOp.MEAN,
            [(value, tf_variable(variable)) for value, variable in zip(values, variables, strict=True)],
        )
    return [tf.identity(replica_values(mean)[0]) for mean in means]


def record_lasts(variables: list[Any], lasts: list[Any] | None) -> None:
    """After the local step and its sync: the weights as the optimizer left them, for start_window."""
    if lasts is None:
        return
    for variable, last in zip(variables, lasts, strict=True):
        for target, value in zip(replica_values(last), replica_values(variable), strict=True):
            target.assign(tf.identity(value))


def sync_if_due(
    distribution: tf.distribute.Strategy,
    variables: list[Any],
    anchors: list[Any],
    iterations: Any,
    sync_every: int,
    compression: str = "none",
    stats: SyncStats | None = None,
    outer: Any = None,
    combine: str = "adasum",
) -> None:
    """sync_deltas after every `sync_every`-th optimizer step (`iterations`, already incremented)."""

    def sync() -> tf.Tensor:
        return sync_deltas(distribution, variables, anchors, compression, stats, outer, combine)

    # In cross-replica context: a cond here may contain the collectives of the sync.
    if sync_every == 1:
        sync()
        return
    due = tf.equal(tf.math.floormod(iterations, sync_every), 0)
    tf.cond(due, sync, lambda: tf.constant(False))


def finite_everywhere(finite: tf.Tensor) -> tf.Tensor:
    """True when the gradients were finite on every replica of every process (a boolean scalar).

    Mixed precision's LossScaleOptimizer asks this (see _compat.install_global_loss_scale_finiteness)
    when it wraps a tf_adasum optimizer, whose replicas keep their own gradients: a step is skipped
    everywhere, and the loss scale halved everywhere, when any replica overflowed. Across processes
    the answer travels in the agreement collective (kind LOSS_SCALE), so a rank that has ended its
    epoch meets it and both raise UnevenDataError instead of waiting.
    """
    finite = tf.convert_to_tensor(finite)
    context = tf.distribute.get_replica_context()
    if context is not None and context.num_replicas_in_sync > 1:
        with within_processes(context.strategy):
            overflowed = context.all_reduce(
                tf.distribute.ReduceOp.SUM, tf.cast(tf.logical_not(finite), tf.float32)
            )
        finite = tf.equal(overflowed, 0.0)
    comm = distributed.init()
    if comm.size == 1:
        return finite
    # (LOSS_SCALE, 1) marks this rank's overflow; (LOSS_SCALE, 0) its finite gradients.
    code = tf.where(finite, tf.constant(0, tf.int64), tf.constant(1, tf.int64))
    table = agreement.agree(comm, agreement.LOSS_SCALE, code, "mixed-precision finiteness check")
    return tf.reduce_all(tf.equal(table[:, 1], 0))


def extended_by_callback(optimizer: Any) -> bool:
    """Whether AdasumCallback has extended this optimizer's apply with the sync (during fit)."""
    return getattr(vars(optimizer).get("apply"), SYNCS, False)


def syncs(optimizer: Any) -> bool:
    """Whether this optimizer's step ends in a sync across replicas or processes: a tf_adasum wrapper
    (AdasumOptimizer, AllreduceOptimizer), an optimizer AdasumCallback extended, or any optimizer
    stepping under an AdasumStrategy (which runs a plain one's step as an AdasumOptimizer's)."""
    if optimizer is None:
        return False
    marked = getattr(type(optimizer), SYNCS, False) or extended_by_callback(optimizer)
    return bool(marked or getattr(tf.distribute.get_strategy(), SYNCS, False))


def without_xla(model: Any) -> None:
    """Turns XLA off for a model whose train step syncs with tf_adasum, with a warning.

    Keras compiles the train step with XLA by default on a GPU host without a strategy (AdasumCallback,
    tf_adasum.keras); XLA has no kernels for tf_adasum's ops, the MPI engine's host calls or its
    collectives, so the first step would fail to compile. Called when Keras makes a train function
    (_compat.install_step_hooks).
    """
    optimizer = _compat.loss_scale_inner(getattr(model, "optimizer", None))
    if optimizer is None or not getattr(model, "jit_compile", False):
        return
    if syncs(optimizer):
        warnings.warn(
            "tf_adasum: compiling this model's train step without XLA (jit_compile=False): XLA cannot "
            "compile tf_adasum's ops and collectives",
            stacklevel=4,
        )
        model.jit_compile = False
