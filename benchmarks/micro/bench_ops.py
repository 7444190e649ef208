"""Speed of the fused Adasum ops against the same math as composite TensorFlow ops, and of the portable
build's CPU dispatch against a -march=native build of the same core.

Usage:
    python benchmarks/micro/bench_ops.py [--min-log2 10] [--max-log2 24] [--repeats 15] \
        [--dtypes float32 float16]
    python benchmarks/micro/bench_ops.py --against-native [--min-log2 16] [--dtypes float32 bfloat16]

--against-native builds the TensorFlow-free core once more with -march=native (one path, as
TF_ADASUM_ARCH_FLAGS=-march=native builds it) into build/bench_native/, and times the fused pair
(dot and norms, then combine, through the C entry points the MPI engine uses, on every core) with both
libraries in one process, alternating call by call. One JSON line per case:
    path             the CPU path the installed library chose (tf_adasum.ops.cpu_path())
    dispatched_ms    the installed library, median over repeats
    native_ms        the -march=native build
    portable_ms      the installed library forced onto its portable path (what a build for the x86-64
                     baseline alone would give)
    dispatched_gbps  bytes the pair moves (read a, b twice; write out once) over dispatched_ms
    of_native        native_ms / dispatched_ms: the dispatched build's bandwidth as a fraction of native's

Without --against-native, the TensorFlow ops against composite ops:

Prints one JSON line per case. Every figure is measured in this run:
    fused_ms         adasum_pair (DotNorms + Combine) inside a tf.function, median over repeats
    composite_ms     the same math (float64 sums, guarded coefficients, float64 combine) as composite
                     TensorFlow ops in a tf.function: the baseline
    composite_f32_ms the usual shortcut, composite ops summing in the input dtype (less accurate)
    copy_gbps        bandwidth of numpy copying one buffer (read + write), the machine's practical peak
    fused_gbps       bytes the fused pair must move (read a, b twice; write out once) over fused_ms
    speedup          composite_ms / fused_ms
    copy_fraction    fused_gbps / copy_gbps
    allocator        "default": TensorFlow's CPU allocator, which maps fresh pages for every large
                     output, so page faults are part of each call; "bfc": TF_CPU_ALLOCATOR_USE_BFC=true,
                     which reuses memory. Without --allocator, both run, each in its own process.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# Run as `python benchmarks/micro/bench_ops.py`: benchmarks/ (common.py) on the path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
from common import composite_pair, median_ms, resnet50_shapes


def copy_gbps(nbytes: int, repeats: int) -> float:
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    ms = median_ms(lambda: np.copyto(dst, src), repeats)
    return 2 * nbytes / ms / 1e6


def run_case(name: str, shapes: list[tuple[int, ...]], dtype: str, repeats: int) -> dict[str, Any]:
    import tensorflow as tf

    from tf_adasum import ops

    rng = np.random.default_rng(1)
    np_dtype = tf.as_dtype(dtype).as_numpy_dtype
    a = [tf.constant(rng.standard_normal(s).astype(np_dtype)) for s in shapes]
    b = [tf.constant(rng.standard_normal(s).astype(np_dtype)) for s in shapes]
    elements = sum(int(np.prod(s)) for s in shapes)
    nbytes = elements * tf.as_dtype(dtype).size

    fused = tf.function(lambda: ops.adasum_pair(a, b))
    composite = tf.function(lambda: composite_pair(a, b, tf.float64))
    composite_f32 = tf.function(lambda: composite_pair(a, b, tf.float32))
    # np.asarray on one output waits for the whole call and shares the output's memory. Not .numpy(),
    # which copies it: for one tensor of 2^24 elements, a 64 MB copy into fresh pages on every call.
    fused_ms = median_ms(lambda: np.asarray(fused()[0]), repeats)
    composite_ms = median_ms(lambda: np.asarray(composite()[0]), repeats)
    composite_f32_ms = median_ms(lambda: np.asarray(composite_f32()[0]), repeats)
    copy = copy_gbps(nbytes, repeats)
    fused_gbps = 5 * nbytes / fused_ms / 1e6
    return {
        "case": name,
        "allocator": "bfc" if os.environ.get("TF_CPU_ALLOCATOR_USE_BFC") == "true" else "default",
        "dtype": dtype,
        "tensors": len(shapes),
        "elements": elements,
        "fused_ms": round(fused_ms, 4),
        "composite_ms": round(composite_ms, 4),
        "composite_f32_ms": round(composite_f32_ms, 4),
        "copy_gbps": round(copy, 2),
        "fused_gbps": round(fused_gbps, 2),
        "speedup": round(composite_ms / fused_ms, 2),
        "speedup_vs_f32_composite": round(composite_f32_ms / fused_ms, 2),
        "copy_fraction": round(fused_gbps / copy, 3),
    }


ROOT = Path(__file__).resolve().parents[2]


def build_native_core() -> Path:
    """The TensorFlow-free core built with -march=native, one path: build/bench_native/libadasum_native.so."""
    out = ROOT / "build" / "bench_native"
    out.mkdir(parents=True, exist_ok=True)
    library = out / "libadasum_native.so"
    flags = ["-O3", "-fPIC", "-ffp-contract=off", "-std=c++17", "-march=native", "-DADASUM_CPU_PATH_CUSTOM"]
    objects = []
    sources = [
        ("adasum_cpu.cc", []),
        ("adasum_c_api.cc", []),
        ("adasum_cpu_path.cc", ["-DADASUM_CPU_PATH=custom"]),
    ]
    for source, extra in sources:
        obj = out / (Path(source).stem + ".o")
        subprocess.run(
            ["g++", *flags, *extra, "-c", str(ROOT / "kernels" / source), "-o", str(obj)], check=True
        )
        objects.append(str(obj))
    subprocess.run(["g++", "-shared", *objects, "-o", str(library), "-lpthread"], check=True)
    return library


def fused_pair(
    library: ctypes.CDLL, code: int, a: np.ndarray, b: np.ndarray, out: np.ndarray, threads: int
) -> Any:
    """One call of the fused pair through a library's C entry points: dot and norms, then combine."""
    bounds = np.array([0, a.size], np.int64)
    rows = np.empty((1, 3), np.float64)
    pointers = [x.ctypes.data for x in (a, b, bounds, rows, out)]

    def call() -> None:
        library.tf_adasum_segment_dot_norms(code, *pointers[:3], 1, pointers[3], threads)
        library.tf_adasum_segment_combine(
            code, *pointers[:2], pointers[3], pointers[4], pointers[2], 1, threads
        )

    return call


