"""The replica tree of docs/design.md, computed in one process with the fused ops.

Per tensor, over P replicas v_0 ... v_{P-1} (any P >= 1):

    p2 = largest power of two <= P;  r = P - p2
    fold:  u_i = adasum(v_2i, v_2i+1) for i < r;  u_i = v_{i+r} for r <= i < p2
    then pair neighbours level by level: (u_0, u_1), (u_2, u_3), ... until one value remains.

The distributed algorithm (vhdd.py) computes the same tree across processes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from tf_adasum import ops


def fold_size(p: int) -> tuple[int, int]:
    """Returns (p2, r): the largest power of two <= p, and how many replica pairs fold into it."""
    if p < 1:
        raise ValueError(f"Adasum needs at least one replica, got {p}")
    p2 = 1 << (p.bit_length() - 1)
    return p2, p - p2


def check_replicas_match(per_replica: Sequence[Sequence[tf.Tensor]], where: str = "replica") -> None:
    """Raises ValueError naming the tensor and the replica whose count, shape or dtype differ from 0's."""
    first = per_replica[0]
    for r, tensors in enumerate(per_replica[1:], start=1):
        if len(tensors) != len(first):
            raise ValueError(f"{where} {r} has {len(tensors)} tensors but {where} 0 has {len(first)}")
        for i, (t, t0) in enumerate(zip(tensors, first, strict=True)):
            if t.dtype != t0.dtype or not t.shape.is_compatible_with(t0.shape):
                raise ValueError(
                    f"tensor {i} of {len(first)} has shape {t.shape.as_list()} and dtype {t.dtype.name} "
                    f"on {where} {r} but shape {t0.shape.as_list()} and dtype {t0.dtype.name} on {where} 0"
                )


def adasum_pair_any_dtypes(a: Sequence[tf.Tensor], b: Sequence[tf.Tensor]) -> list[tf.Tensor]:
    """adasum_pair over a list that may mix dtypes (mixed precision): one fused call per dtype."""
    out: list[Any] = [None] * len(a)
    for dtype in dict.fromkeys(t.dtype for t in a):
        index = [i for i, t in enumerate(a) if t.dtype == dtype]
        for i, combined in zip(
            index, ops.adasum_pair([a[i] for i in index], [b[i] for i in index]), strict=True
        ):
            out[i] = combined
    return out


def _pair_on_left_device(a: list[tf.Tensor], b: list[tf.Tensor]) -> list[tf.Tensor]:
    # The pair is combined where the left operand lives; the right operand is copied there.
    with tf.device(a[0].device if a and hasattr(a[0], "device") else None):
        return adasum_pair_any_dtypes(a, b)


def adasum_tree(per_replica: Sequence[Sequence[Any]], device: str | None = None) -> list[tf.Tensor]:
    """Adasum of P replicas' tensors by the contract tree, per tensor.

    Args:
        per_replica: per_replica[r] is replica r's list of tensors; every replica has the same number
            of tensors with the same shapes and dtypes. Dtypes may differ between tensors.
        device: where to put the result; default the device of replica 0's first tensor. Each pair is
            combined on the device of its left operand.

    Returns:
        The list of combined tensors.

    Raises:
        ValueError: no replicas, or a replica whose tensors differ from replica 0's (named).
        TypeError: a non-floating tensor.

    Example:
        >>> tf_adasum.adasum_tree([[tf.constant([1.0, 0.0])], [tf.constant([0.0, 1.0])]])  # [[1., 1.]]
    """
    replicas = [[tf.convert_to_tensor(t) for t in r] for r in per_replica]
    _, r = fold_size(len(replicas))
    check_replicas_match(replicas)
    ops.check_float_tensors("adasum_tree", replicas[0], one_dtype=False)
    level = [_pair_on_left_device(replicas[2 * i], replicas[2 * i + 1]) for i in range(r)]
    level += replicas[2 * r :]
    while len(level) > 1:
        level = [_pair_on_left_device(level[i], level[i + 1]) for i in range(0, len(level), 2)]
    result = level[0]
    if device is None:
        return result
    with tf.device(device):
        return [tf.identity(t) for t in result]
