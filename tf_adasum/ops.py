"""The fused Adasum ops, on TensorFlow tensors and on host buffers, and how the loaded library was built.

    adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

Each op takes lists of tensors and treats every tensor on its own, as Adasum is defined per layer;
a whole list is one kernel launch. A single tensor is accepted too and gives a single tensor back.
"""

from __future__ import annotations

import ctypes
import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from tf_adasum.algorithm.tensor_lists import as_tensor_list, check_float_tensors, indices_by_dtype
from tf_adasum.common import loader
from tf_adasum.common.loader import built_with_cuda, load_library

__all__ = [
    "adasum_combine",
    "adasum_dot_norms",
    "adasum_pair",
    "adasum_segment_combine",
    "adasum_segment_dot_norms",
    "build_info",
    "built_with_cuda",
    "cpu_path",
    "host_copy_norms",
    "host_segment_combine",
    "host_segment_dot_norms",
    "load_library",
    "set_cpu_path",
    "squared_norms",
]


def _pairs(op: str, a_list: Any, b_list: Any) -> tuple[list[tf.Tensor], list[tf.Tensor], bool]:
    a, single_a = as_tensor_list(op, a_list)
    b, single_b = as_tensor_list(op, b_list)
    if len(a) != len(b) or single_a != single_b:
        raise ValueError(f"{op}: a has {len(a)} tensors but b has {len(b)}; they must pair up")
    check_float_tensors(op, a + b)
    return a, b, single_a


def adasum_dot_norms(a_list: Any, b_list: Any) -> tf.Tensor:
    """Per-tensor dot product and squared norms, accumulated in float64.

    Args:
        a_list: a tensor or a list of N floating tensors.
        b_list: the same number of tensors, b_i with the shape and dtype of a_i.

    Returns:
        A float64 tensor of shape [N, 3]; row i is (a_i.b_i, |a_i|^2, |b_i|^2).

    Raises:
        ValueError / InvalidArgumentError: the lists do not pair up in length or shape.
        TypeError: integer or mixed dtypes.

    Examples:
        >>> tf_adasum.ops.adasum_dot_norms([tf.ones(3)], [tf.ones(3)])  # [[3., 3., 3.]]
    """
    a, b, _ = _pairs("adasum_dot_norms", a_list, b_list)
    if not a:
        return tf.zeros([0, 3], tf.float64)
    return load_library().adasum_dot_norms(a=a, b=b)


def adasum_combine(a_list: Any, b_list: Any, dot_norms: Any) -> Any:
    """Combines each pair with Adasum's coefficients, given `adasum_dot_norms(a_list, b_list)`.

    A coefficient is exactly 1 where its squared norm is below sqrt(DBL_MIN), so a zero tensor leaves
    the other unchanged. float32 is combined in float64, float16 and bfloat16 in float32.

    Args:
        a_list: a tensor or a list of N floating tensors.
        b_list: the same number of tensors, b_i with the shape and dtype of a_i.
        dot_norms: float64 [N, 3], as returned by `adasum_dot_norms`.

    Returns:
        The combined tensors, in the structure of `a_list`.

    Raises:
        InvalidArgumentError: a non-finite row in dot_norms (NaN or Inf in the inputs).
    """
    a, b, single = _pairs("adasum_combine", a_list, b_list)
    if not a:
        return []
    dot_norms = tf.convert_to_tensor(dot_norms, dtype=tf.float64)
    out = load_library().adasum_combine(a=a, b=b, dot_norms=dot_norms)
    return out[0] if single else list(out)


def adasum_pair(a_list: Any, b_list: Any) -> Any:
    """Adasum of two replicas' tensors, per tensor: `adasum_combine(a, b, adasum_dot_norms(a, b))`.

    Examples:
        >>> tf_adasum.ops.adasum_pair([tf.constant([1.0, 0.0])], [tf.constant([0.0, 1.0])])  # [[1., 1.]]
    """
    a, b, single = _pairs("adasum_pair", a_list, b_list)
    if not a:
        return []
    lib = load_library()
    out = lib.adasum_combine(a=a, b=b, dot_norms=lib.adasum_dot_norms(a=a, b=b))
    return out[0] if single else list(out)


