"""The CUDA kernels against numpy on a GPU host, without TensorFlow: a pytest module and a benchmark.

Usage:
    make cuda && python -m pytest tests/gpu            # the checks; they skip without a GPU
    python tests/gpu/test_cuda.py [--library build/libadasum_cuda.so] [--size-log2 26]   # bandwidth

Loads the launchers of kernels/adasum_cuda.cu through ctypes and runs them on device buffers from
cupy (or torch when cupy is missing). Every dtype is checked on the same hard cases as the CPU op
tests (tests/support/cases.py) against the float64 oracle in tests/support/oracle.py, with the exact
properties checked bitwise. As a script it also measures the fused pair's memory bandwidth against a
device-to-device copy and prints JSON lines.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import pytest  # noqa: E402

from tests.support import oracle  # noqa: E402
from tests.support.cases import CASES, case_orthogonal, dtype_codes  # noqa: E402

DTYPE_CODES = dtype_codes()


class Device:
    """The few device operations the harness needs, from cupy or torch."""

    def __init__(self) -> None:
        try:
            import cupy

            self.cupy: Any = cupy
            self.torch: Any = None
        except ImportError:
            import torch

            self.cupy, self.torch = None, torch

    def upload(self, array: np.ndarray, dtype: str) -> Any:
        if self.cupy is not None:
            if dtype == "bfloat16":  # cupy has no bfloat16: move the raw bits
                bits = array.astype(np.float32).view(np.uint32) >> 16
                return self.cupy.asarray(bits.astype(np.uint16))
            return self.cupy.asarray(array.astype(dtype))
        torch_dtype = getattr(self.torch, dtype)
        return self.torch.tensor(array.astype(np.float64)).to(torch_dtype).cuda()

    def download(self, buffer: Any, dtype: str) -> np.ndarray:
        if self.cupy is not None:
            host = self.cupy.asnumpy(buffer)
            if dtype == "bfloat16":
                return (host.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
            return host.astype(np.float64)
        return buffer.double().cpu().numpy()

    def pointer(self, buffer: Any) -> int:
        return int(buffer.data.ptr) if self.cupy is not None else int(buffer.data_ptr())

    def empty_bytes(self, n: int) -> Any:
        n = max(n, 1)
        if self.cupy is not None:
            return self.cupy.empty(n, dtype=self.cupy.uint8)
        return self.torch.empty(n, dtype=self.torch.uint8, device="cuda")

    def copy(self, dst: Any, src: Any) -> None:
        if self.cupy is not None:
            self.cupy.copyto(dst, src)
        else:
            dst.copy_(src)

    def time_ms(self, fn: Any, repeats: int) -> float:
        fn()
        if self.cupy is not None:
            start, stop = self.cupy.cuda.Event(), self.cupy.cuda.Event()
        else:
            start, stop = self.torch.cuda.Event(enable_timing=True), self.torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(repeats):
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(
                self.cupy.cuda.get_elapsed_time(start, stop) if self.cupy else start.elapsed_time(stop)
            )
        return float(np.median(times))

    def synchronize(self) -> None:
        if self.cupy is not None:
            self.cupy.cuda.Device().synchronize()
        else:
            self.torch.cuda.synchronize()


def load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    i64p, vpp = ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_void_p)
    lib.adasum_cuda_workspace_bytes.argtypes = [ctypes.c_int, i64p]
    lib.adasum_cuda_workspace_bytes.restype = ctypes.c_size_t
    ptr, dp, i32 = ctypes.c_void_p, ctypes.POINTER(ctypes.c_double), ctypes.c_int
    # (dtype, n, a, b, sizes, dot_norms on the device, workspace, stream)
    lib.adasum_cuda_dot_norms.argtypes = [i32, i32, vpp, vpp, i64p, ptr, ptr, ptr]
    # (dtype, n, a, b, dot_norms on the host, out, sizes, workspace, stream)
    lib.adasum_cuda_combine.argtypes = [i32, i32, vpp, vpp, dp, vpp, i64p, ptr, ptr]
    lib.adasum_cuda_error_string.restype = ctypes.c_char_p
    return lib


class Pair:
    """One adasum_pair call's buffers and launcher arguments."""

    def __init__(self, lib: ctypes.CDLL, dev: Device, a: list[np.ndarray], b: list[np.ndarray], dtype: str):
        self.lib, self.dev, self.dtype, self.n = lib, dev, dtype, len(a)
        self.a = [dev.upload(x, dtype) for x in a]
        self.b = [dev.upload(y, dtype) for y in b]
        self.out = [dev.upload(np.zeros_like(x), dtype) for x in a]
        void_array = ctypes.c_void_p * self.n
        self.a_ptrs = void_array(*[dev.pointer(x) for x in self.a])
        self.b_ptrs = void_array(*[dev.pointer(x) for x in self.b])
        self.out_ptrs = void_array(*[dev.pointer(x) for x in self.out])
        self.sizes = (ctypes.c_int64 * self.n)(*[x.size for x in a])
        self.workspace = dev.empty_bytes(lib.adasum_cuda_workspace_bytes(self.n, self.sizes))
        self.dot_norms = dev.upload(np.zeros(3 * self.n), "float64")

    def check(self, error: int) -> None:
        if error:
            raise RuntimeError(self.lib.adasum_cuda_error_string(error).decode())

    def run(self) -> np.ndarray:
        self.check(
            self.lib.adasum_cuda_dot_norms(
                DTYPE_CODES[self.dtype],
                self.n,
                self.a_ptrs,
                self.b_ptrs,
                self.sizes,
                self.dev.pointer(self.dot_norms),
                self.dev.pointer(self.workspace),
                None,
            )
        )
        host = self.dev.download(self.dot_norms, "float64")  # combine takes dot_norms on the host
        self.check(
            self.lib.adasum_cuda_combine(
                DTYPE_CODES[self.dtype],
                self.n,
                self.a_ptrs,
                self.b_ptrs,
                host.ctypes.data_as(ctypes.POINTER(ctypes.c_double)),
                self.out_ptrs,
                self.sizes,
                self.dev.pointer(self.workspace),
                None,
            )
        )
        self.dev.synchronize()
        return host.reshape(self.n, 3)


