"""What every rank checks with the others before a model sync and at the end of an epoch.

A model sync across processes is only correct when every rank arrives at it with a finite update and
the same step; a rank that arrives with NaN, or has run out of data, would otherwise leave the others
waiting in the middle of the algorithm until the timeout. So each sync starts with one tiny collective,
`Communicator.agree`, of three int64 codes per rank:

    (SYNC, -1, m)       ready, update finite; m fingerprints its tensors' shapes and dtypes (0: none)
    (SYNC, i, m)        ready, but tensor i of the update holds NaN or Inf
    (EPOCH_END, n, 0)   this rank finished its epoch after n batches
    (LOSS_SCALE, f, 0)  mixed precision, before a step: f = 1 if this rank's gradients overflowed
    (ALLREDUCE | BROADCAST | ALLGATHER | OBJECTS, root, m)
                        on a host transport (MPI), before each collective: which one, its root, its tensors

A rank at a sync and a rank at an epoch end meet in the same collective, so both see the mismatch; so
do ranks at two different kinds of check, which would otherwise pair two different steps.
Every rank builds its error from the same gathered table, so every rank raises the same error at the
same step, eagerly or from inside a compiled train step.

The shapes and dtypes of what the ranks pass are checked here too: by the fingerprint in the codes,
and in full (to say which tensor differs how) by gathering every rank's tensor specs
(check_same_on_all_ranks, check_replicas_everywhere).
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from tf_adasum import ops
from tf_adasum.algorithm.tensor_lists import (
    check_float_tensors,
    check_replicas_match,
    describe_tensor,
    first_mismatch,
    tensor_specs,
)
from tf_adasum.comm.base import Communicator
from tf_adasum.common.errors import NonFiniteUpdateError, UnevenDataError

NONFINITE_ADVICE = (
    "Look for a diverging loss or a bad batch (keras.callbacks.TerminateOnNaN stops on the loss): lower "
    "the learning rate, clip the gradients (clipnorm=...), or use loss scaling under mixed precision"
)


SYNC, EPOCH_END, LOSS_SCALE = 0, 1, 2
# The collectives a host transport announces (announce): MPI matches collectives by order alone, so a
# rank at one and a rank at another would exchange mismatched messages (MPI_ERR_TRUNCATE, a crash).
ALLREDUCE, BROADCAST, ALLGATHER, OBJECTS = 3, 4, 5, 6
COLLECTIVES = (ALLREDUCE, BROADCAST, ALLGATHER, OBJECTS)

_KINDS = {
    SYNC: "a model sync",
    EPOCH_END: "an epoch end",
    LOSS_SCALE: "a mixed-precision check",
    ALLREDUCE: "an all-reduce",
    BROADCAST: "a broadcast",
    ALLGATHER: "an all-gather",
    OBJECTS: "a metadata exchange",
}


def describe_check(kind: int, value: int) -> str:
    """What a rank's codes say it is at: 'a model sync', 'a broadcast from rank 0', ..."""
    if kind == BROADCAST:
        return f"a broadcast from rank {value}"
    return _KINDS.get(kind, f"an unknown check {kind}")


class MetadataDiffers(ValueError):
    """The ranks' fingerprints of their tensors differ; check_same_on_all_ranks then finds out how."""


def fingerprint(tensors: Sequence[tf.Tensor]) -> int:
    """A 63-bit digest of the tensors' count, shapes and dtypes, the same in every process."""
    digest = hashlib.blake2b(repr(tensor_specs(tensors)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


# What to do about uneven data: every message about it ends with this.
UNEVEN_DATA_ADVICE = (
    "give every rank the same number of batches per epoch (equal shards, drop_remainder=True), or pass "
    "steps_per_epoch to fit"
)


def per_rank(values: Sequence[object]) -> str:
    """'rank 0: 4, rank 1: 3', for messages that show what every rank said."""
    return ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))


def codes_row(kind: int, value: int, metadata: int = 0) -> np.ndarray:
    """One rank's (kind, value, metadata), as agree() and a host call's agree_host send it."""
    return np.array([kind, value, metadata], np.int64)


