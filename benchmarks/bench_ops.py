"""Speed of the fused Adasum ops against the same math as composite TensorFlow ops.

Usage:
    python benchmarks/bench_ops.py [--min-log2 10] [--max-log2 24] [--repeats 15] [--dtypes float32 float16]

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
import json
import os
import subprocess
import sys
from typing import Any

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


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--min-log2", type=int, default=10)
    parser.add_argument("--max-log2", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "float16"])
    parser.add_argument("--allocator", choices=["default", "bfc"])
    args = parser.parse_args()
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
