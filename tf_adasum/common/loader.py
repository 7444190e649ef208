"""The one loader of the compiled library: its path, the checks before it loads (present, built for the
running TensorFlow, with GPU kernels where there is a GPU), the TensorFlow op module, and the same
library's C entry points (ctypes), with the choice of its CPU path. tf_adasum.ops is the public face of
what it loads.

The package holds a TensorFlow-free core, `_adasum_core.so`, and an adapter per TensorFlow minor release,
`_adasum_ops_tf<major>_<minor>.so` (setup.py): the adapter of the running TensorFlow is the library that
loads, and it finds the core beside it. Its handle reaches the core's C entry points too.
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
import warnings
from pathlib import Path
from types import ModuleType

import tensorflow as tf

from tf_adasum.common import settings

PACKAGE = Path(__file__).parents[1]
CORE = "_adasum_core.so"
_ADAPTER = re.compile(r"_adasum_ops_tf(\d+)_(\d+)\.so")
REBUILD_HINT = (
    "build tf_adasum from source against this TensorFlow: `pip install --no-build-isolation .` in a "
    "checkout (`make build` there), see docs/install.md"
)

_MARKER = re.compile(rb"TF_ADASUM_BUILT_FOR_TF=([^;\x00]*);")
_GPU_MARKER = re.compile(rb"TF_ADASUM_GPU_KERNELS=([01]);")
GPU_BUILD_HINT = (
    "rebuild with `TF_ADASUM_CUDA=1 pip install --no-build-isolation -e .` (or `make build-gpu`), with "
    "TensorFlow's GPU wheel and nvcc installed"
)


def adapter_name(version: str) -> str:
    """The adapter's file for TensorFlow `version` (setup.py names them alike): 2.16.2 ->
    _adasum_ops_tf2_16.so."""
    major, minor = version.split(".")[:2]
    return f"_adasum_ops_tf{major}_{minor}.so"


def served_releases(folder: Path = PACKAGE) -> list[str]:
    """The TensorFlow minor releases the adapters in `folder` serve, oldest first ("2.16", ...)."""
    found = (_ADAPTER.fullmatch(p.name) for p in folder.glob("_adasum_ops_tf*.so"))
    return [f"{a}.{b}" for a, b in sorted((int(m[1]), int(m[2])) for m in found if m)]


def library_path(path: str | os.PathLike[str] | None = None) -> Path:
    """`path`, else $TF_ADASUM_LIBRARY, else this package's adapter for the running TensorFlow."""
    return Path(path or settings.library_override() or PACKAGE / adapter_name(tf.__version__)).resolve()


def built_for_tensorflow(path: Path) -> str:
    """The TensorFlow release the adapter at `path` was built for, read without loading it."""
    match = _MARKER.search(path.read_bytes())
    return match.group(1).decode() if match else "an unknown release"


def built_with_cuda(path: str | os.PathLike[str] | None = None) -> bool:
    """Whether the compiled ops carry GPU kernels (a TF_ADASUM_CUDA=1 build), read without loading them."""
    library = library_path(path)
    match = _GPU_MARKER.search(library.read_bytes()) if library.is_file() else None
    return bool(match and match.group(1) == b"1")


def load_library(path: str | os.PathLike[str] | None = None) -> ModuleType:
    """Loads the compiled ops, checking that they were built for the running TensorFlow.

    Args:
        path: the adapter library; default this package's for the running TensorFlow, or
            `$TF_ADASUM_LIBRARY`. The core must be beside it.

    Returns:
        The op module from `tf.load_op_library`.

    Raises:
        ImportError: the library is missing, was built for another TensorFlow release, or fails to
            load. The message names the path, the releases the package serves, and how to build.
    """
    return _load(library_path(path))


@functools.cache
def _load(path: Path) -> ModuleType:
    if not path.is_file():
        served = served_releases(path.parent)
        if served:
            raise ImportError(
                f"tf_adasum has no op library for TensorFlow {tf.__version__}, which is running: "
                f"{path.parent} serves TensorFlow {', '.join(served)}. Install one of those releases, "
                f"or {REBUILD_HINT}"
            )
        raise ImportError(f"tf_adasum's compiled ops are missing: {path} does not exist; {REBUILD_HINT}")
    if not (path.parent / CORE).is_file():
        raise ImportError(
            f"tf_adasum's compiled core is missing: {path.parent / CORE} does not exist beside {path.name}; "
            f"{REBUILD_HINT}"
        )
    # Read the version marker without loading the library: a library built for another TensorFlow
    # release can fail to load with an unhelpful symbol error, or load and crash later. Patch releases
    # of one minor release keep its ABI.
    built_for = built_for_tensorflow(path)
    if built_for.split(".")[:2] != tf.__version__.split(".")[:2]:
        raise ImportError(
            f"{path} was built for TensorFlow {built_for} but TensorFlow {tf.__version__} is running; "
            f"{REBUILD_HINT}"
        )
    try:
        module = tf.load_op_library(str(path))
    except tf.errors.NotFoundError as error:
        raise ImportError(f"{path} could not be loaded ({error.message}); {REBUILD_HINT}") from error
    forced = settings.forced_cpu_path()
    if forced:
        set_cpu_path_of(c_library(path), forced, "TF_ADASUM_CPU_PATH=")
    if tf.config.list_physical_devices("GPU") and not built_with_cuda(path):
        warnings.warn(
            f"{path} was built without GPU kernels: the fused Adasum ops run on the CPU, and TensorFlow "
            f"copies GPU tensors there and back; {GPU_BUILD_HINT}",
            stacklevel=3,
        )
    return module


@functools.cache
def c_library(path: Path) -> ctypes.CDLL:
    """The library's C entry points (the same loaded library as TensorFlow's, not a second copy)."""
    library = ctypes.CDLL(str(path))
    for name in ("tf_adasum_cpu_path", "tf_adasum_cpu_paths", "tf_adasum_build_info"):
        getattr(library, name).restype = ctypes.c_char_p
    library.tf_adasum_set_cpu_path.argtypes = [ctypes.c_char_p]
    return library


def cpu_paths(library: ctypes.CDLL) -> dict[str, bool]:
    listing = library.tf_adasum_cpu_paths().decode()
    return {name: flag == "1" for name, flag in (entry.split(":") for entry in listing.split(","))}


def set_cpu_path_of(library: ctypes.CDLL, name: str | None, source: str = "") -> None:
    status = library.tf_adasum_set_cpu_path(name.encode() if name else None)
    if status == 0:
        return
    paths = cpu_paths(library)
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


@functools.cache
def host_library_at(path: Path) -> ctypes.CDLL:
    _load(path)  # the same checks first: present, and built for this TensorFlow
    library = c_library(path)
    # Every pointer (buffers, bounds, results) travels as void*; counts, dtype codes and threads as int.
    pointer, count = ctypes.c_void_p, ctypes.c_int
    library.tf_adasum_segment_dot_norms.argtypes = [count, pointer, pointer, pointer, count, pointer, count]
    library.tf_adasum_copy_norms.argtypes = [count, count, pointer, pointer, pointer, pointer, pointer, count]
    library.tf_adasum_segment_combine.argtypes = [count, *[pointer] * 5, count, count]
    return library


def host_library() -> ctypes.CDLL:
    """The library's C entry points, ready for the host ops, from the library that loads (checked)."""
    return _host_library(settings.library_override())


@functools.cache
def _host_library(override: str | None) -> ctypes.CDLL:
    # Cached per $TF_ADASUM_LIBRARY: resolving the path costs a dozen stat calls, on every host call.
    return host_library_at(library_path(override))