def raise_unless_agreed(table: np.ndarray, count: int = 0, names: Sequence[str] | None = None) -> None:
    """Raises the error that a gathered [size, 3] table of codes calls for; the same on every rank.

    Args:
        table: row r is rank r's (kind, value, metadata); metadata may be left out.
        count: how many tensors the sync carries, for the message.
        names: their names, for the message.

    Raises:
        NonFiniteUpdateError: every rank is at a sync, and some rank's update holds NaN or Inf.
        UnevenDataError: some ranks ended their epoch while others are at a sync, or the ranks ended
            their epochs after different numbers of batches.
    """
    kinds, values = table[:, 0], table[:, 1]
    ended = [int(r) for r in np.flatnonzero(kinds == EPOCH_END)]
    syncing = [int(r) for r in np.flatnonzero(kinds != EPOCH_END)]
    if ended and syncing:
        batches = ", ".join(f"rank {r} after {int(values[r])}" for r in ended)
        raise UnevenDataError(
            f"rank(s) {ended} ran out of data ({batches} batches of this epoch) while rank(s) {syncing} "
            f"still had batches and are waiting to sync: {UNEVEN_DATA_ADVICE}"
        )
    if ended:
        if len(set(values.tolist())) > 1:
            raise UnevenDataError(
                f"the ranks ran different numbers of batches this epoch ({per_rank(values.tolist())}): "
                f"{UNEVEN_DATA_ADVICE}"
            )
        return
    if len(set(kinds.tolist())) > 1 or (kinds[0] == BROADCAST and len(set(values.tolist())) > 1):
        at = per_rank([describe_check(int(k), int(v)) for k, v in zip(kinds, values, strict=True)])
        raise RuntimeError(
            f"the ranks are at different checks ({at}): their steps no longer match. Every rank must issue "
            "the same collectives in the same order"
        )
    if kinds[0] == LOSS_SCALE:
        return
    if table.shape[1] > 2 and len(set(table[:, 2].tolist())) > 1:
        prints = per_rank([f"{int(m):#x}" for m in table[:, 2]])
        raise MetadataDiffers(f"the ranks' tensors differ in count, shape or dtype (fingerprints {prints})")
    if kinds[0] in COLLECTIVES:
        return
    bad = [(r, int(v)) for r, v in enumerate(values) if v >= 0]
    if bad:
        where = "; ".join(f"rank {r}: {describe_tensor(i, count, names)}" for r, i in bad)
        raise NonFiniteUpdateError(
            f"the update of rank(s) {[r for r, _ in bad]} is not finite ({where} holds NaN or Inf); every "
            f"rank stops at this step. {NONFINITE_ADVICE}"
        )


def codes_tensor(kind: int, value: tf.Tensor | int, metadata: int = 0) -> tf.Tensor:
    """One rank's (kind, value, metadata) as the int64 [3] tensor agree() gathers."""
    if isinstance(value, int):
        return tf.constant(codes_row(kind, value, metadata))
    return tf.stack([tf.constant(kind, tf.int64), tf.cast(value, tf.int64), tf.constant(metadata, tf.int64)])


def checked_table(table: tf.Tensor, count: int = 0, names: Sequence[str] | None = None) -> tf.Tensor:
    """raise_unless_agreed on a gathered table: now, eagerly; inside a tf.function, as an op whose
    output later work must depend on."""
    if tf.executing_eagerly():
        raise_unless_agreed(table.numpy(), count, names)
        return table

    def check(gathered: np.ndarray) -> np.ndarray:
        raise_unless_agreed(gathered, count, names)
        return gathered

    checked = tf.numpy_function(check, [table], tf.int64, stateful=True)
    checked.set_shape(table.shape)
    return checked


def agree(
    comm: Communicator,
    kind: int,
    value: tf.Tensor | int,
    what: str,
    count: int = 0,
    names: Sequence[str] | None = None,
    metadata: int = 0,
) -> tf.Tensor:
    """Gathers every rank's (kind, value, metadata) and raises on every rank if they disagree.

    `metadata` is a fingerprint() of a sync's tensors; ranks whose fingerprints differ raise
    MetadataDiffers, before any data moves.

    Returns:
        A tensor to make later work depend on (inside a tf.function the check runs as an op).
    """
    return checked_table(comm.agree(codes_tensor(kind, value, metadata), what), count, names)


# The layout (dtype, length) of the last compiled sync traced in this process whose codes travel in
# its data's all-gather (agree_and_gather, TF engine), or None when its codes went by agree(). A rank at
# its epoch end must meet the others' next sync in the same collective: it issues that one.
_last_sync_layout: list[tuple[tf.DType, int] | None] = [None]
# While one step's syncs are traced one after another (one_step_of_syncs): whether the first has been.
_step_of_syncs: list[bool | None] = [None]


def traced_sync(layout: tuple[tf.DType, int] | None) -> None:
    """Called where a compiled sync is traced: its codes go with its data (the layout) or alone (None).

    Within one_step_of_syncs, only the step's first sync counts: its collective runs first (the engine
    orders a step's collectives as they were traced), and it is where a rank at its epoch end meets
    the others."""
    if _step_of_syncs[0]:
        return
    _last_sync_layout[0] = layout
    if _step_of_syncs[0] is not None:
        _step_of_syncs[0] = True