def rounded(values: np.ndarray, dtype: str) -> np.ndarray:
    """The values the device sees after upload, in float64."""
    if dtype == "bfloat16":
        bits = values.astype(np.float32).view(np.uint32) >> 16
        return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return values.astype(dtype).astype(np.float64)


LIBRARY = ROOT / "build" / "libadasum_cuda.so"


def gpu_available() -> str | None:
    """Why the CUDA checks cannot run here, or None when they can."""
    try:
        device = Device()
    except ImportError:
        return "neither cupy nor torch is installed"
    try:
        if device.cupy is not None:
            count = device.cupy.cuda.runtime.getDeviceCount()
        else:
            count = device.torch.cuda.device_count()
    except Exception as error:  # a CUDA runtime without a driver raises its own types
        return f"no usable CUDA device ({type(error).__name__}: {error})"
    return None if count else "no CUDA device"


@pytest.fixture(scope="module")
def cuda() -> tuple[ctypes.CDLL, Device]:
    reason = gpu_available()
    if reason:
        pytest.skip(f"no GPU here: {reason}")
    if not LIBRARY.exists():
        import subprocess

        subprocess.run(["make", "-C", str(ROOT), "cuda"], check=True, timeout=900)
    return load(LIBRARY), Device()


def run_pair(cuda: tuple[ctypes.CDLL, Device], a: list[np.ndarray], b: list[np.ndarray], dtype: str) -> tuple:
    lib, dev = cuda
    a_in, b_in = (
        [rounded(np.asarray(x, np.float64), dtype) for x in a],
        [rounded(np.asarray(y, np.float64), dtype) for y in b],
    )
    pair = Pair(lib, dev, a_in, b_in, dtype)
    pair.run()
    return [dev.download(out, dtype) for out in pair.out], a_in, b_in


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__[5:])
@pytest.mark.parametrize("dtype", list(DTYPE_CODES))
def test_pair_matches_the_oracle_on_the_gpu(cuda: tuple[ctypes.CDLL, Device], dtype: str, case: Any) -> None:
    a, b = case(np.random.default_rng(7), dtype)
    got, a_in, b_in = run_pair(cuda, a, b, dtype)
    for g, x, y in zip(got, a_in, b_in, strict=True):
        oracle.assert_adasum_close(g.astype(np.float64), x, y, dtype)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__[5:])
