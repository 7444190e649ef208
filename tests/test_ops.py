"""The fused ops against the numpy oracle, their exact properties, and their errors."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorflow as tf

from tests.support import oracle
from tests.support.cases import CASES, Case, case_orthogonal, dtype_codes, normal
from tf_adasum import ops
from tf_adasum.common import loader

DTYPES = ["float16", "bfloat16", "float32", "float64"]


def _op_devices() -> list[Any]:
    """The CPU; and the GPU, where TensorFlow sees one and the ops have GPU kernels (TF_ADASUM_CUDA=1)."""
    if tf.config.list_physical_devices("GPU") and ops.built_with_cuda():
        return ["CPU", pytest.param("GPU", marks=pytest.mark.gpu)]
    return ["CPU"]


@pytest.fixture(autouse=True, params=_op_devices())
def device(request: pytest.FixtureRequest) -> Any:
    """Every test here runs with its tensors on the CPU, and again on the GPU where there is one."""
    with tf.device(f"/{request.param}:0"):
        yield request.param


# Conversions go through numpy and ml_dtypes: TensorFlow's own Cast flushes subnormals to zero.
def _to_tf(values: list[np.ndarray], dtype: str) -> list[tf.Tensor]:
    return [tf.constant(np.asarray(v).astype(tf.as_dtype(dtype).as_numpy_dtype)) for v in values]


def _to_np(tensors: list[tf.Tensor]) -> list[np.ndarray]:
    return [t.numpy().astype(np.float64) for t in tensors]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__[5:])
@pytest.mark.parametrize("dtype", DTYPES)
def test_adasum_pair_matches_oracle(dtype: str, case: Callable[..., Case], run: Callable[..., Any]) -> None:
    a_np, b_np = case(np.random.default_rng(7), dtype)
    a, b = _to_tf(a_np, dtype), _to_tf(b_np, dtype)
    a_in, b_in = _to_np(a), _to_np(b)  # the values after rounding to dtype: what the oracle must see
    got = run(ops.adasum_pair, a, b)
    assert [t.dtype for t in got] == [tf.as_dtype(dtype)] * len(a)
    for g, x, y in zip(_to_np(got), a_in, b_in, strict=True):
        oracle.assert_adasum_close(g, x, y, dtype)

    dot_norms = run(ops.adasum_dot_norms, a, b).numpy()
    assert dot_norms.shape == (len(a), 3) and dot_norms.dtype == np.float64
    for row, x, y in zip(dot_norms, a_in, b_in, strict=True):
        slack = 2 * x.size * np.finfo(np.float64).eps * oracle.dot_norms(np.abs(x), np.abs(y))
        want = oracle.dot_norms(x, y)
        assert np.all(np.abs(row - want) <= slack + 1e-300), f"dot_norms {row}, expected {want}"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__[5:])
@pytest.mark.parametrize("dtype", DTYPES)
def test_combine_rounds_as_the_kernels_contract_says(dtype: str, case: Callable[..., Case]) -> None:
    # Given the same (a.b, |a|^2, |b|^2), the CPU and CUDA kernels round alike, to the last bit
    # (tests/gpu/test_cuda.py checks the CUDA one against the same numpy rounding).
    a_np, b_np = case(np.random.default_rng(11), dtype)
    a, b = _to_tf(a_np, dtype), _to_tf(b_np, dtype)
    dot_norms = ops.adasum_dot_norms(a, b)
    got = ops.adasum_combine(a, b, dot_norms)
    for g, x, y, row in zip(_to_np(got), _to_np(a), _to_np(b), dot_norms.numpy(), strict=True):
        np.testing.assert_array_equal(g, oracle.combined_as_the_kernels_round(x, y, row, dtype))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_outputs_past_the_streaming_size_round_as_the_contract_says(dtype: str) -> None:
    # A call writing 8 MiB or more streams its output past the caches (kStreamingBytes in
    # kernels/adasum_cpu.cc; float32 by its own vector loop). Same bits as the rounding contract,
    # including a segment that starts off the 32-byte alignment of those stores (bounds at 3).
    n = (8 << 20) // np.dtype(dtype).itemsize + 13
    rng = np.random.default_rng(5)
    a_np, b_np = (
        [rng.standard_normal(n), rng.standard_normal(7)],
        [rng.standard_normal(n), rng.standard_normal(7)],
    )
    a, b = _to_tf(a_np, dtype), _to_tf(b_np, dtype)
    dot_norms = ops.adasum_dot_norms(a, b)
    got = ops.adasum_combine(a, b, dot_norms)
    for g, x, y, row in zip(_to_np(got), _to_np(a), _to_np(b), dot_norms.numpy(), strict=True):
        np.testing.assert_array_equal(g, oracle.combined_as_the_kernels_round(x, y, row, dtype))

    # Inside a tf.function on temporaries, Combine may write its output over an input (forwarding).
    @tf.function
    def on_temporaries(x: tf.Tensor, y: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        x2, y2 = x * 2, y * 2  # exact: the same values, twice as large
        rows = ops.adasum_dot_norms([x2], [y2])
        return ops.adasum_combine([x2], [y2], rows)[0], rows

    doubled, row = on_temporaries(a[0], b[0])
    x, y = _to_np(a)[0] * 2, _to_np(b)[0] * 2
    want = oracle.combined_as_the_kernels_round(x, y, row.numpy()[0], dtype)
    np.testing.assert_array_equal(doubled.numpy().astype(np.float64), want)

    bounds = tf.constant([0, 3, n], tf.int64)
    rows = ops.adasum_segment_dot_norms(a[0], b[0], bounds)
    pieces = ops.adasum_segment_combine(a[0], b[0], rows, bounds).numpy().astype(np.float64)
    x, y = _to_np(a)[0], _to_np(b)[0]
    for (lo, hi), row in zip([(0, 3), (3, n)], rows.numpy(), strict=True):
        np.testing.assert_array_equal(
            pieces[lo:hi], oracle.combined_as_the_kernels_round(x[lo:hi], y[lo:hi], row, dtype)
        )


def test_bfloat16_with_a_huge_coefficient_is_rounded_once_from_float64() -> None:
    # Coefficients beyond 2^32 send bfloat16 through float64. ca = (1 + 2^-8 + 2^-30) 2^40 lies just
    # above the midpoint between two bfloat16 values; float32 would round it onto the midpoint, and
    # rounding that again to even would go down. Rounded once, it goes up.
    ca = 2.0**40 + 2.0**32 + 2.0**10
    a, b = _to_tf([np.ones(4)], "bfloat16"), _to_tf([np.zeros(4)], "bfloat16")
    dot_norms = tf.constant([[2.0 - 2.0 * ca, 1.0, 0.0]], tf.float64)  # so 1 - a.b / (2 |a|^2) = ca
    got = _to_np(ops.adasum_combine(a, b, dot_norms))[0]
    np.testing.assert_array_equal(got, np.full(4, (1 + 2.0**-7) * 2.0**40))
    row = dot_norms.numpy()[0]
    np.testing.assert_array_equal(
        oracle.combined_as_the_kernels_round(np.ones(4), np.zeros(4), row, "bfloat16"), got
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_exact_properties(dtype: str, run: Callable[..., Any]) -> None:
    rng = np.random.default_rng(3)
    a_np, b_np = case_orthogonal(rng, dtype)
    a, b = _to_tf(a_np, dtype), _to_tf(b_np, dtype)
    for got, x, y in zip(run(ops.adasum_pair, a, b), a, b, strict=True):
        np.testing.assert_array_equal(_to_np([got])[0], _to_np([x + y])[0], err_msg="orthogonal: a + b")

    x = _to_tf([normal(rng, 1031), normal(rng, 5, 5)], dtype)
    for got, want in zip(run(ops.adasum_pair, x, [tf.identity(t) for t in x]), x, strict=True):
        np.testing.assert_array_equal(_to_np([got])[0], _to_np([want])[0], err_msg="adasum(a, a) = a")

    zero = [tf.zeros_like(t) for t in x]
    for got, want in zip(run(ops.adasum_pair, zero, x), x, strict=True):
        np.testing.assert_array_equal(_to_np([got])[0], _to_np([want])[0], err_msg="adasum(0, b) = b")

    equal_norm = _to_tf([np.full(64, 0.75)], dtype)
    got = run(ops.adasum_pair, equal_norm, equal_norm)[0]
    np.testing.assert_array_equal(_to_np([got])[0], np.full(64, 0.75), err_msg="parallel, equal norm: mean")


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("dtype", DTYPES)
def test_symmetric_and_scale_equivariant(dtype: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    shapes = [(17,), (300, 3), (4097,)]
    a = _to_tf([normal(rng, *s) for s in shapes], dtype)
    b = _to_tf([normal(rng, *s) * 10 for s in shapes], dtype)
    ab, ba = _to_np(ops.adasum_pair(a, b)), _to_np(ops.adasum_pair(b, a))
    for x, y in zip(ab, ba, strict=True):
        np.testing.assert_array_equal(x, y, err_msg="adasum(a, b) == adasum(b, a) bitwise")

    # A power of two scales every sum exactly, so the coefficients and the result scale exactly.
    scaled = _to_np(ops.adasum_pair([t * 4 for t in a], [t * 4 for t in b]))
    for x, y in zip(scaled, ab, strict=True):
        np.testing.assert_array_equal(x, 4 * y)
    # Any other positive c: equal up to rounding of the scaled inputs.
    c = 3.7
    a_c, b_c = [t * c for t in a], [t * c for t in b]
    for got, x, y in zip(_to_np(ops.adasum_pair(a_c, b_c)), _to_np(a_c), _to_np(b_c), strict=True):
        oracle.assert_adasum_close(got, x, y, dtype)


def test_results_do_not_depend_on_neighbours_or_threads() -> None:
    rng = np.random.default_rng(0)
    big = [tf.constant(normal(rng, 2**21 + 5), tf.float32) for _ in range(2)]
    small = [tf.constant(normal(rng, n), tf.float32) for n in (3, 70000)]
    alone = ops.adasum_dot_norms(big[:1], big[1:]).numpy()
    among = ops.adasum_dot_norms([small[0], big[0], small[1]], [small[0], big[1], small[1]]).numpy()
    np.testing.assert_array_equal(alone[0], among[1])
    again = ops.adasum_dot_norms(big[:1], big[1:]).numpy()
    np.testing.assert_array_equal(alone, again)


def test_single_tensor_in_single_tensor_out() -> None:
    got = ops.adasum_pair(tf.constant([1.0, 0.0]), tf.constant([0.0, 1.0]))
    assert isinstance(got, tf.Tensor)
    np.testing.assert_array_equal(got.numpy(), [1.0, 1.0])
    assert ops.adasum_pair([], []) == []
    assert ops.adasum_dot_norms([], []).shape == (0, 3)


def test_inputs_survive_the_in_place_combine() -> None:
    a = tf.constant(np.arange(1.0, 9.0, dtype=np.float32))
    b = tf.constant(np.ones(8, np.float32))
    before = a.numpy().copy(), b.numpy().copy()
    ops.adasum_pair([a], [b])
    np.testing.assert_array_equal(a.numpy(), before[0])
    np.testing.assert_array_equal(b.numpy(), before[1])


# Bad input: each raises a clear error that names the tensor, eagerly and in a graph.


def test_mismatched_list_lengths() -> None:
    with pytest.raises(ValueError, match="a has 2 tensors but b has 1"):
        ops.adasum_pair([tf.ones(3), tf.ones(3)], [tf.ones(3)])


def test_mismatched_shapes(run: Callable[..., Any]) -> None:
    a, b = [tf.ones(3), tf.ones([4, 5])], [tf.ones(3), tf.ones([4, 6])]
    with pytest.raises(
        (ValueError, tf.errors.InvalidArgumentError), match=r"tensor 1 of 2 has shape \[4,5\]"
    ):
        run(ops.adasum_pair, a, b)


def test_mixed_dtypes() -> None:
    with pytest.raises(TypeError, match="tensor 2 of 4 has dtype float16 but tensor 0 has float32"):
        ops.adasum_dot_norms([tf.ones(2), tf.ones(2)], [tf.ones(2, tf.float16), tf.ones(2)])


@pytest.mark.parametrize("dtype", [tf.int32, tf.int64, tf.uint8, tf.bool, tf.complex64])
def test_non_float_dtypes_are_refused(dtype: tf.DType) -> None:
    x = tf.zeros(3, dtype)
    with pytest.raises(TypeError, match=f"tensor 0 of 2 has dtype {dtype.name}; Adasum needs float16"):
        ops.adasum_pair([x], [x])
    # The raw op refuses them too, rather than reading memory as the wrong type.
    with pytest.raises((TypeError, tf.errors.InvalidArgumentError, tf.errors.NotFoundError)):
        ops.load_library().adasum_dot_norms(a=[x], b=[x])


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_inputs_give_an_error_naming_the_tensor(bad: float, run: Callable[..., Any]) -> None:
    a = [tf.ones(4), tf.constant([1.0, bad, 0.0])]
    with pytest.raises(tf.errors.InvalidArgumentError, match="tensor 1 of 2 has a non-finite"):
        run(ops.adasum_pair, a, [tf.ones(4), tf.ones(3)])


def test_dot_norms_of_the_wrong_shape() -> None:
    with pytest.raises((ValueError, tf.errors.InvalidArgumentError), match=r"\[1, 3\]|Dimension"):
        ops.adasum_combine([tf.ones(3)], [tf.ones(3)], tf.zeros([2, 3], tf.float64))


# The loader.


def test_missing_library_names_path_and_rebuild(tmp_path: Any) -> None:
    path = tmp_path / loader.adapter_name(tf.__version__)
    with pytest.raises(ImportError, match=f"{path} does not exist.*pip install --no-build-isolation"):
        ops.load_library(path)


def test_a_release_the_package_does_not_serve_is_named_with_those_it_does(tmp_path: Any) -> None:
    for release in ("3.1", "2.13", "2.9"):  # none of them the running one
        (tmp_path / loader.adapter_name(release)).write_bytes(b"")
    (tmp_path / "_adasum_ops_tfx_y.so").write_bytes(b"")  # not an adapter's name
    (tmp_path / loader.CORE).write_bytes(b"")
    with pytest.raises(ImportError) as refused:
        ops.load_library(tmp_path / loader.adapter_name(tf.__version__))
    assert (
        f"no op library for TensorFlow {tf.__version__}, which is running: {tmp_path} serves TensorFlow "
        "2.9, 2.13, 3.1. Install one of those releases, or build tf_adasum from source" in str(refused.value)
    )


def test_an_adapter_without_its_core_is_refused(tmp_path: Any) -> None:
    path = tmp_path / loader.adapter_name(tf.__version__)
    path.write_bytes(f"TF_ADASUM_BUILT_FOR_TF={tf.__version__};".encode())
    with pytest.raises(ImportError, match=rf"core is missing: {tmp_path / loader.CORE} does not exist"):
        ops.load_library(path)


def test_library_for_another_tensorflow_is_refused(tmp_path: Any) -> None:
    path = tmp_path / loader.adapter_name(tf.__version__)
    path.write_bytes(b"\x7fELF...TF_ADASUM_BUILT_FOR_TF=2.3.0;...")
    (tmp_path / loader.CORE).write_bytes(b"")
    with pytest.raises(ImportError, match=rf"built for TensorFlow 2\.3\.0 but TensorFlow {tf.__version__}"):
        ops.load_library(path)


def test_unloadable_library_is_reported(tmp_path: Any) -> None:
    path = tmp_path / loader.adapter_name(tf.__version__)
    path.write_bytes(f"not an ELF file TF_ADASUM_BUILT_FOR_TF={tf.__version__};".encode())
    (tmp_path / loader.CORE).write_bytes(b"")
    with pytest.raises(ImportError, match=r"could not be loaded.*pip install --no-build-isolation"):
        ops.load_library(path)


def test_the_loaded_library_is_the_adapter_of_this_tensorflow_beside_its_core() -> None:
    info, library = ops.build_info(), loader.library_path()
    if not os.environ.get("TF_ADASUM_LIBRARY"):  # make test-gpu-build points it at its own build
        assert library == loader.PACKAGE / loader.adapter_name(tf.__version__)
    assert info["library"] == str(library)
    assert info["core"] == str(library.parent / loader.CORE)
    assert info["tensorflow"] == tf.__version__
    assert ".".join(tf.__version__.split(".")[:2]) in info["releases"]
    assert f"TF_ADASUM_BUILT_FOR_TF={tf.__version__};".encode() in Path(info["library"]).read_bytes()


# The segment ops: one fused buffer per side plus piece bounds, as the distributed algorithm uses.


@pytest.mark.parametrize("dtype", DTYPES)
def test_segment_ops_equal_the_list_ops(dtype: str, run: Callable[..., Any]) -> None:
    rng = np.random.default_rng(11)
    sizes = [5, 0, 1031, 1, 64]
    a_np, b_np = [normal(rng, n) for n in sizes], [normal(rng, n) * 2 for n in sizes]
    a, b = _to_tf(a_np, dtype), _to_tf(b_np, dtype)
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    fa, fb = tf.concat(a, 0), tf.concat(b, 0)
    dn = run(ops.adasum_segment_dot_norms, fa, fb, bounds)
    np.testing.assert_array_equal(dn.numpy(), ops.adasum_dot_norms(a, b).numpy())
    got = run(ops.adasum_segment_combine, fa, fb, dn, bounds)
    np.testing.assert_array_equal(_to_np([got])[0], _to_np([tf.concat(ops.adasum_pair(a, b), 0)])[0])


def test_segment_bounds_are_checked() -> None:
    x = tf.ones(10)
    with pytest.raises(tf.errors.InvalidArgumentError, match="bounds must run from 0 to 10"):
        ops.adasum_segment_dot_norms(x, x, [0, 4, 9])
    with pytest.raises(tf.errors.InvalidArgumentError, match="bounds must not decrease, got 6 then 4"):
        ops.adasum_segment_dot_norms(x, x, [0, 6, 4, 10])
    with pytest.raises(
        (ValueError, tf.errors.InvalidArgumentError), match=r"a has shape|must be 1-D of one length"
    ):
        ops.adasum_segment_dot_norms(x, tf.ones(9), [0, 10])


# The same core on numpy buffers, for the MPI engine's host path (kernels/adasum_c_api.cc).


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("dtype", DTYPES)
def test_host_segment_functions_equal_the_segment_ops_bit_for_bit(dtype: str, threads: int) -> None:
    rng = np.random.default_rng(12)
    sizes = [5, 0, 200_001, 1, 64]  # past the 2^17 elements where the core starts threads
    fa = tf.concat(_to_tf([normal(rng, n) for n in sizes], dtype), 0)
    fb = tf.concat(_to_tf([normal(rng, n) * 2 for n in sizes], dtype), 0)
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    want_dn = ops.adasum_segment_dot_norms(fa, fb, bounds).numpy()
    want = ops.adasum_segment_combine(fa, fb, want_dn, bounds).numpy()
    a, b = fa.numpy(), fb.numpy()
    dn = ops.host_segment_dot_norms(a, b, bounds, threads)
    np.testing.assert_array_equal(dn, want_dn)
    out = np.empty_like(a)
    ops.host_segment_combine(a, b, dn, out, bounds, threads)
    np.testing.assert_array_equal(out.view(np.uint8), want.view(np.uint8))
    ops.host_segment_combine(a, b, dn, a, bounds, threads)  # in place, over an input
    np.testing.assert_array_equal(a.view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("dtype", DTYPES)
def test_host_copy_norms_copies_and_gives_the_ops_squared_norms(dtype: str, threads: int) -> None:
    rng = np.random.default_rng(13)
    sizes = [5, 0, 200_001, 1, 64]
    tensors = _to_tf([normal(rng, n) for n in sizes], dtype)
    tensors[3] = tf.fill([1], tf.constant(np.inf, tensors[3].dtype))  # a non-finite norm comes through
    sources = [t.numpy() for t in tensors]
    starts = np.concatenate([[0], np.cumsum([n + 3 for n in sizes])])  # gaps between, as padding
    dst = np.full(int(starts[-1]), 7, sources[0].dtype)
    norms = ops.host_copy_norms(sources, dst, starts, threads)
    np.testing.assert_array_equal(norms, ops.adasum_dot_norms(tensors, tensors).numpy()[:, 1])
    assert np.isinf(norms[3])
    for x, start in zip(sources, starts, strict=False):
        np.testing.assert_array_equal(dst[start : start + x.size].view(np.uint8), x.view(np.uint8))
        np.testing.assert_array_equal(dst[start + x.size : start + x.size + 3].astype(np.float32), 7)


def test_the_host_dtype_codes_are_the_kernels_own() -> None:
    assert ops._HOST_DTYPES == dtype_codes() == {"float16": 0, "bfloat16": 1, "float32": 2, "float64": 3}


def test_host_segment_functions_refuse_bad_input() -> None:
    x = np.ones(10, np.float32)
    with pytest.raises(TypeError, match=r"got int32\[10\] and int32\[10\]"):
        ops.host_segment_dot_norms(np.ones(10, np.int32), np.ones(10, np.int32), [0, 10])
    with pytest.raises(TypeError, match=r"got float32\[10\] and float64\[10\]"):
        ops.host_segment_dot_norms(x, np.ones(10), [0, 10])
    with pytest.raises(ValueError, match="bounds must run from 0 to 10 without decreasing, got"):
        ops.host_segment_dot_norms(x, x, [0, 6, 4, 10])
    out = np.zeros(10, np.float32)
    rows = np.array([[1.0, 1.0, 1.0], [np.nan, 1.0, 1.0]])
    with pytest.raises(ValueError, match=r"piece 1 of 2 has a non-finite"):
        ops.host_segment_combine(x, x, rows, out, [0, 4, 10])
    np.testing.assert_array_equal(out, 0)  # nothing written


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_combine_is_computed_in_float64_and_rounded_once(dtype: str, run: Callable[..., Any]) -> None:
    # Given the kernel's own (a.b, |a|^2, |b|^2), the float64 formula rounded once to the dtype is
    # exact, element for element: a combine done in float32 arithmetic would not be (checked below).
    rng = np.random.default_rng(11)
    a_np, b_np = [normal(rng, 4099), normal(rng, 7, 9)], [normal(rng, 4099) * 3, normal(rng, 7, 9)]
    a, b = _to_tf(a_np, dtype), _to_tf(b_np, dtype)
    dot_norms = run(ops.adasum_dot_norms, a, b)
    got = run(ops.adasum_combine, a, b, dot_norms)
    numpy_dtype = np.dtype(dtype)
    for g, x, y, (dot, a_sq, b_sq) in zip(got, _to_np(a), _to_np(b), dot_norms.numpy(), strict=True):
        ca, cb = oracle.coefficients(dot, a_sq, b_sq)
        want = (ca * x + cb * y).astype(numpy_dtype)
        np.testing.assert_array_equal(g.numpy(), want)
        if dtype == "float32":  # the check can tell: float32 arithmetic misses in many elements
            in_float32 = np.float32(ca) * x.astype(np.float32) + np.float32(cb) * y.astype(np.float32)
            assert np.mean(in_float32 != want) > 0.05


def test_results_are_bitwise_the_same_with_one_or_four_threads(tmp_path: Any) -> None:
    import subprocess
    import sys

    script = (
        "import sys, numpy as np, tensorflow as tf\n"
        "tf.config.threading.set_intra_op_parallelism_threads(int(sys.argv[1]))\n"
        "from tf_adasum import ops\n"
        "rng = np.random.default_rng(5)\n"
        "a = [tf.constant(rng.standard_normal(n), tf.float32) for n in (2**21, 999)]\n"
        "b = [tf.constant(rng.standard_normal(n), tf.float32) for n in (2**21, 999)]\n"
        "dn = ops.adasum_dot_norms(a, b)\n"
        "out = ops.adasum_pair(a, b)\n"
        "np.savez(sys.argv[2], dn.numpy(), *[t.numpy() for t in out])\n"
    )
    results = []
    for threads in (1, 4):
        path = tmp_path / f"threads{threads}.npz"
        subprocess.run([sys.executable, "-c", script, str(threads), str(path)], check=True, timeout=120)
        results.append(list(np.load(path).values()))
    for one, four in zip(*results, strict=True):
        np.testing.assert_array_equal(one, four)


def test_subnormal_sums_survive_tensorflows_flush_to_zero() -> None:
    # TensorFlow runs kernels with FTZ and DAZ set. 1e-160 squared is 1e-320, a float64 subnormal: the
    # kernels must return it, not zero, whether one block or several add up to it.
    tiny = np.full(3 * 2**15 + 5, 1e-160)
    got = ops.adasum_dot_norms(
        [tf.constant(tiny[:1]), tf.constant(tiny)], [tf.constant(tiny[:1]), tf.constant(tiny)]
    )
    np.testing.assert_array_equal(got.numpy(), [[1e-320] * 3, [tiny.size * 1e-320] * 3])
