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

import tensorflow as tf

from tf_adasum import _compat, distributed
from tf_adasum.algorithm import agreement
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
) -> tf.Tensor:
    """Replaces every replica's weights by `anchor + Adasum(w_replica - anchor)`.

    The deltas since the last sync are combined with the contract tree over every replica of every
    process (distributed.allreduce_replicas); every replica and every process then holds the same
    weights, bitwise. Runs in cross-replica context (or with no strategy). With `stats`, also
    records the squared norms OrthogonalityMonitor reads.
    """
    per_variable = [replica_values(v) for v in variables]
    anchor_values = [replica_values(a)[0] for a in anchors]
    replicas = len(per_variable[0]) if per_variable else 0
    per_replica = [
        [tf.identity(values[r]) - anchor for values, anchor in zip(per_variable, anchor_values, strict=True)]
        for r in range(replicas)
    ]
    names = [variable_name(v) for v in variables]
    mean = replicas > 1 and getattr(distribution, "local_reduction", "adasum") == "mean"
    # In a traced step, buckets of about $TF_ADASUM_BUCKET_MB (0, the default: one call), the last
    # variables' first: each bucket's sync waits only for its own variables' updates, which wait only
    # for their own gradients, so it starts while the backward pass computes the earlier layers'.
    # Every tensor keeps its own coefficients, so no bit of the result depends on the buckets.
    delta: list[Any] = [None] * len(variables)
    with agreement.one_step_of_syncs():
        for index in distributed.gradient_groups(per_replica[0] if replicas else [], None, None, "the sync"):
            part = [[deltas[i] for i in index] for deltas in per_replica]
            if mean:
                # AdasumStrategy(local_reduction="mean"): this process's replicas averaged by
                # TensorFlow's own cross-device all-reduce (NCCL between GPUs), then Adasum over the
                # processes.
                part = [local_mean(distribution, part, [variables[i] for i in index])]
            combined = distributed.allreduce_replicas(part, [names[i] for i in index], compression)
            for i, value in zip(index, combined, strict=True):
                delta[i] = value
    deltas_sq = tf.add_n([squared_norms(d) for d in per_replica]) if stats is not None else None
    if distributed.init().size > 1:
        if deltas_sq is not None:
            deltas_sq = distributed.allreduce(deltas_sq, op=distributed.Sum)
    if stats is not None:
        stats.record(deltas_sq, squared_norms(delta))
    for variable, anchor_value, d in zip(variables, anchor_values, delta, strict=True):
        distribution.extended.update(
            tf_variable(variable), lambda var, new: var.assign(new), args=(anchor_value + d,), group=False
        )
    return tf.constant(True)


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
) -> None:
    """sync_deltas after every `sync_every`-th optimizer step (`iterations`, already incremented)."""
    # In cross-replica context: a cond here may contain the collectives of the sync.
    if sync_every == 1:
        sync_deltas(distribution, variables, anchors, compression, stats)
        return
    due = tf.equal(tf.math.floormod(iterations, sync_every), 0)
    tf.cond(
        due,
        lambda: sync_deltas(distribution, variables, anchors, compression, stats),
        lambda: tf.constant(False),
    )


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
