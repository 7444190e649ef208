"""Numpy float64 oracles written from the formulas in docs/contract.md, independent of the package."""

from __future__ import annotations

import numpy as np

ZERO_NORM_GUARD = np.sqrt(np.finfo(np.float64).tiny)

# One output ulp of each dtype, as a fraction of the magnitude of the terms being added.
# Spacing of the subnormals of each dtype (numpy alone: the GPU harness runs without ml_dtypes).
SMALLEST_SUBNORMAL = {"float16": 2.0**-24, "bfloat16": 2.0**-133, "float32": 2.0**-149, "float64": 2.0**-1074}
TOLERANCE = {"float16": 1e-3, "bfloat16": 8e-3, "float32": 2e-7, "float64": 1e-15}


def dot_norms(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    x = np.asarray(a, np.float64).ravel()
    y = np.asarray(b, np.float64).ravel()
    return np.array([x @ y, x @ x, y @ y])


def coefficients(dot: float, a_sq: float, b_sq: float) -> tuple[float, float]:
    ca = 1.0 - dot / (2.0 * a_sq) if a_sq >= ZERO_NORM_GUARD else 1.0
    cb = 1.0 - dot / (2.0 * b_sq) if b_sq >= ZERO_NORM_GUARD else 1.0
    return ca, cb


FLOAT32_COMBINE_LIMIT = 2.0**32  # kernels/adasum_core.h: kFloat32CombineLimit


def _bfloat16_from_float32(f: np.ndarray) -> np.ndarray:
    """Round to nearest even, as float64 values (finite inputs)."""
    bits = np.ascontiguousarray(f, np.float32).view(np.uint32).astype(np.uint64)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return bits.astype(np.uint32).view(np.float32).astype(np.float64)


def _round_to_odd_float32(d: np.ndarray) -> np.ndarray:
    """float64 to float32 with round-to-odd: rounding it on to 16 bits is one correct rounding of d."""
    f = d.astype(np.float32)
    bits = f.view(np.uint32).copy()
    inexact = (f.astype(np.float64) != d) & np.isfinite(f)
    bits[inexact & (np.abs(f.astype(np.float64)) > np.abs(d))] -= 1  # rounded away from zero: truncate
    bits[inexact] |= 1
    return bits.view(np.float32)


def _round(values: np.ndarray, dtype: str) -> np.ndarray:
    """float64 or float32 values rounded once to dtype (nearest even), as float64."""
    if dtype == "bfloat16":
        single = values if values.dtype == np.float32 else _round_to_odd_float32(values)
        return _bfloat16_from_float32(single)
    return values.astype(dtype).astype(np.float64)


def combined_as_the_kernels_round(a: np.ndarray, b: np.ndarray, row: np.ndarray, dtype: str) -> np.ndarray:
    """Adasum>Combine for one (a.b, |a|^2, |b|^2) row, rounded exactly as the CPU and CUDA kernels round.

    float32 and float64: ca a + cb b in float64, rounded once. float16 and bfloat16: in float32 (each
    product and the sum rounded to float32, no FMA) while |ca| and |cb| are at most 2^32, else in
    float64; rounded once to the dtype. a and b hold values of the dtype, as float64.
    """
    ca, cb = coefficients(*row)
    x, y = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if dtype in ("float16", "bfloat16") and max(abs(ca), abs(cb)) <= FLOAT32_COMBINE_LIMIT:
        products = np.float32(ca) * x.astype(np.float32), np.float32(cb) * y.astype(np.float32)
        return _round(products[0] + products[1], dtype)
    return _round(ca * x + cb * y, dtype)


def adasum(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, float]:
    """Returns (adasum(a, b) in float64, the largest |ca a| + |cb b|: the scale for tolerances)."""
    x = np.asarray(a, np.float64)
    y = np.asarray(b, np.float64)
    ca, cb = coefficients(*dot_norms(x, y))
    magnitude = float(np.max(np.abs(ca * x) + np.abs(cb * y), initial=0.0))
    return ca * x + cb * y, magnitude


def tree(per_replica: list[list[np.ndarray]]) -> list[np.ndarray]:
    """The contract tree of docs/contract.md over P replicas, per tensor, in float64."""
    values = [[np.asarray(t, np.float64) for t in replica] for replica in per_replica]
    p = len(values)
    p2 = 1 << (p.bit_length() - 1)
    r = p - p2
    level = [
        [adasum(x, y)[0] for x, y in zip(values[2 * i], values[2 * i + 1], strict=True)] for i in range(r)
    ]
    level += values[2 * r :]
    while len(level) > 1:
        level = [
            [adasum(x, y)[0] for x, y in zip(level[i], level[i + 1], strict=True)]
            for i in range(0, len(level), 2)
        ]
    return level[0]


def accumulation_bound(a: np.ndarray, b: np.ndarray) -> float:
    """Largest output error that float64 accumulation in another order can cause.

    A sum of n products carries at most n * eps * sum|a_i b_i| of rounding error, in the kernel and in
    numpy alike; through ca = 1 - a.b / (2|a|^2) it moves each output by that over 2|a|^2, times |a_i|.
    With random vectors a.b is tiny next to |a||b|, so this term, not the output rounding, dominates.
    """
    x = np.abs(np.asarray(a, np.float64)).ravel()
    y = np.abs(np.asarray(b, np.float64)).ravel()
    if x.size == 0:
        return 0.0
    slack = 2 * x.size * np.finfo(np.float64).eps * float(x @ y)
    bound = 0.0
    for v in (x, y):
        norm = float(v @ v)
        if norm >= ZERO_NORM_GUARD:
            bound += slack / (2 * norm) * float(v.max())
    return bound


def assert_adasum_close(got: np.ndarray, a: np.ndarray, b: np.ndarray, dtype: str) -> None:
    """got must be finite and within one output ulp (of the terms' magnitude) of the oracle."""
    got = np.asarray(got, np.float64)
    want, magnitude = adasum(a, b)
    assert got.shape == want.shape, f"shape {got.shape}, expected {want.shape}"
    assert np.all(np.isfinite(got)), f"non-finite output for finite inputs: {got[~np.isfinite(got)][:5]}"
    # Outputs in the subnormal range round to a fixed spacing, not a relative one.
    tolerance = TOLERANCE[dtype] * magnitude + accumulation_bound(a, b) + SMALLEST_SUBNORMAL[dtype]
    error = float(np.max(np.abs(got - want), initial=0.0))
    assert error <= tolerance, f"{dtype}: max error {error:.3g} exceeds {tolerance:.3g}"