@contextlib.contextmanager
def one_step_of_syncs() -> Iterator[None]:
    """While a step's syncs are traced in turn (gradient groups, buckets of deltas): the first one is
    the sync an epoch end meets."""
    outer = _step_of_syncs[0]
    if outer is None:
        _step_of_syncs[0] = False
    try:
        yield
    finally:
        if outer is None:
            _step_of_syncs[0] = None


def agree_at_epoch_end(comm: Communicator, batches: int) -> None:
    """This rank's (EPOCH_END, batches) against every other rank's codes; raises as agree() does.

    Under the TF engine, after a compiled sync whose codes travel with its data, the codes go in that
    sync's collective, with zeros for the data: a rank still at that sync (uneven data) meets this one
    there, and both raise UnevenDataError.
    """
    layout = _last_sync_layout[0]
    if layout is None or not comm.codes_in_gathers:
        agree(comm, EPOCH_END, batches, "epoch-end check")
        return
    with tf.init_scope():
        dtype, length = layout
        table, _ = comm.agree_and_gather(
            codes_tensor(EPOCH_END, batches), tf.zeros([length], dtype), "epoch-end check"
        )
        raise_unless_agreed(table.numpy())


def first_nonfinite_of_norms(indices: Sequence[Sequence[int]], norms: Sequence[np.ndarray]) -> int:
    """The first tensor index whose squared norm is not finite, or -1; norms[g][j] is tensor
    indices[g][j]'s."""
    bad = [i for index, n in zip(indices, norms, strict=True) for i in np.asarray(index)[~np.isfinite(n)]]
    return int(min(bad, default=-1))


def first_nonfinite_in_buffers(
    groups: Sequence[tuple[Sequence[int], tf.Tensor, Sequence[int]]],
) -> tf.Tensor | int:
    """The index of the first tensor whose squared norm is not finite, or -1.

    Args:
        groups: (indices of the tensors, their fused buffer, the tensor starts in it), per dtype.

    The squared norms come from the same float64 kernel as Adasum's own, so this refuses exactly the
    tensors that Adasum's combination would refuse (NaN, Inf, or a float64 norm that overflows).
    """
    norms = [ops.adasum_segment_dot_norms(b, b, tf.constant(starts, tf.int64)) for _, b, starts in groups]
    if tf.executing_eagerly():  # one kernel per dtype, then numpy: no per-op dispatch on the hot path
        return first_nonfinite_of_norms([index for index, _, _ in groups], [n.numpy()[:, 1] for n in norms])
    index = tf.constant([i for group, _, _ in groups for i in group], tf.int64)
    finite = tf.math.is_finite(tf.concat([n[:, 1] for n in norms], 0))
    first = tf.reduce_min(tf.where(finite, tf.constant(np.iinfo(np.int64).max, tf.int64), index))
    return tf.where(tf.reduce_all(finite), tf.constant(-1, tf.int64), first)


def first_nonfinite_in_replicas(per_replica: Sequence[Sequence[tf.Tensor]]) -> tf.Tensor | int:
    """first_nonfinite_in_buffers over several lists of the same tensors (a process's replicas): the
    index of the first tensor that is not finite in any of them, or -1. One norm kernel per replica and
    dtype."""
    if not per_replica or not per_replica[0]:
        return -1
    finite = tf.reduce_all(tf.math.is_finite(tf.stack([ops.squared_norms(list(r)) for r in per_replica])), 0)
    if tf.executing_eagerly():
        bad = np.flatnonzero(~finite.numpy())
        return int(bad[0]) if bad.size else -1
    first = tf.argmin(tf.cast(finite, tf.int32), output_type=tf.int64)
    return tf.where(tf.reduce_all(finite), tf.constant(-1, tf.int64), first)


def finite_replicas(
    per_replica: Sequence[Sequence[tf.Tensor]], names: Sequence[str] | None = None
) -> list[list[tf.Tensor]]:
    """A process's replicas' tensors, after raising NonFiniteUpdateError if any holds NaN or Inf.

    The error names every replica and the first tensor of each that is not finite. One norm kernel
    per replica and dtype; inside tf.function the error is raised by a host call that runs only then.
    """
    if not per_replica or not per_replica[0]:
        return [list(r) for r in per_replica]
    count = len(per_replica[0])
    finite = tf.math.is_finite(tf.stack([ops.squared_norms(list(r)) for r in per_replica]))

    def raise_naming(table: np.ndarray) -> np.ndarray:
        bad = [(r, int(np.flatnonzero(~row)[0])) for r, row in enumerate(table) if not row.all()]
        if bad:
            where = "; ".join(f"replica {r}: {describe_tensor(i, count, names)}" for r, i in bad)
            raise NonFiniteUpdateError(
                f"the update of replica(s) {[r for r, _ in bad]} is not finite ({where} holds NaN or "
                f"Inf); every replica stops at this step. {NONFINITE_ADVICE}"
            )
        return np.asarray(True)

    if tf.executing_eagerly():
        raise_naming(finite.numpy())
        return [list(r) for r in per_replica]
    checked = tf.cond(
        tf.reduce_all(finite),
        lambda: tf.constant(True),
        lambda: tf.reshape(tf.numpy_function(raise_naming, [finite], tf.bool, stateful=True), []),
    )
    with tf.control_dependencies([checked]):
        return [[tf.identity(t) for t in r] for r in per_replica]


