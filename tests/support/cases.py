"""The hard cases every implementation of the operator is checked on, CPU and CUDA alike.

Mixed signs, orthogonal sets, identical and parallel vectors, zeros, empty tensors, odd sizes, many
tensors, values near the smallest normal, and a huge dynamic range. TensorFlow-free, so the CUDA test
can run on a GPU host without TensorFlow.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

try:  # numpy alone has no bfloat16; the GPU harness runs without ml_dtypes
    import ml_dtypes

    NUMPY_TYPES = {
        "float16": np.float16,
        "bfloat16": ml_dtypes.bfloat16,
        "float32": np.float32,
        "float64": np.float64,
    }
except ImportError:
    NUMPY_TYPES = {"float16": np.float16, "float32": np.float32, "float64": np.float64}
_UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}

Case = tuple[list[np.ndarray], list[np.ndarray]]
# The smallest normal of each dtype (numpy alone has no bfloat16).
TINY = {"float16": 2.0**-14, "bfloat16": 2.0**-126, "float32": 2.0**-126, "float64": 2.0**-1022}


def dtype_codes() -> dict[str, int]:
    """The kernels' dtype codes, read from kernels/adasum_dtypes.h, the one table of them."""
    header = (Path(__file__).resolve().parents[2] / "kernels" / "adasum_dtypes.h").read_text()
    return {name.lower(): int(code) for name, code in re.findall(r"ADASUM_(\w+) = (\d+)", header)}


def normal(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape)


def case_random_mixed_signs(rng: np.random.Generator, dtype: str) -> Case:
    shapes = [(3, 5), (7,), (1031,), (2, 2, 2), ()]
    return [normal(rng, *s) for s in shapes], [normal(rng, *s) * 3 for s in shapes]


def case_orthogonal(rng: np.random.Generator, dtype: str) -> Case:
    mask = rng.random(999) < 0.5
    signs = np.array([[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1]], np.float64)  # Hadamard rows
    a = [normal(rng, 999) * mask, np.tile(signs[1], 64) * 2, np.tile(signs[0], 8)]
    b = [normal(rng, 999) * ~mask, np.tile(signs[2], 64) * 5, np.tile(signs[2], 8)]
    return a, b


def case_identical(rng: np.random.Generator, dtype: str) -> Case:
    a = [normal(rng, 1031), normal(rng, 4, 9)]
    return a, [x.copy() for x in a]


def case_parallel_different_norms(rng: np.random.Generator, dtype: str) -> Case:
    a = [normal(rng, 513), normal(rng, 8, 8)]
    return a, [4.0 * x for x in a]


def case_one_zero(rng: np.random.Generator, dtype: str) -> Case:
    return [np.zeros(77), normal(rng, 77)], [normal(rng, 77), np.zeros(77)]


def case_empty(rng: np.random.Generator, dtype: str) -> Case:
    return [np.zeros(0), np.zeros((3, 0)), normal(rng, 5)], [np.zeros(0), np.zeros((3, 0)), normal(rng, 5)]


def case_odd_sizes(rng: np.random.Generator, dtype: str) -> Case:
    sizes = [1, 7, 1031, 2**20 + 3]
    return [normal(rng, n) for n in sizes], [normal(rng, n) for n in sizes]


def case_many_tensors(rng: np.random.Generator, dtype: str) -> Case:
    sizes = rng.integers(0, 3000, size=500)
    return [normal(rng, n) for n in sizes], [normal(rng, n) for n in sizes]


def case_near_tiny(rng: np.random.Generator, dtype: str) -> Case:
    tiny = TINY[dtype]
    a = [tiny * rng.uniform(1, 8, 300) * rng.choice([-1, 1], 300)]
    b = [tiny * rng.uniform(1, 8, 300) * rng.choice([-1, 1], 300)]
    return a, b


def case_huge_dynamic_range(rng: np.random.Generator, dtype: str) -> Case:
    small, large = (1e-3, 1e3) if dtype == "float16" else (1e-20, 1e20)
    a = [normal(rng, 4096) * small, normal(rng, 33) * large]
    b = [normal(rng, 4096) * large, normal(rng, 33) * small]
    return a, b


CASES = [
    case_random_mixed_signs,
    case_orthogonal,
    case_identical,
    case_parallel_different_norms,
    case_one_zero,
    case_empty,
    case_odd_sizes,
    case_many_tensors,
    case_near_tiny,
    case_huge_dynamic_range,
]


# (dot, |a|^2, |b|^2) rows whose coefficients reach every regime: small and large, of both signs, and
# beyond 2^32, where float16 and bfloat16 are combined in float64 instead of float32.
COEFFICIENTS = [(0.37, 1.9), (-1.3e-3, 0.5), (5.0e5, -7.25), (2.0**33 + 3.0, 0.75), (1.0, 1.0)]


def coefficient_row(ca: float, cb: float) -> list[float]:
    """A (dot, |a|^2, |b|^2) row that gives the coefficients (ca, cb): ca = 1 - dot / (2 |a|^2)."""
    dot = 2.0 * (1.0 - ca) if ca != 1.0 else 0.5
    a_sq = dot / (2.0 * (1.0 - ca)) if ca != 1.0 else 0.0  # |a|^2 below the guard: ca is exactly 1
    b_sq = dot / (2.0 * (1.0 - cb)) if cb != 1.0 else 0.0
    return [dot, a_sq, b_sq]


# Below these, products with COEFFICIENTS and their sums stay finite in float64, and mostly inside the
# dtype's own range (float16's largest products overflow to inf, which every path must round alike).
_MAGNITUDE_LIMIT = {"float16": 60.0, "bfloat16": 3.4e26, "float32": 3.4e26, "float64": 1e100}


def every_exponent(rng: np.random.Generator, dtype: str, n: int) -> np.ndarray:
    """n finite values of dtype from random bit patterns: every exponent, subnormals and zeros too."""
    width = np.dtype(NUMPY_TYPES[dtype]).itemsize
    bits = rng.integers(0, 2 ** (8 * width), size=4 * n, dtype=np.uint64).astype(_UINT[width])
    values = bits.view(NUMPY_TYPES[dtype])
    with np.errstate(invalid="ignore"):  # NaN patterns
        values = values[np.isfinite(values.astype(np.float64))]
    values = values[np.abs(values.astype(np.float64)) < _MAGNITUDE_LIMIT[dtype]][:n]
    assert len(values) == n
    return np.ascontiguousarray(values)
