"""The replica tree of docs/contract.md, the numeric contract: its shape, and computed in one process.

Per tensor, over P replicas v_0 ... v_{P-1} (any P >= 1):

    p2 = largest power of two <= P;  r = P - p2
    fold:  u_i = adasum(v_2i, v_2i+1) for i < r;  u_i = v_{i+r} for r <= i < p2
    then pair neighbours level by level: (u_0, u_1), (u_2, u_3), ... until one value remains.

The distributed algorithms (vhdd.py) compute the same tree across processes, and
across_processes.tree_over_replicas over every replica of every process, from these pairs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from tf_adasum import ops
from tf_adasum.algorithm.tensor_lists import check_float_tensors, check_replicas_match, indices_by_dtype


def fold_size(p: int) -> tuple[int, int]:
    """Returns (p2, r): the largest power of two <= p, and how many replica pairs fold into it."""
    if p < 1:
        raise ValueError(f"Adasum needs at least one replica, got {p}")
    p2 = 1 << (p.bit_length() - 1)
    return p2, p - p2


def adasum_pair_any_dtypes(a: Sequence[tf.Tensor], b: Sequence[tf.Tensor]) -> list[tf.Tensor]:
    """adasum_pair over a list that may mix dtypes (mixed precision): one fused call per dtype."""
    out: list[Any] = [None] * len(a)
    for index in indices_by_dtype(a):
        for i, combined in zip(
            index, ops.adasum_pair([a[i] for i in index], [b[i] for i in index]), strict=True
        ):
            out[i] = combined
    return out


def pair_on_left_device(a: list[tf.Tensor], b: list[tf.Tensor]) -> list[tf.Tensor]:
    # The pair is combined where the left operand lives; the right operand is copied there.
    with tf.device(a[0].device if a and hasattr(a[0], "device") else None):
        return adasum_pair_any_dtypes(a, b)


Span = tuple[int, int]  # the leaves [lo, hi) under one node of the tree


def tree_pairs(p: int) -> list[tuple[Span, Span]]:
    """The contract tree over p leaves as the pairs it combines, children before parents.

    Each pair is (left, right); the node it makes spans (left[0], right[1]). The first r pairs are the
    fold, then the levels follow in order.
    """
    _, r = fold_size(p)
    pairs = [((2 * i, 2 * i + 1), (2 * i + 1, 2 * i + 2)) for i in range(r)]
    level = [(2 * i, 2 * i + 2) for i in range(r)] + [(j, j + 1) for j in range(2 * r, p)]
    while len(level) > 1:
        pairs += [(level[i], level[i + 1]) for i in range(0, len(level), 2)]
        level = [(level[i][0], level[i + 1][1]) for i in range(0, len(level), 2)]
    return pairs


def fill_nodes(values: dict[Span, Any], p: int, pair: Callable[[Any, Any], Any]) -> dict[Span, Any]:
    """Fills in every node of the tree over p leaves whose two children `values` holds (or comes to hold).

    With every leaf given, the root (0, p) ends up in `values`; with only the leaves [lo, hi) given, the
    nodes under them do, and roots_within(p, lo, hi) are the topmost of those.
    """
    for left, right in tree_pairs(p):
        if left in values and right in values:
            values[(left[0], right[1])] = pair(values[left], values[right])
    return values


def roots_within(p: int, lo: int, hi: int) -> list[Span]:
    """The topmost nodes of the tree over p leaves whose leaves all lie in [lo, hi), in leaf order.

    A process that holds the leaves [lo, hi) can compute these alone; every other node needs leaves
    from elsewhere.
    """
    inside = {(j, j + 1) for j in range(lo, hi)}
    children = set()
    for left, right in tree_pairs(p):
        if left in inside and right in inside:
            inside.add((left[0], right[1]))
            children |= {left, right}
    return sorted(inside - children)


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

    Examples:
        >>> tf_adasum.adasum_tree([[tf.constant([1.0, 0.0])], [tf.constant([0.0, 1.0])]])  # [[1., 1.]]
    """
    replicas = [[tf.convert_to_tensor(t) for t in r] for r in per_replica]
    p = len(replicas)
    fold_size(p)  # at least one replica
    check_replicas_match(replicas)
    check_float_tensors("adasum_tree", replicas[0], one_dtype=False)
    leaves = {(j, j + 1): replicas[j] for j in range(p)}
    result = fill_nodes(leaves, p, pair_on_left_device)[(0, p)]
    if device is None:
        return result
    with tf.device(device):
        return [tf.identity(t) for t in result]