def against_native(args: argparse.Namespace) -> None:
    import ml_dtypes

    from tf_adasum import ops
    from tf_adasum.common import loader

    installed = loader.host_library_at(loader.library_path())
    native = ctypes.CDLL(str(build_native_core()))
    pointer, count = ctypes.c_void_p, ctypes.c_int
    native.tf_adasum_segment_dot_norms.argtypes = [count, pointer, pointer, pointer, count, pointer, count]
    native.tf_adasum_segment_combine.argtypes = [count, *[pointer] * 5, count, count]
    codes = {"float16": 0, "bfloat16": 1, "float32": 2, "float64": 3}
    numpy_types = {
        "float16": np.float16,
        "bfloat16": ml_dtypes.bfloat16,
        "float32": np.float32,
        "float64": np.float64,
    }
    threads = os.cpu_count() or 1
    path = ops.cpu_path()
    for dtype in args.dtypes:
        for log2 in range(args.min_log2, args.max_log2 + 1, 2):
            rng = np.random.default_rng(log2)
            a = rng.standard_normal(2**log2).astype(numpy_types[dtype])
            b = rng.standard_normal(2**log2).astype(numpy_types[dtype])
            out = np.empty_like(a)
            dispatched = fused_pair(installed, codes[dtype], a, b, out, threads)
            calls = {
                "dispatched": dispatched,
                "native": fused_pair(native, codes[dtype], a, b, out, threads),
                "portable": dispatched,  # the same call, with the library switched to its portable path
            }
            # Alternating call by call, so that all see the same machine: this one is shared and noisy.
            times: dict[str, list[float]] = {name: [] for name in calls}
            for i in range(2 + args.repeats):
                for name, call in calls.items():
                    ops.set_cpu_path("portable" if name == "portable" else None)
                    start = time.perf_counter()
                    call()
                    if i >= 2:
                        times[name].append(time.perf_counter() - start)
            ops.set_cpu_path(None)
            ms = {name: 1e3 * float(np.median(t)) for name, t in times.items()}
            nbytes = 5 * a.nbytes
            print(json.dumps({
                "case": f"single_2^{log2}", "dtype": dtype, "elements": a.size, "threads": threads,
                "path": path,
                "dispatched_ms": round(ms["dispatched"], 4), "native_ms": round(ms["native"], 4),
                "portable_ms": round(ms["portable"], 4),
                "dispatched_gbps": round(nbytes / ms["dispatched"] / 1e6, 2),
                "of_native": round(ms["native"] / ms["dispatched"], 3),
            }), flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--min-log2", type=int, default=10)
    parser.add_argument("--max-log2", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "float16"])
    parser.add_argument("--allocator", choices=["default", "bfc"])
    parser.add_argument(
        "--against-native", action="store_true", help="the dispatched build against -march=native"
    )
    args = parser.parse_args()
    if args.against_native:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        if "--dtypes" not in sys.argv:
            args.dtypes = ["float32", "bfloat16"]
        if "--min-log2" not in sys.argv:
            args.min_log2 = 16
        against_native(args)
        return
    if args.allocator is None:
        # The allocator is fixed when TensorFlow starts, so each one gets a process of its own.
        for allocator in ("default", "bfc"):
            subprocess.run([sys.executable, __file__, *sys.argv[1:], "--allocator", allocator], check=True)
        return
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if args.allocator == "bfc":
        os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"

    resnet = resnet50_shapes()
    for dtype in args.dtypes:
        for log2 in range(args.min_log2, args.max_log2 + 1, 2):
            print(json.dumps(run_case(f"single_2^{log2}", [(2**log2,)], dtype, args.repeats)), flush=True)
        print(json.dumps(run_case("resnet50_161_tensors", resnet, dtype, args.repeats)), flush=True)


if __name__ == "__main__":
    main()
