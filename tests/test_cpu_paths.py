"""The CPU paths of the op library (kernels/adasum_cpu_path.h): each one this CPU runs, forced in turn,
gives the same bits as every other, in the four dtypes, on subnormals, every exponent and 1e±20
scales; the library picks the widest path the CPU runs, as /proc/cpuinfo tells it; and a path the CPU
cannot run is refused by name.

Paths this CPU lacks cannot run here, and their tests say so; tests/test_build.py compiles them all.
"""

from __future__ import annotations

import platform
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from tests.support.cases import CASES, COEFFICIENTS, NUMPY_TYPES, Case, coefficient_row, every_exponent
from tf_adasum import ops

DTYPES = ["float16", "bfloat16", "float32", "float64"]
UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}

RUNNABLE = ops.build_info()["cpu_paths_runnable"]
PATHS = [name for name, runs in RUNNABLE.items() if runs]


@pytest.fixture(autouse=True)
def widest_path_after() -> Iterator[None]:
    """Every test leaves the library on the widest path this CPU runs, whatever it switched to."""
    yield
    ops.set_cpu_path(None)


def _host_results(a: np.ndarray, b: np.ndarray, bounds: list[int]) -> list[np.ndarray]:
    """Dot and norms per piece, then the combine with those rows and with the crafted rows, on 2 threads."""
    rows = ops.host_segment_dot_norms(a, b, bounds, threads=2)
    out = np.empty_like(a)
    results = [rows]
    if np.all(np.isfinite(rows)):
        ops.host_segment_combine(a, b, rows, out, bounds, threads=2)
        results.append(out.copy())
    for ca, cb in COEFFICIENTS:
        crafted = np.array([coefficient_row(ca, cb)] * (len(bounds) - 1))
        ops.host_segment_combine(a, b, crafted, out, bounds, threads=2)
        results.append(out.copy())
    return results


def _same_bits(got: list[np.ndarray], want: list[np.ndarray], what: str) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        width = g.dtype.itemsize
        np.testing.assert_array_equal(g.view(UINT[width]), w.view(UINT[width]), err_msg=f"{what}, result {i}")


def _compare_paths(compute: Callable[[], list[np.ndarray]], what: str) -> None:
    if len(PATHS) < 2:
        pytest.skip(f"this CPU runs only the {PATHS[0]} path: nothing to compare it with")
    results = {}
    for name in PATHS:
        ops.set_cpu_path(name)
        results[name] = compute()
    for name in PATHS[1:]:
        _same_bits(results[name], results[PATHS[0]], f"{what}: path {name} against {PATHS[0]}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_path_rounds_every_exponent_alike(dtype: str) -> None:
    rng = np.random.default_rng(17)
    a, b = every_exponent(rng, dtype, 20011), every_exponent(rng, dtype, 20011)
    # Pieces that start off every vector width's alignment, and tails of every length below 16.
    bounds = [0, 1, 18, 33, 4096 + 7, len(a) - 15, len(a)]
    _compare_paths(lambda: _host_results(a, b, bounds), f"{dtype} bit patterns")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__[5:])
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_path_gives_the_cases_the_same_bits(dtype: str, case: Callable[..., Case]) -> None:
    a_list, b_list = case(np.random.default_rng(3), dtype)
    a = np.concatenate([np.ravel(x) for x in a_list]).astype(NUMPY_TYPES[dtype])
    b = np.concatenate([np.ravel(x) for x in b_list]).astype(NUMPY_TYPES[dtype])
    bounds = np.cumsum([0] + [np.size(x) for x in a_list]).tolist()
    _compare_paths(lambda: _host_results(a, b, bounds), f"{dtype} {case.__name__}")


def test_every_path_streams_float32_alike() -> None:
    # Outputs of 8 MiB and more take the streaming stores (kStreamingBytes), from an unaligned start.
    rng = np.random.default_rng(9)
    n = (8 << 20) // 4 + 13
    a, b = rng.standard_normal(n).astype(np.float32), (3 * rng.standard_normal(n)).astype(np.float32)
    _compare_paths(lambda: _host_results(a, b, [0, 3, n]), "float32 streamed")


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_path_gives_the_tensorflow_ops_the_same_bits(dtype: str) -> None:
    rng = np.random.default_rng(23)
    shapes = [(3, 5), (1031,), (2**17 + 9,), ()]  # the last large enough for TensorFlow's thread pool
    a = [tf.constant(every_exponent(rng, dtype, int(np.prod(s))).reshape(s)) for s in shapes]
    b = [tf.constant(every_exponent(rng, dtype, int(np.prod(s))).reshape(s)) for s in shapes]

    def compute() -> list[np.ndarray]:
        rows = ops.adasum_dot_norms(a, b)
        return [rows.numpy(), *[t.numpy() for t in ops.adasum_combine(a, b, rows)]]

    _compare_paths(compute, f"{dtype} TensorFlow ops")


def _cpuinfo_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the x86-64 paths; other CPUs have one path")
def test_the_library_runs_the_widest_path_this_cpu_has() -> None:
    flags = _cpuinfo_flags()
    avx2 = {"avx2", "fma", "f16c"} <= flags
    avx512 = avx2 and {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags
    want = {"portable": True, "avx2": avx2, "avx512": avx512, "avx512bf16": avx512 and "avx512_bf16" in flags}
    assert RUNNABLE == want, f"/proc/cpuinfo says {want}"
    assert ops.cpu_path() == PATHS[-1]
    assert ops.build_info()["cpu_path"] == PATHS[-1]


def test_a_path_the_cpu_cannot_run_is_refused_by_name() -> None:
    with pytest.raises(
        ValueError, match=r"'no_such_path': no such CPU path in this library; it holds portable"
    ):
        ops.set_cpu_path("no_such_path")
    missing = [name for name, runs in RUNNABLE.items() if not runs]
    if missing:
        with pytest.raises(ValueError, match=f"'{missing[0]}': this CPU lacks the instructions of that path"):
            ops.set_cpu_path(missing[0])
    assert ops.cpu_path() == PATHS[-1], "a refused path changes nothing"
    assert ops.set_cpu_path("portable") == PATHS[-1]
    assert ops.cpu_path() == "portable"