def check_same_on_all_ranks(
    comm: Communicator, tensors: Sequence[tf.Tensor], what: str, names: Sequence[str] | None = None
) -> None:
    """Raises on every rank if the ranks are at different collectives, or if some rank's tensors differ in
    count, shape or dtype from rank 0's.

    Runs before any data moves. Inside tf.function it runs once, when the function is traced.

    Raises:
        RuntimeError: the ranks called different collectives (`what` differs), naming each rank's.
        ValueError: the same collective with different tensors, naming the tensor and the ranks.
    """
    everyone = gather_objects(comm, tensor_specs(tensors), f"{what} metadata check")
    mismatch = first_mismatch(everyone, "rank", names)
    if mismatch is not None:
        raise ValueError(f"{what}: {mismatch}")


def check_replicas_everywhere(
    comm: Communicator, local: Sequence[Sequence[tf.Tensor]], names: Sequence[str] | None = None
) -> list[int]:
    """Checks every process's replicas in one metadata round; returns every process's replica count.

    Each process sends its replica count, its tensors' specs, and what is wrong with its own replicas
    (none, mismatched shapes, integer tensors), so that every process raises the same error, not only
    the one at fault.

    Raises:
        ValueError / TypeError: on every process, naming the process and the tensor.
    """
    problem = None
    try:
        if not local:
            raise ValueError("this process has no replicas")
        check_replicas_match(local)
        check_float_tensors("allreduce_replicas", local[0], one_dtype=False)
    except (ValueError, TypeError) as error:
        problem = (type(error).__name__, str(error))
    specs = tensor_specs(local[0]) if local else []
    everyone = gather_objects(comm, (len(local), specs, problem), "Adasum metadata check")
    for rank, (_, _, found) in enumerate(everyone):
        if found is not None:
            kind = TypeError if found[0] == "TypeError" else ValueError
            raise kind(f"allreduce_replicas: rank {rank}: {found[1]}")
    mismatch = first_mismatch([specs for _, specs, _ in everyone], "rank", names)
    if mismatch is not None:
        raise ValueError(f"allreduce(op=Adasum): {mismatch}")
    return [count for count, _, _ in everyone]


def announce(
    comm: Communicator, kind: int, tensors: Sequence[tf.Tensor], what: str, value: int = 0
) -> list[tf.Tensor]:
    """Before a collective on a host transport: every rank checks that all are at the same collective
    (`kind`, and `value`: a broadcast's root) with the same tensors, and raises naming each rank's if not.

    Other engines match collectives by key and check their type and shape in their own runtime, so
    this is a no-op there. Returns the tensors, which inside a tf.function then move only after the
    check.

    Raises:
        RuntimeError: the ranks are at different collectives (every rank raises, naming all of them).
        MetadataDiffers: the same collective, with different tensors (the caller says how they differ).
        UnevenDataError: some rank has ended its epoch instead.
    """
    if comm.size == 1 or comm.matches_collectives_by_key:
        return list(tensors)
    checked = agree(comm, kind, value, what, metadata=fingerprint(tensors))
    if tf.executing_eagerly():
        return list(tensors)
    with tf.control_dependencies([checked]):
        return [tf.identity(t) for t in tensors]


def gather_objects(comm: Communicator, obj: Any, what: str) -> list[Any]:
    """Every rank's `obj`, in rank order: comm.allgather_object, announced first. Objects are gathered
    when Python runs (also while a tf.function is traced), so the announcement runs then too.

    Each rank sends `what` with its object, so ranks at two different exchanges (a broadcast's
    metadata check on one, a steps-per-epoch check on another) raise naming both, before either
    reads the other's object.

    Raises:
        RuntimeError: on every rank, when the ranks are at different exchanges.
    """
    with tf.init_scope():
        announce(comm, OBJECTS, [], what)
    everyone = comm.allgather_object((what, obj), what)
    called = [w for w, _ in everyone]
    if len(set(called)) > 1:
        raise RuntimeError(
            f"the ranks are at different collectives ({per_rank(called)}): every rank must issue the same "
            "collectives in the same order (is some code, a model load or a callback, running on one "
            "rank only?)"
        )
    return [o for _, o in everyone]
