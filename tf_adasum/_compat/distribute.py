"""Hooks into tf.distribute and tf.data internals.

`distributed dataset iterators`
    A distributed dataset's class, swapped for a subclass whose __iter__ hands each eagerly made iterator
    to tf_adasum (hold_iterators): AdasumStrategy keeps the latest few alive, against a crash in
    TensorFlow's MultiDeviceIterator when one is destroyed while its thread reads.
`MirroredExtended._batch_reduce_to`
    MirroredStrategy's batched reduction (behind ReplicaContext.all_reduce and
    extended.batch_reduce_to), with `_container_strategy` and `_broadcast_to`: the extended's class is
    swapped for a subclass that reduces the local results across processes too
    (install_batch_reduction), as MultiWorkerMirroredStrategy's are.
`_create_device_dataset`
    tf.data's per-device prefetch datasets (quiet_per_device_iterators). Optional: without it, epoch
    boundaries can be slow with many replicas, nothing else changes.
`context.abort_collective_ops`
    The eager context's abort of every collective of this process, which MultiWorkerMirroredStrategy's
    health check calls (abort_collectives): an elastic job's processes call it when the launcher ends
    their group. Optional: without it, they learn of a lost peer when TensorFlow's runtime does.
`cross-replica optimizer steps`
    Whether a strategy asks for merge_call (its extended's `_use_merge_call`, which tf.distribute's
    maybe_merge_call consults): a Keras optimizer's apply merges into cross-replica context by it, and
    from cross-replica context, where the outer optimizer steps the synced weights
    (steps_in_cross_replica_context), there is no replica context to merge from. Optional: without it,
    outer_optimizer is refused under a strategy.
`coordination service`
    Whether the eager context runs TensorFlow's coordination service (coordination_service_on), whose
    heartbeats notice a lost peer. Optional: without it, the TF engine gives each collective the timeout,
    and TensorFlow parks a thread for the whole timeout on each, however soon the collective ends.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import tensorflow as tf

from tf_adasum._compat.registry import hook_problem, mark, register, replaced, require, uses


def _distributed_dataset_classes() -> tuple[type, ...]:
    from tensorflow.python.distribute import input_lib

    return input_lib.DistributedDataset, input_lib.DistributedDatasetsFromFunction


def _mirrored_extended() -> Any:
    from tensorflow.python.distribute.mirrored_strategy import MirroredExtended

    return MirroredExtended


# --- distributed dataset iterators ----------------------------------------------------------------


@register(
    "distributed dataset iterators",
    "AdasumStrategy cannot hold its latest iterators, and a dropped one can crash the process",
)
def _check_dataset_iterators() -> str | None:
    for cls in _distributed_dataset_classes():
        if "__iter__" not in vars(cls):
            return f"{cls.__name__} no longer defines __iter__"
    return None


_HOLDING_CLASSES: dict[type, type] = {}


def hold_iterators(distributed: Any, keep: Callable[[Any], None]) -> Any:
    """`distributed` (a distributed dataset), whose iterators, made eagerly, are passed to keep(iterator).

    A subclass is swapped in, so that isinstance checks on the distributed dataset still pass. An
    iterator made inside a traced function lives in its graph and is not passed on.
    """
    require("distributed dataset iterators")
    base = type(distributed)
    holding = _HOLDING_CLASSES.get(base)
    if holding is None:

        def __iter__(self: Any) -> Any:
            iterator = base.__iter__(self)
            if tf.executing_eagerly():
                self._tf_adasum_keep(iterator)
            return iterator

        holding = _HOLDING_CLASSES[base] = type(base.__name__, (base,), {"__iter__": __iter__})
    distributed.__class__ = holding
    distributed._tf_adasum_keep = keep
    return distributed


# --- MirroredExtended._batch_reduce_to -------------------------------------------------------------


@register(
    "MirroredExtended._batch_reduce_to",
    "under AdasumStrategy across processes, ReplicaContext.all_reduce would reduce one process only",
)
def _check_batch_reduce() -> str | None:
    extended = _mirrored_extended()
    for name in ("_batch_reduce_to", "_container_strategy", "_broadcast_to"):
        if not callable(getattr(extended, name, None)):
            return f"MirroredExtended has no {name}"
    if not uses(tf.distribute.StrategyExtended.batch_reduce_to, "_batch_reduce_to"):
        return "StrategyExtended.batch_reduce_to no longer reduces through _batch_reduce_to"
    if not uses(tf.distribute.ReplicaContext.all_reduce, "batch_reduce_to"):
        return "ReplicaContext.all_reduce no longer reduces through batch_reduce_to"
    return None


_REDUCING_CLASSES: dict[type, type] = {}

# across(strategy, reduce_op, local results) -> the totals to put on each destination, or None for the
# local results as they are.
Across = Callable[[Any, Any, list[Any]], "list[tf.Tensor] | None"]


def install_batch_reduction(extended: Any, across: Across) -> None:
    """Makes `extended`'s batched reductions pass their local results through across(...): where it
    returns totals, one per value, each is put on its value's destinations instead.

    A subclass is swapped in, so that isinstance checks on the extended still pass.
    """
    require("MirroredExtended._batch_reduce_to")
    base = type(extended)
    reducing = _REDUCING_CLASSES.get(base)
    if reducing is None:

        def _batch_reduce_to(self: Any, reduce_op: Any, value_destination_pairs: Any, options: Any) -> Any:
            local = base._batch_reduce_to(self, reduce_op, value_destination_pairs, options)
            totals = self._tf_adasum_across(self._container_strategy(), reduce_op, local)
            if totals is None:
                return local
            return [
                self._broadcast_to(total, destination)
                for total, (_, destination) in zip(totals, value_destination_pairs, strict=True)
            ]

        reducing = _REDUCING_CLASSES[base] = type(
            base.__name__, (base,), {"_batch_reduce_to": _batch_reduce_to}
        )
    extended.__class__ = reducing
    extended._tf_adasum_across = across


# --- _create_device_dataset -----------------------------------------------------------------------


@register(
    "_create_device_dataset",
    "epoch boundaries may stall with many replicas (nothing else changes)",
    required=False,
)
def _check_device_datasets() -> str | None:
    from tensorflow.python.data.ops import multi_device_iterator_ops

    if not callable(getattr(multi_device_iterator_ops, "_create_device_dataset", None)):
        return "tf.data's multi_device_iterator_ops has no _create_device_dataset"
    return None


def quiet_per_device_iterators() -> None:
    """Turns tf.data autotuning off on the per-device prefetch datasets of distributed datasets.

    Why: MirroredStrategy (and so AdasumStrategy) feeds each replica through a per-device prefetch
    dataset with a fixed one-element buffer, and each of their iterators starts an autotuning thread.
    Keras makes a new distributed iterator every epoch; destroying the old one waits for every such
    thread to end (RootDataset::Iterator::~Iterator), and an autotuning thread can sleep through its
    cancellation for a whole optimisation period, up to 60 s, each. With 32 replicas on 2 cores the
    epoch boundary then stalls for minutes at 0% CPU (stack: the main thread in
    ~MultiDeviceIterator -> ~RootDataset::Iterator -> ~LogicalThreadWrapper; the threads it waits for
    in Model::OptimizeLoop). A one-element buffer has nothing to tune, so nothing is lost. The source
    dataset keeps its own options.
    """
    if hook_problem("_create_device_dataset") is not None:
        return
    from tensorflow.python.data.ops import multi_device_iterator_ops as module

    before = module._create_device_dataset
    if replaced(before):
        return

    @functools.wraps(before)
    def create_device_dataset(*args: Any, **kwargs: Any) -> Any:
        options = tf.data.Options()
        options.autotune.enabled = False
        return before(*args, **kwargs).with_options(options)

    module._create_device_dataset = mark(create_device_dataset, before)


# --- context.abort_collective_ops -----------------------------------------------------------------


@register(
    "context.abort_collective_ops",
    "an elastic job's processes learn that their group ended only when TensorFlow's runtime notices",
    required=False,
)
def _check_abort_collective_ops() -> str | None:
    from tensorflow.python.eager import context

    if not callable(getattr(context.Context, "abort_collective_ops", None)):
        return "tensorflow.python.eager.context.Context has no abort_collective_ops"
    return None


def abort_collectives(message: str) -> bool:
    """Aborts every collective of this process, running or to come, with UnavailableError(message), as
    MultiWorkerMirroredStrategy's health check does; False (nothing done) where the hook is missing."""
    if hook_problem("context.abort_collective_ops") is not None:
        return False
    from tensorflow.python.eager import context

    context.context().abort_collective_ops(tf.errors.UNAVAILABLE, message)
    return True


