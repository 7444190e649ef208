"""What every rank checks with the others before a model sync and at the end of an epoch.

A model sync across processes is only correct when every rank arrives at it with a finite update and
the same step; a rank that arrives with NaN, or has run out of data, would otherwise leave the others
waiting in the middle of the algorithm until the timeout. So each sync starts with one tiny collective,
`Communicator.agree`, of three int64 codes per rank:

    (SYNC, -1, m)       ready, update finite; m fingerprints its tensors' shapes and dtypes (0: none)
    (SYNC, i, m)        ready, but tensor i of the update holds NaN or Inf
    (EPOCH_END, n, 0)   this rank finished its epoch after n batches
    (LOSS_SCALE, f, 0)  mixed precision, before a step: f = 1 if this rank's gradients overflowed

A rank at a sync and a rank at an epoch end meet in the same collective, so both see the mismatch; so
do ranks at two different kinds of check, which would otherwise pair two different steps.
Every rank builds its error from the same gathered table, so every rank raises the same error at the
same step, eagerly or from inside a compiled train step.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import tensorflow as tf

from tf_adasum import ops
from tf_adasum.comm.base import Communicator, NonFiniteUpdateError, UnevenDataError
from tf_adasum.tree import describe_tensor, squared_norms, tensor_specs

SYNC, EPOCH_END, LOSS_SCALE = 0, 1, 2

_KINDS = {SYNC: "a model sync", EPOCH_END: "an epoch end", LOSS_SCALE: "a mixed-precision check"}


class MetadataDiffers(ValueError):
    """The ranks' fingerprints of their tensors differ; the caller finds out how (check_same_on_all_ranks)."""


def fingerprint(tensors: Sequence[tf.Tensor]) -> int:
    """A 63-bit digest of the tensors' count, shapes and dtypes, the same in every process."""
    digest = hashlib.blake2b(repr(tensor_specs(tensors)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


_WHAT_TO_DO = (
    "give every rank the same number of batches per epoch (equal shards, drop_remainder=True), or pass "
    "steps_per_epoch to fit"
)


def check_table(table: np.ndarray, count: int = 0, names: Sequence[str] | None = None) -> None:
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
            f"still had batches and are waiting to sync: {_WHAT_TO_DO}"
        )
    if ended:
        if len(set(values.tolist())) > 1:
            batches = ", ".join(f"rank {r}: {int(v)}" for r, v in enumerate(values))
            raise UnevenDataError(
                f"the ranks ran different numbers of batches this epoch ({batches}): {_WHAT_TO_DO}"
            )
        return
    if len(set(kinds.tolist())) > 1:
        at = ", ".join(f"rank {r}: {_KINDS.get(int(k), k)}" for r, k in enumerate(kinds))
        raise RuntimeError(f"the ranks are at different checks ({at}): their steps no longer match")
    if kinds[0] == LOSS_SCALE:
        return
    if table.shape[1] > 2 and len(set(table[:, 2].tolist())) > 1:
        prints = ", ".join(f"rank {r}: {int(m):#x}" for r, m in enumerate(table[:, 2]))
        raise MetadataDiffers(f"the ranks' tensors differ in count, shape or dtype (fingerprints {prints})")
    bad = [(r, int(v)) for r, v in enumerate(values) if v >= 0]
    if bad:
        where = "; ".join(f"rank {r}: {describe_tensor(i, count, names)}" for r, i in bad)
        raise NonFiniteUpdateError(
            f"the update of rank(s) {[r for r, _ in bad]} is not finite ({where} holds NaN or Inf); every "
            "rank stops at this step. Look for a diverging loss or a bad batch on that rank "
            "(keras.callbacks.TerminateOnNaN stops on the loss), or lower the learning rate"
        )


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
    if isinstance(value, int):
        codes = tf.constant([kind, value, metadata], tf.int64)
    else:
        codes = tf.stack(
            [tf.constant(kind, tf.int64), tf.cast(value, tf.int64), tf.constant(metadata, tf.int64)]
        )
    table = comm.agree(codes, what)
    if tf.executing_eagerly():
        check_table(table.numpy(), count, names)
        return table

    def check(gathered: np.ndarray) -> np.ndarray:
        check_table(gathered, count, names)
        return gathered

    checked = tf.numpy_function(check, [table], tf.int64, stateful=True)
    checked.set_shape(table.shape)
    return checked


def first_nonfinite_norm(indices: Sequence[Sequence[int]], norms: Sequence[np.ndarray]) -> int:
    """The first tensor index whose squared norm is not finite, or -1; norms[g][j] is tensor
    indices[g][j]'s."""
    bad = [i for index, n in zip(indices, norms, strict=True) for i in np.asarray(index)[~np.isfinite(n)]]
    return int(min(bad, default=-1))


def first_nonfinite(groups: Sequence[tuple[Sequence[int], tf.Tensor, Sequence[int]]]) -> tf.Tensor | int:
    """The index of the first tensor whose squared norm is not finite, or -1.

    Args:
        groups: (indices of the tensors, their fused buffer, the tensor starts in it), per dtype.

    The squared norms come from the same float64 kernel as Adasum's own, so this refuses exactly the
    tensors that Adasum's combination would refuse (NaN, Inf, or a float64 norm that overflows).
    """
    norms = [ops.adasum_segment_dot_norms(b, b, tf.constant(starts, tf.int64)) for _, b, starts in groups]
    if tf.executing_eagerly():  # one kernel per dtype, then numpy: no per-op dispatch on the hot path
        return first_nonfinite_norm([index for index, _, _ in groups], [n.numpy()[:, 1] for n in norms])
    index = tf.constant([i for group, _, _ in groups for i in group], tf.int64)
    finite = tf.math.is_finite(tf.concat([n[:, 1] for n in norms], 0))
    first = tf.reduce_min(tf.where(finite, tf.constant(np.iinfo(np.int64).max, tf.int64), index))
    return tf.where(tf.reduce_all(finite), tf.constant(-1, tf.int64), first)


def first_nonfinite_of(per_replica: Sequence[Sequence[tf.Tensor]]) -> tf.Tensor | int:
    """first_nonfinite over several lists of the same tensors (a process's replicas): the index of the
    first tensor that is not finite in any of them, or -1. One norm kernel per replica and dtype."""
    if not per_replica or not per_replica[0]:
        return -1
    finite = tf.reduce_all(tf.math.is_finite(tf.stack([squared_norms(list(r)) for r in per_replica])), 0)
    if tf.executing_eagerly():
        bad = np.flatnonzero(~finite.numpy())
        return int(bad[0]) if bad.size else -1
    first = tf.argmin(tf.cast(finite, tf.int32), output_type=tf.int64)
    return tf.where(tf.reduce_all(finite), tf.constant(-1, tf.int64), first)
