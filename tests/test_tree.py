"""adasum_tree against the numpy oracle of the contract tree, for P = 1..9 replicas."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import tensorflow as tf

import tf_adasum
from tests.support import oracle
from tf_adasum.algorithm.tensor_lists import first_mismatch, indices_by_dtype, tensor_specs
from tf_adasum.algorithm.tree import fill_nodes, roots_within, tree_pairs

SHAPES = [(3, 5), (0,), (1031,), (1,), (2, 0, 3)]
RTOL = {"float32": 1e-5, "float64": 1e-10}


def replicas(case: str, p: int, dtype: str, rng: np.random.Generator) -> list[list[np.ndarray]]:
    if case == "mixed_signs":
        return [[rng.standard_normal(s) * (r + 1) for s in SHAPES] for r in range(p)]
    if case == "orthogonal":  # disjoint supports: every partial result is orthogonal to the next
        owner = [rng.integers(0, p, s) for s in SHAPES]
        return [
            [rng.standard_normal(s) * (o == r) for s, o in zip(SHAPES, owner, strict=True)] for r in range(p)
        ]
    if case == "identical":
        same = [rng.standard_normal(s) for s in SHAPES]
        return [[x.copy() for x in same] for _ in range(p)]
    if case == "one_zero_replica":
        values = [[rng.standard_normal(s) for s in SHAPES] for _ in range(p)]
        values[p // 2] = [np.zeros(s) for s in SHAPES]
        return values
    if case == "dynamic_range":
        return [[rng.standard_normal(s) * 10.0 ** (20 if r % 2 else -20) for s in SHAPES] for r in range(p)]
    raise ValueError(case)


def as_tf(values: list[list[np.ndarray]], dtype: str) -> list[list[tf.Tensor]]:
    return [[tf.constant(x.astype(dtype)) for x in r] for r in values]


@pytest.mark.parametrize(
    "case", ["mixed_signs", "orthogonal", "identical", "one_zero_replica", "dynamic_range"]
)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("p", range(1, 10))
def test_tree_matches_oracle(p: int, dtype: str, case: str) -> None:
    values = replicas(case, p, dtype, np.random.default_rng(p))
    tensors = as_tf(values, dtype)
    got = [t.numpy().astype(np.float64) for t in tf_adasum.adasum_tree(tensors)]
    want = oracle.tree([[x.astype(dtype).astype(np.float64) for x in r] for r in values])
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.shape == w.shape
        assert np.all(np.isfinite(g)), f"tensor {i}: non-finite output"
        scale = max(
            float(np.max(np.abs(w), initial=0)), max(float(np.max(np.abs(r[i]), initial=0)) for r in values)
        )
        assert np.max(np.abs(g - w), initial=0) <= RTOL[dtype] * scale, f"tensor {i} differs from the oracle"
    if case == "orthogonal":
        for g, parts in zip(got, zip(*tensors, strict=True), strict=True):
            np.testing.assert_array_equal(g, sum(t.numpy().astype(np.float64) for t in parts))
    if case == "identical":
        for g, x in zip(got, tensors[0], strict=True):
            np.testing.assert_array_equal(g, x.numpy())


def test_tree_is_the_fold_then_neighbour_pairs() -> None:
    # With P = 3 the contract is adasum(adasum(v0, v1), v2), not adasum(v0, adasum(v1, v2)).
    v = [[tf.constant([1.0, 2.0, 0.5])], [tf.constant([0.3, -1.0, 2.0])], [tf.constant([-2.0, 0.1, 1.0])]]
    got = tf_adasum.adasum_tree(v)[0]
    fold_first = tf_adasum.ops.adasum_pair(tf_adasum.ops.adasum_pair(v[0][0], v[1][0]), v[2][0])
    other = tf_adasum.ops.adasum_pair(v[0][0], tf_adasum.ops.adasum_pair(v[1][0], v[2][0]))
    np.testing.assert_array_equal(got.numpy(), fold_first.numpy())
    assert not np.array_equal(got.numpy(), other.numpy())


def test_tree_pairs_are_the_fold_then_the_levels() -> None:
    assert tree_pairs(1) == []
    assert tree_pairs(3) == [((0, 1), (1, 2)), ((0, 2), (2, 3))]
    assert tree_pairs(6) == [
        ((0, 1), (1, 2)), ((2, 3), (3, 4)),  # the fold
        ((0, 2), (2, 4)), ((4, 5), (5, 6)),
        ((0, 4), (4, 6)),
    ]  # fmt: skip


def _nested(p: int) -> object:
    """The whole tree over p leaves, as nested pairs of leaf numbers."""
    return fill_nodes({(j, j + 1): j for j in range(p)}, p, lambda a, b: (a, b))[(0, p)]


def test_the_tree_split_over_processes_is_the_same_tree() -> None:
    # Every way of cutting 1..12 leaves into contiguous runs (processes): each run's own roots, then
    # the rest from every run's roots, gives the whole tree, pair for pair.
    for p in range(1, 13):
        whole = _nested(p)
        parents = {child: (left[0], right[1]) for left, right in tree_pairs(p) for child in (left, right)}
        for cuts in range(1 << (p - 1)):
            edges = [0] + [j for j in range(1, p) if cuts >> (j - 1) & 1] + [p]
            values: dict[tuple[int, int], object] = {}
            for lo, hi in itertools.pairwise(edges):
                mine = fill_nodes({(j, j + 1): j for j in range(lo, hi)}, p, lambda a, b: (a, b))
                roots = roots_within(p, lo, hi)
                assert roots[0][0] == lo and roots[-1][1] == hi  # they cover the run, in order
                assert all(a[1] == b[0] for a, b in itertools.pairwise(roots))
                for span in roots:  # topmost: each one's parent reaches outside the run
                    assert span == (0, p) or not lo <= parents[span][0] <= parents[span][1] <= hi
                values |= {span: mine[span] for span in roots}
            assert fill_nodes(values, p, lambda a, b: (a, b))[(0, p)] == whole, (p, edges)


def test_where_the_tree_splits_inside_a_process() -> None:
    # Two processes of three replicas: the fold pairs (2, 3) across them.
    assert roots_within(6, 0, 3) == [(0, 2), (2, 3)]
    assert roots_within(6, 3, 6) == [(3, 4), (4, 6)]
    # Any number of processes of a power-of-two count: each process is one node.
    assert all(roots_within(12, q * 4, q * 4 + 4) == [(q * 4, q * 4 + 4)] for q in range(3))


def test_tree_across_devices_and_mixed_dtypes() -> None:
    devices = [d.name for d in tf.config.list_logical_devices("CPU")]
    assert len(devices) == 4
    rng = np.random.default_rng(0)
    per_replica = []
    for d in devices:
        with tf.device(d):
            per_replica.append(
                [tf.constant(rng.standard_normal(6)), tf.constant(rng.standard_normal(4), tf.float16)]
            )
    got = tf_adasum.adasum_tree(per_replica, device=devices[2])
    assert all(t.device.endswith("CPU:2") for t in got)
    assert [t.dtype for t in got] == [tf.float64, tf.float16]
    want = oracle.tree([[t.numpy().astype(np.float64) for t in r] for r in per_replica])
    np.testing.assert_allclose(got[0].numpy(), want[0], rtol=1e-12)
    np.testing.assert_allclose(got[1].numpy().astype(np.float64), want[1], rtol=3e-3, atol=3e-3)


def test_tree_inside_tf_function() -> None:
    v = [[tf.constant([1.0, 0.0])], [tf.constant([0.0, 1.0])], [tf.constant([1.0, 1.0])]]
    got = tf.function(tf_adasum.adasum_tree, autograph=False)(v)
    np.testing.assert_allclose(got[0].numpy(), oracle.tree([[t.numpy() for t in r] for r in v])[0], rtol=1e-6)


def test_tree_errors_name_the_replica_and_tensor() -> None:
    with pytest.raises(ValueError, match="at least one replica"):
        tf_adasum.adasum_tree([])
    with pytest.raises(ValueError, match="replica 2 has 1 tensors but replica 0 has 2"):
        tf_adasum.adasum_tree([[tf.ones(2), tf.ones(3)], [tf.ones(2), tf.ones(3)], [tf.ones(2)]])
    with pytest.raises(
        ValueError,
        match=r"tensor 1 of 2 has shape \[4\] and dtype float32 on replica 1 but shape \[3\] and dtype "
        r"float32 on replica 0",
    ):
        tf_adasum.adasum_tree([[tf.ones(2), tf.ones(3)], [tf.ones(2), tf.ones(4)]])
    with pytest.raises(ValueError, match=r"tensor 0 of 1 has shape \[2\] and dtype float64 on replica 2"):
        tf_adasum.adasum_tree([[tf.ones(2)], [tf.ones(2)], [tf.ones(2, tf.float64)]])
    with pytest.raises(TypeError, match="tensor 0 of 1 has dtype int32"):
        tf_adasum.adasum_tree([[tf.ones(2, tf.int32)], [tf.ones(2, tf.int32)]])


def test_a_mismatch_names_the_tensor_and_what_rank_0_has() -> None:
    expected = tensor_specs([tf.ones([4, 5]), tf.ones([2])])
    got = tensor_specs([tf.ones([4, 6]), tf.ones([2])])
    assert first_mismatch([expected, expected, got], "rank", ["dense/kernel", "dense/bias"]) == (
        "tensor 0 of 2 (dense/kernel) has shape [4, 6] and dtype float32 on rank 2 "
        "but shape [4, 5] and dtype float32 on rank 0"
    )
    assert first_mismatch([expected, got[:1]], "rank") == "rank 1 has 1 tensors but rank 0 has 2"
    assert first_mismatch([expected, list(expected), expected], "rank") is None
    assert first_mismatch([expected], "replica") is None


def test_indices_by_dtype_in_order_of_first_appearance() -> None:
    mixed = [tf.ones([1], dtype) for dtype in (tf.float16, tf.float32, tf.float16, tf.float64, tf.float32)]
    assert indices_by_dtype(mixed) == [[0, 2], [1, 4], [3]]
    assert indices_by_dtype([]) == []