# --- coordination service -------------------------------------------------------------------------


@register(
    "coordination service",
    "the TF engine times each collective instead: TensorFlow parks a thread per collective for the whole "
    "timeout, thousands in a long fast run",
    required=False,
)
def _check_coordination_service() -> str | None:
    from tensorflow.python.eager import context

    if not hasattr(context.Context, "coordination_service"):
        return "tensorflow.python.eager.context.Context has no coordination_service"
    return None


def coordination_service_on() -> bool:
    """Whether this process's eager context runs TensorFlow's coordination service, whose heartbeats
    abort every collective of the process when a task stops sending them (it died, hangs or is cut off;
    MultiWorkerMirroredStrategy configures it for its workers). False where the hook is missing."""
    if hook_problem("coordination service") is not None:
        return False
    from tensorflow.python.eager import context

    return bool(context.context().coordination_service)


# --- cross-replica optimizer steps -----------------------------------------------------------------


@register(
    "cross-replica optimizer steps",
    "an outer optimizer (outer_optimizer=...) cannot step under a tf.distribute strategy",
    required=False,
)
def _check_cross_replica_steps() -> str | None:
    from tensorflow.python.distribute import merge_call_interim

    if not uses(merge_call_interim.maybe_merge_call, "strategy_supports_no_merge_call"):
        return "maybe_merge_call no longer asks strategy_supports_no_merge_call"
    if not uses(merge_call_interim.strategy_supports_no_merge_call, "_use_merge_call"):
        return "strategy_supports_no_merge_call no longer asks the strategy's _use_merge_call"
    if not callable(getattr(_mirrored_extended(), "_use_merge_call", None)):
        return "MirroredExtended no longer has _use_merge_call"
    return None


@contextlib.contextmanager
def steps_in_cross_replica_context(strategy: Any) -> Iterator[None]:
    """While it lasts, a Keras optimizer's apply runs in `strategy`'s cross-replica context: its
    update, weight decay and moving average call their functions directly (tf.distribute's
    maybe_merge_call, told by `_use_merge_call` that no merge is needed) instead of merging from a replica
    context there is none of. Their `extended.update` then writes every replica's copy with the same
    value, as from a merge. Every replica thread waits in the merge_call that runs this."""
    require("cross-replica optimizer steps")
    extended = strategy.extended
    extended._use_merge_call = lambda: False
    try:
        yield
    finally:
        del extended._use_merge_call
