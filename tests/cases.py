"""The hard cases every implementation of the operator is checked on, CPU and CUDA alike.

Mixed signs, orthogonal sets, identical and parallel vectors, zeros, empty tensors, odd sizes, many
tensors, values near the smallest normal, and a huge dynamic range. TensorFlow-free, so the CUDA test
can run on a GPU host without TensorFlow.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

Case = tuple[list[np.ndarray], list[np.ndarray]]
# The smallest normal of each dtype (numpy alone has no bfloat16).
TINY = {"float16": 2.0**-14, "bfloat16": 2.0**-126, "float32": 2.0**-126, "float64": 2.0**-1022}


def dtype_codes() -> dict[str, int]:
    """The kernels' dtype codes, read from kernels/adasum_dtypes.h, the one table of them."""
    header = (Path(__file__).resolve().parents[1] / "kernels" / "adasum_dtypes.h").read_text()
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
