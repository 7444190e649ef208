"""The op library's build: which devices TensorFlow's kernel registry lists for every op.

`make test-gpu-build` runs this with the TF_ADASUM_CUDA=1 library, built against TensorFlow's GPU wheel
(TF_ADASUM_EXPECT_GPU_KERNELS=1): every op must then have a GPU kernel for every dtype, even on a machine
without a GPU. The default CPU build must have CPU kernels only, and say so.
"""

from __future__ import annotations

import os

import pytest
import tensorflow as tf
from tensorflow.python.framework import kernels

from tf_adasum import ops

OPS = ["Adasum>DotNorms", "Adasum>Combine", "Adasum>SegmentDotNorms", "Adasum>SegmentCombine"]
DTYPES = {tf.float16, tf.bfloat16, tf.float32, tf.float64}


def registered(op: str, device: str) -> set[tf.DType]:
    """The dtypes of `op`'s kernels for `device` in TensorFlow's registry."""
    found = set()
    for kernel in kernels.get_registered_kernels_for_op(op).kernel:
        if kernel.device_type == device:
            for constraint in kernel.constraint:
                if constraint.name == "T":
                    found |= {tf.as_dtype(t) for t in constraint.allowed_values.list.type}
    return found


@pytest.fixture(scope="module", autouse=True)
def library() -> None:
    ops.load_library()


@pytest.mark.parametrize("op", OPS)
def test_every_op_has_a_cpu_kernel_per_dtype(op: str) -> None:
    assert registered(op, "CPU") == DTYPES


@pytest.mark.parametrize("op", OPS)
def test_gpu_kernels_are_there_exactly_when_the_library_says_so(op: str) -> None:
    gpu = registered(op, "GPU")
    if os.environ.get("TF_ADASUM_EXPECT_GPU_KERNELS") == "1":
        assert tf.test.is_built_with_cuda(), "make test-gpu-build runs with TensorFlow's GPU wheel"
        assert ops.built_with_cuda(), "the TF_ADASUM_CUDA=1 build must record its GPU kernels"
    assert gpu == (DTYPES if ops.built_with_cuda() else set()), f"{op} GPU kernels: {sorted(map(str, gpu))}"