def adasum_segment_dot_norms(a: tf.Tensor, b: tf.Tensor, bounds: Any) -> tf.Tensor:
    """adasum_dot_norms over the pieces [bounds[i], bounds[i+1]) of two equal-length 1-D buffers.

    The distributed algorithm works on fused buffers; these let it combine per tensor without cutting
    the buffer into a list first.

    Args:
        a, b: 1-D floating tensors of one length and dtype.
        bounds: int64 [k + 1], from 0 to len(a), nondecreasing.

    Returns:
        float64 [k, 3].
    """
    check_float_tensors("adasum_segment_dot_norms", [tf.convert_to_tensor(a), tf.convert_to_tensor(b)])
    return load_library().adasum_segment_dot_norms(a=a, b=b, bounds=tf.cast(bounds, tf.int64))


def adasum_segment_combine(a: tf.Tensor, b: tf.Tensor, dot_norms: Any, bounds: Any) -> tf.Tensor:
    """adasum_combine over the pieces [bounds[i], bounds[i+1]) of two 1-D buffers; one 1-D result."""
    check_float_tensors("adasum_segment_combine", [tf.convert_to_tensor(a), tf.convert_to_tensor(b)])
    dot_norms = tf.convert_to_tensor(dot_norms, dtype=tf.float64)
    return load_library().adasum_segment_combine(
        a=a, b=b, dot_norms=dot_norms, bounds=tf.cast(bounds, tf.int64)
    )


# The same core over numpy buffers, through C entry points of the same library (kernels/adasum_c_api.cc):
# the MPI engine runs the whole distributed algorithm on host buffers, with no TensorFlow op per step.
# The codes of kernels/adasum_dtypes.h (tests/test_ops.py checks that they agree).
_HOST_DTYPES = {"float16": 0, "bfloat16": 1, "float32": 2, "float64": 3}


def squared_norms(tensors: list[Any]) -> tf.Tensor:
    """|t|^2 of each tensor, in float64, with one fused kernel per dtype."""
    out: list[Any] = [None] * len(tensors)
    for index in indices_by_dtype(tensors):
        group = [tensors[i] for i in index]
        rows = adasum_dot_norms(group, group)[:, 1]
        for j, i in enumerate(index):
            out[i] = rows[j]
    return tf.stack(out) if out else tf.zeros([0], tf.float64)


def cpu_path() -> str:
    """The CPU path the ops run on now: "portable", "avx2", "avx512", "avx512bf16" (x86-64), or
    "custom" for a build with TF_ADASUM_ARCH_FLAGS."""
    return str(loader.host_library().tf_adasum_cpu_path().decode())


def set_cpu_path(name: str | None) -> str:
    """Runs the CPU ops on the path `name` from now on (None: the widest this CPU runs); returns the
    path before. Every path gives the same bits, so this is for tests, benchmarks and debugging;
    `TF_ADASUM_CPU_PATH=<name>` does the same when the library loads.

    Raises:
        ValueError: the library holds no such path, or this CPU cannot run it; the message lists those
            it can.
    """
    library = loader.host_library()
    before = library.tf_adasum_cpu_path().decode()
    loader.set_cpu_path_of(library, name)
    return str(before)


def build_info() -> dict[str, Any]:
    """How the loaded ops were built, and what they run on here.

    Returns:
        A dict: "tensorflow" (the release the loaded library was built for), "releases" (the TensorFlow
        minor releases the installation serves, one library each), "compiler", "machine" (the target
        architecture), "flags" (the code-generation flags of every file), "arch_flags"
        (TF_ADASUM_ARCH_FLAGS at build time, [] for the portable build), "cpu_paths" (each path the
        library holds, with its own flags), "cuda" (GPU kernels built), and, from this process:
        "cpu_path" (the path in use), "cpu_paths_runnable" (which paths this CPU runs), "library" (the
        TensorFlow adapter that loaded) and "core" (the TensorFlow-free core beside it).

    Examples:
        >>> tf_adasum.ops.build_info()["cpu_path"]  # "avx2" on a CPU with AVX2 and no AVX-512
        >>> tf_adasum.ops.build_info()["tensorflow"]  # "2.21.0"
    """
    path = loader.library_path()
    library = loader.host_library_at(path)
    info: dict[str, Any] = json.loads(library.tf_adasum_build_info().decode())
    info["tensorflow"] = loader.built_for_tensorflow(path)
    info["releases"] = loader.served_releases(path.parent)
    info["cpu_path"] = library.tf_adasum_cpu_path().decode()
    info["cpu_paths_runnable"] = loader.cpu_paths(library)
    info["library"] = str(path)
    info["core"] = str(path.parent / loader.CORE)
    return info


