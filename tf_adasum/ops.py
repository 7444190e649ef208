"""The fused Adasum ops and the one loader of their compiled library.

    adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

Each op takes lists of tensors and treats every tensor on its own, as Adasum is defined per layer;
a whole list is one kernel launch. A single tensor is accepted too and gives a single tensor back.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import re
import warnings
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import tensorflow as tf

LIBRARY_PATH = Path(__file__).with_name("_adasum_ops.so")
REBUILD_HINT = "run `make build` in the tf_adasum checkout (or `pip install --no-build-isolation -e .`)"
FLOAT_DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64)

_MARKER = re.compile(rb"TF_ADASUM_BUILT_FOR_TF=([^;\x00]*);")
_GPU_MARKER = re.compile(rb"TF_ADASUM_GPU_KERNELS=([01]);")
GPU_BUILD_HINT = (
    "rebuild with `TF_ADASUM_CUDA=1 pip install --no-build-isolation -e .` (or `make build-gpu`), with "
    "TensorFlow's GPU wheel and nvcc installed"
)


def _library_path(path: str | os.PathLike[str] | None = None) -> Path:
    """`path`, else $TF_ADASUM_LIBRARY, else the library built into this package."""
    return Path(path or os.environ.get("TF_ADASUM_LIBRARY") or LIBRARY_PATH).resolve()


def built_with_cuda(path: str | os.PathLike[str] | None = None) -> bool:
    """Whether the compiled ops carry GPU kernels (a TF_ADASUM_CUDA=1 build), read without loading them."""
    library = _library_path(path)
    match = _GPU_MARKER.search(library.read_bytes()) if library.is_file() else None
    return bool(match and match.group(1) == b"1")


def load_library(path: str | os.PathLike[str] | None = None) -> ModuleType:
    """Loads the compiled ops, checking that they were built for the running TensorFlow.

    Args:
        path: the shared library; default `tf_adasum/_adasum_ops.so`, or `$TF_ADASUM_LIBRARY`.

    Returns:
        The op module from `tf.load_op_library`.

    Raises:
        ImportError: the library is missing, was built for another TensorFlow, or fails to load.
            The message names the path and how to rebuild.
    """
    return _load(_library_path(path))


@functools.cache
def _load(path: Path) -> ModuleType:
    if not path.is_file():
        raise ImportError(f"tf_adasum's compiled ops are missing: {path} does not exist; {REBUILD_HINT}")
    # Read the version marker without loading the library: a library built for another TensorFlow
    # can fail to load with an unhelpful symbol error, or load and crash later.
    match = _MARKER.search(path.read_bytes())
    built_for = match.group(1).decode() if match else "an unknown version"
    if built_for != tf.__version__:
        raise ImportError(
            f"{path} was built for TensorFlow {built_for} but TensorFlow {tf.__version__} is running; "
            f"{REBUILD_HINT}"
        )
    try:
        module = tf.load_op_library(str(path))
    except tf.errors.NotFoundError as error:
        raise ImportError(f"{path} could not be loaded ({error.message}); {REBUILD_HINT}") from error
    forced = os.environ.get("TF_ADASUM_CPU_PATH")
    if forced:
        _set_cpu_path(_c_library(path), forced, "TF_ADASUM_CPU_PATH=")
    if tf.config.list_physical_devices("GPU") and not built_with_cuda(path):
        warnings.warn(
            f"{path} was built without GPU kernels: the fused Adasum ops run on the CPU, and TensorFlow "
            f"copies GPU tensors there and back; {GPU_BUILD_HINT}",
            stacklevel=3,
        )
    return module


def as_tensor_list(op: str, tensors: Any) -> tuple[list[tf.Tensor], bool]:
    """Returns (tensors as a list, whether a single tensor was given); refuses None, naming it."""
    single = not isinstance(tensors, (list, tuple))
    items = [tensors] if single else list(tensors)
    for i, t in enumerate(items):
        if t is None:
            raise ValueError(f"{op}: tensor {i} of {len(items)} is None (a variable without a gradient?)")
    return [tf.convert_to_tensor(t) for t in items], single


def check_float_tensors(op: str, tensors: Sequence[tf.Tensor], one_dtype: bool = True) -> tf.DType | None:
    """Checks that all tensors are floating (and, with one_dtype, share a dtype); returns tensor 0's.

    Raises:
        TypeError: a non-floating dtype, or two dtypes where one is needed; the message names the tensor.
    """
    if not tensors:
        return None
    dtype = tensors[0].dtype
    for i, t in enumerate(tensors):
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(
                f"{op}: tensor {i} of {len(tensors)} has dtype {t.dtype.name}; Adasum needs float16, "
                "bfloat16, float32 or float64 (use op=tf_adasum.Sum or Average for other dtypes)"
            )
        if one_dtype and t.dtype != dtype:
            raise TypeError(
                f"{op}: tensor {i} of {len(tensors)} has dtype {t.dtype.name} but tensor 0 has "
                f"{dtype.name}; all tensors of one call must share a dtype"
            )
    return dtype


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

    Example:
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

    Example:
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


# The same core over numpy buffers, through C entry points of the same library (kernels/adasum_host.cc):
# the MPI engine runs the whole distributed algorithm on host buffers, with no TensorFlow op per step.
# The codes of kernels/adasum_dtypes.h (tests/test_ops.py checks that they agree).
_HOST_DTYPES = {"float16": 0, "bfloat16": 1, "float32": 2, "float64": 3}


@functools.cache
def _c_library(path: Path) -> ctypes.CDLL:
    """The library's C entry points (the same loaded library as TensorFlow's, not a second copy)."""
    library = ctypes.CDLL(str(path))
    for name in ("tf_adasum_cpu_path", "tf_adasum_cpu_paths", "tf_adasum_build_info"):
        getattr(library, name).restype = ctypes.c_char_p
    library.tf_adasum_set_cpu_path.argtypes = [ctypes.c_char_p]
    return library


def _cpu_paths(library: ctypes.CDLL) -> dict[str, bool]:
    listing = library.tf_adasum_cpu_paths().decode()
    return {name: flag == "1" for name, flag in (entry.split(":") for entry in listing.split(","))}


def _set_cpu_path(library: ctypes.CDLL, name: str | None, source: str = "") -> None:
    status = library.tf_adasum_set_cpu_path(name.encode() if name else None)
    if status == 0:
        return
    paths = _cpu_paths(library)
    runnable = ", ".join(n for n, ok in paths.items() if ok)
    if status == -1:
        raise ValueError(
            f"{source}{name!r}: no such CPU path in this library; it holds {', '.join(paths)}, of which this "
            f"CPU runs {runnable}"
        )
    raise ValueError(
        f"{source}{name!r}: this CPU lacks the instructions of that path; it runs {runnable} (the build "
        "holds more paths than a CPU needs, and picks the widest it runs)"
    )


def cpu_path() -> str:
    """The CPU path the ops run on now: "portable", "avx2", "avx512", "avx512bf16" (x86-64), or
    "custom" for a build with TF_ADASUM_ARCH_FLAGS."""
    return str(_host_library(os.environ.get("TF_ADASUM_LIBRARY")).tf_adasum_cpu_path().decode())


def set_cpu_path(name: str | None) -> str:
    """Runs the CPU ops on the path `name` from now on (None: the widest this CPU runs); returns the
    path before. Every path gives the same bits, so this is for tests, benchmarks and debugging;
    `TF_ADASUM_CPU_PATH=<name>` does the same when the library loads.

    Raises:
        ValueError: the library holds no such path, or this CPU cannot run it; the message lists those
            it can.
    """
    library = _host_library(os.environ.get("TF_ADASUM_LIBRARY"))
    before = library.tf_adasum_cpu_path().decode()
    _set_cpu_path(library, name)
    return str(before)


def build_info() -> dict[str, Any]:
    """How the loaded ops were built, and what they run on here.

    Returns:
        A dict: "tensorflow" (the version the library was built for), "compiler", "machine" (the target
        architecture), "flags" (the code-generation flags of every file), "arch_flags"
        (TF_ADASUM_ARCH_FLAGS at build time, [] for the portable build), "cpu_paths" (each path the
        library holds, with its own flags), "cuda" (GPU kernels built), and, from this process:
        "cpu_path" (the path in use), "cpu_paths_runnable" (which paths this CPU runs), "library" (the
        file).

    Example:
        >>> tf_adasum.ops.build_info()["cpu_path"]  # "avx2" on a CPU with AVX2 and no AVX-512
    """
    path = _library_path(os.environ.get("TF_ADASUM_LIBRARY"))
    library = _host(path)
    info: dict[str, Any] = json.loads(library.tf_adasum_build_info().decode())
    info["cpu_path"] = library.tf_adasum_cpu_path().decode()
    info["cpu_paths_runnable"] = _cpu_paths(library)
    info["library"] = str(path)
    return info


@functools.cache
def _host(path: Path) -> ctypes.CDLL:
    _load(path)  # the same checks first: present, and built for this TensorFlow
    library = _c_library(path)
    # Every pointer (buffers, bounds, results) travels as void*; counts, dtype codes and threads as int.
    pointer, count = ctypes.c_void_p, ctypes.c_int
    library.tf_adasum_segment_dot_norms.argtypes = [count, pointer, pointer, pointer, count, pointer, count]
    library.tf_adasum_copy_norms.argtypes = [count, count, pointer, pointer, pointer, pointer, pointer, count]
    library.tf_adasum_segment_combine.argtypes = [count, *[pointer] * 5, count, count]
    return library


@functools.cache
def _host_library(override: str | None) -> ctypes.CDLL:
    # Cached per $TF_ADASUM_LIBRARY: resolving the path costs a dozen stat calls, on every host call.
    return _host(_library_path(override))


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
    library = _host_library(os.environ.get("TF_ADASUM_LIBRARY"))
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
    library = _host_library(os.environ.get("TF_ADASUM_LIBRARY"))
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