@pytest.mark.parametrize("dtype", list(DTYPE_CODES))
def test_combine_rounds_as_the_cpu_kernel(cuda: tuple[ctypes.CDLL, Device], dtype: str, case: Any) -> None:
    # Given the same (a.b, |a|^2, |b|^2), bit for bit the rounding the CPU kernel is tested against in
    # tests/test_ops.py: CPU and GPU combine alike. Their sums of squares differ in order, not in kind.
    a, b = case(np.random.default_rng(11), dtype)
    lib, dev = cuda
    a_in = [rounded(np.asarray(x, np.float64), dtype) for x in a]
    b_in = [rounded(np.asarray(y, np.float64), dtype) for y in b]
    pair = Pair(lib, dev, a_in, b_in, dtype)
    dot_norms = pair.run()
    for out, x, y, row in zip(pair.out, a_in, b_in, dot_norms, strict=True):
        want = oracle.combined_as_the_kernels_round(x, y, row, dtype)
        np.testing.assert_array_equal(dev.download(out, dtype).reshape(want.shape), want)


def test_bfloat16_with_a_huge_coefficient_is_rounded_once_on_the_gpu(
    cuda: tuple[ctypes.CDLL, Device],
) -> None:
    # As tests/test_ops.py checks on the CPU: ca = (1 + 2^-8 + 2^-30) 2^40, just above a bfloat16
    # midpoint, must round up; rounding through float32 first would land on the midpoint and go down.
    lib, dev = cuda
    ca = 2.0**40 + 2.0**32 + 2.0**10
    pair = Pair(lib, dev, [np.ones(4)], [np.zeros(4)], "bfloat16")
    row = np.array([2.0 - 2.0 * ca, 1.0, 0.0])
    pair.check(
        lib.adasum_cuda_combine(
            DTYPE_CODES["bfloat16"],
            1,
            pair.a_ptrs,
            pair.b_ptrs,
            row.ctypes.data_as(ctypes.POINTER(ctypes.c_double)),
            pair.out_ptrs,
            pair.sizes,
            dev.pointer(pair.workspace),
            None,
        )
    )
    dev.synchronize()
    got = dev.download(pair.out[0], "bfloat16")
    np.testing.assert_array_equal(got, np.full(4, (1 + 2.0**-7) * 2.0**40))
    np.testing.assert_array_equal(
        got, oracle.combined_as_the_kernels_round(np.ones(4), np.zeros(4), row, "bfloat16")
    )


@pytest.mark.parametrize("dtype", list(DTYPE_CODES))
def test_exact_properties_on_the_gpu(cuda: tuple[ctypes.CDLL, Device], dtype: str) -> None:
    rng = np.random.default_rng(3)
    a, b = case_orthogonal(rng, dtype)
    got, a_in, b_in = run_pair(cuda, a, b, dtype)
    for g, x, y in zip(got, a_in, b_in, strict=True):
        np.testing.assert_array_equal(
            g.astype(np.float64), rounded(x + y, dtype), err_msg="orthogonal: a + b"
        )
    x = [rng.standard_normal(1031), rng.standard_normal((5, 5))]
    got, x_in, _ = run_pair(cuda, x, [v.copy() for v in x], dtype)
    for g, want in zip(got, x_in, strict=True):
        np.testing.assert_array_equal(g.astype(np.float64), want, err_msg="adasum(a, a) = a")
    got, _, x_in = run_pair(cuda, [np.zeros_like(v) for v in x], x, dtype)
    for g, want in zip(got, x_in, strict=True):
        np.testing.assert_array_equal(g.astype(np.float64), want, err_msg="adasum(0, b) = b")
    ab, _, _ = run_pair(cuda, a, b, dtype)
    ba, _, _ = run_pair(cuda, b, a, dtype)
    for x_, y_ in zip(ab, ba, strict=True):
        np.testing.assert_array_equal(x_, y_, err_msg="symmetric, bitwise")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--library", type=Path, default=LIBRARY)
    parser.add_argument("--size-log2", type=int, default=26)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    lib, dev = load(args.library), Device()
    rng = np.random.default_rng(0)
    n = 2**args.size_log2
    for dtype in ("float32", "float16"):
        pair = Pair(lib, dev, [rng.standard_normal(n)], [rng.standard_normal(n)], dtype)
        itemsize = 2 if dtype == "float16" else 4
        pair_ms = dev.time_ms(pair.run, args.repeats)
        copy_ms = dev.time_ms(lambda p=pair: dev.copy(p.out[0], p.a[0]), args.repeats)
        copy_gbps = 2 * n * itemsize / copy_ms / 1e6
        pair_gbps = 5 * n * itemsize / pair_ms / 1e6
        row = {"bench": "pair", "dtype": dtype, "elements": n, "pair_ms": round(pair_ms, 4)}
        row |= {"copy_gbps": round(copy_gbps, 1), "pair_gbps": round(pair_gbps, 1)}
        print(json.dumps(row | {"copy_fraction": round(pair_gbps / copy_gbps, 3)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