def _host_call(a: np.ndarray, b: np.ndarray, bounds: Any) -> tuple[ctypes.CDLL, int, np.ndarray]:
    code = _HOST_DTYPES.get(a.dtype.name)
    if code is None or a.dtype != b.dtype or a.shape != b.shape or a.ndim != 1:
        raise TypeError(
            "expected two 1-D float16, bfloat16, float32 or float64 buffers of one length and dtype, "
            f"got {a.dtype.name}{list(a.shape)} and {b.dtype.name}{list(b.shape)}"
        )
    if not (a.flags.c_contiguous and b.flags.c_contiguous):
        raise ValueError("the buffers must be contiguous")
    edges = np.ascontiguousarray(bounds, np.int64)
    if len(edges) < 1 or edges[0] != 0 or edges[-1] != len(a) or np.any(np.diff(edges) < 0):
        raise ValueError(f"bounds must run from 0 to {len(a)} without decreasing, got {edges.tolist()}")
    library = loader.host_library()
    return library, code, edges


def host_segment_dot_norms(a: np.ndarray, b: np.ndarray, bounds: Any, threads: int = 1) -> np.ndarray:
    """adasum_segment_dot_norms on numpy buffers, on `threads` threads: float64 [k, 3]."""
    library, code, edges = _host_call(a, b, bounds)
    out = np.empty((len(edges) - 1, 3), np.float64)
    library.tf_adasum_segment_dot_norms(
        code, a.ctypes.data, b.ctypes.data, edges.ctypes.data, len(edges) - 1, out.ctypes.data, threads
    )
    return out


def host_segment_combine(
    a: np.ndarray, b: np.ndarray, dot_norms: np.ndarray, out: np.ndarray, bounds: Any, threads: int = 1
) -> None:
    """adasum_segment_combine on numpy buffers, written into `out` (which may be a or b).

    Raises:
        ValueError: a non-finite row of dot_norms, named; nothing is written then.
    """
    library, code, edges = _host_call(a, b, bounds)
    rows = np.ascontiguousarray(dot_norms, np.float64)
    if rows.shape != (len(edges) - 1, 3) or out.shape != a.shape or out.dtype != a.dtype:
        raise ValueError(
            f"expected dot_norms [{len(edges) - 1}, 3] and out {a.dtype.name}{list(a.shape)}, got "
            f"{list(rows.shape)} and {out.dtype.name}{list(out.shape)}"
        )
    status = library.tf_adasum_segment_combine(
        code,
        a.ctypes.data,
        b.ctypes.data,
        rows.ctypes.data,
        out.ctypes.data,
        edges.ctypes.data,
        len(edges) - 1,
        threads,
    )
    if status > 0:
        raise ValueError(
            f"piece {status - 1} of {len(edges) - 1} has a non-finite (a.b, |a|^2, |b|^2) = "
            f"{tuple(rows[status - 1])}: a or b holds NaN or Inf, or a squared norm overflows float64"
        )


def host_copy_norms(
    sources: Sequence[np.ndarray], dst: np.ndarray, starts: Any, threads: int = 1
) -> np.ndarray:
    """Copies sources[i] (C-contiguous, dst's dtype) to dst[starts[i]:] and returns |sources[i]|^2 in
    float64 (the squared norms adasum_dot_norms gives), in one pass over memory."""
    code = _HOST_DTYPES.get(dst.dtype.name)
    offsets = np.ascontiguousarray(starts, np.int64)
    sizes = np.array([x.size for x in sources], np.int64)
    if code is None or not dst.flags.c_contiguous or len(offsets) < len(sources):
        raise TypeError(f"expected a contiguous float buffer and a start per source, got {dst.dtype.name}")
    for i, x in enumerate(sources):
        if x.dtype != dst.dtype or not x.flags.c_contiguous or offsets[i] + x.size > dst.size:
            raise ValueError(
                f"source {i}: expected contiguous {dst.dtype.name} within the buffer, got {x.dtype.name} "
                f"of {x.size} at {offsets[i]} in {dst.size}"
            )
    pointers = (ctypes.c_void_p * max(1, len(sources)))(*[x.ctypes.data for x in sources])
    norms = np.empty(len(sources), np.float64)
    library = loader.host_library()
    library.tf_adasum_copy_norms(
        code,
        len(sources),
        pointers,
        sizes.ctypes.data,
        dst.ctypes.data,
        offsets.ctypes.data,
        norms.ctypes.data,
        threads,
    )
    return norms
