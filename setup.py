"""Builds kernels/ into tf_adasum/_adasum_ops.so against the installed TensorFlow.

`pip install .` and `pip install -e .` both run this. The compiler and link flags come from
`tf.sysconfig`, so the library matches the TensorFlow it will be loaded into. Compiler output goes to
build/adasum_build.log; on failure its end is shown.

Environment:
    TF_ADASUM_ARCH_FLAGS: CPU code-generation flags (default "-march=native"). Set it, for example to
        "-mavx2 -mfma -mf16c", when the library is built on one machine and run on others.
    TF_ADASUM_CUDA=1: also compile the CUDA kernels (kernels/adasum_cuda.cu, with nvcc) and register
        the ops' GPU kernels. Needs TensorFlow's GPU wheel (`tensorflow==2.21.0`), whose headers carry
        CUDA's, and nvcc: $NVCC, else $CUDA_HOME/bin/nvcc, else nvcc on PATH, else
        /usr/local/cuda/bin/nvcc. Without either the build stays CPU-only and says why, in the build
        log and at import (tf_adasum.ops.built_with_cuda() tells which it is).
    TF_ADASUM_CUDA_ARCHS: nvcc's -gencode flags (default: Turing, Ampere, Hopper, and PTX for newer).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
SOURCES = ["kernels/adasum_cpu.cc", "kernels/adasum_host.cc", "kernels/adasum_ops.cc"]
LIBRARY = "tf_adasum/_adasum_ops.so"

CUDA_SOURCE = "kernels/adasum_cuda.cu"
CUDA_ARCHS = (
    "-gencode arch=compute_75,code=sm_75 -gencode arch=compute_80,code=sm_80 "
    "-gencode arch=compute_90,code=[sm_90,compute_90]"
)

_QUERY = (
    "import json, tensorflow as tf; "
    "print(json.dumps([tf.__version__, tf.sysconfig.get_compile_flags(), tf.sysconfig.get_link_flags(), "
    "tf.test.is_built_with_cuda()]))"
)


def find_nvcc() -> str | None:
    for candidate in (
        os.environ.get("NVCC"),
        os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc") if os.environ.get("CUDA_HOME") else None,
        shutil.which("nvcc"),
        "/usr/local/cuda/bin/nvcc",
    ):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def cuda_root(nvcc: str) -> Path:
    """The CUDA toolkit nvcc belongs to (nvcc may be a wrapper script elsewhere): nvcc says where it is."""
    probe = subprocess.run(
        [nvcc, "--dryrun", "-c", str(ROOT / CUDA_SOURCE), "-o", os.devnull],
        capture_output=True,
        text=True,
        check=False,
    )
    for line in (probe.stdout + probe.stderr).splitlines():
        if line.startswith("#$ TOP="):
            return Path(line.split("=", 1)[1]).resolve()
    return Path(nvcc).resolve().parent.parent


def cuda_plan(tf_has_cuda: bool, include_dirs: list[str]) -> tuple[str | None, str]:
    """(nvcc to build the GPU kernels with, or None; why, for the log)."""
    if os.environ.get("TF_ADASUM_CUDA", "0") != "1":
        return None, "CPU-only build (set TF_ADASUM_CUDA=1 to build the GPU kernels)"
    if not tf_has_cuda:
        return None, (
            "TF_ADASUM_CUDA=1, but the installed TensorFlow has no CUDA support (tensorflow-cpu?): building "
            "CPU-only; install the GPU wheel, `pip install tensorflow==2.21.0`"
        )
    if not any((Path(d) / "third_party/gpus/cuda/include/cuda_runtime_api.h").exists() for d in include_dirs):
        return None, "TF_ADASUM_CUDA=1, but TensorFlow's headers carry no CUDA headers: building CPU-only"
    nvcc = find_nvcc()
    if nvcc is None:
        return None, "TF_ADASUM_CUDA=1, but no nvcc was found ($NVCC, $CUDA_HOME, PATH): building CPU-only"
    return nvcc, f"building the GPU kernels with {nvcc}"


def tensorflow_build_info() -> tuple[str, list[str], list[str], bool]:
    """Returns (version, compile flags, link flags, built with CUDA) of this interpreter's TensorFlow.

    pip builds in an isolated environment that hides the installed TensorFlow, so the query runs in a
    fresh interpreter without pip's PYTHONPATH, which sees the real site-packages.
    """
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONNOUSERSITE")}
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    result = subprocess.run(
        [sys.executable, "-c", _QUERY], env=env, capture_output=True, text=True, cwd="/", check=False
    )
    if result.returncode != 0:
        raise RuntimeError(
            "tf_adasum builds its ops against the installed TensorFlow, but "
            f"`{sys.executable} -c 'import tensorflow'` failed:\n{result.stderr[-2000:]}\n"
            "Install TensorFlow first, for example `pip install tensorflow-cpu==2.21.0`."
        )
    version, cflags, lflags, has_cuda = json.loads(result.stdout.strip().splitlines()[-1])
    return version, cflags, lflags, has_cuda


class BuildAdasumOps(build_ext):
    """Compiles the ops with $CXX (default g++) and TensorFlow's own flags instead of distutils' defaults."""

    def get_ext_filename(self, fullname: str) -> str:
        # A plain `_adasum_ops.so`, without the interpreter tag: the library depends on TensorFlow's
        # ABI, not Python's. setuptools calls this with both the dotted and the bare name.
        return os.path.join(*fullname.split(".")[:-1], Path(LIBRARY).name)

    def build_extension(self, ext: Extension) -> None:
        version, cflags, lflags, tf_has_cuda = tensorflow_build_info()
        output = Path(self.get_ext_fullpath(ext.name))
        output.parent.mkdir(parents=True, exist_ok=True)
        build_dir = ROOT / "build"
        build_dir.mkdir(exist_ok=True)
        log_path = build_dir / "adasum_build.log"
        arch = shlex.split(os.environ.get("TF_ADASUM_ARCH_FLAGS", "-march=native"))
        compiler = shlex.split(os.environ.get("CXX") or "g++")
        nvcc, plan = cuda_plan(tf_has_cuda, [f[2:] for f in cflags if f.startswith("-I")])
        # TensorFlow's own headers trip these two warnings by the hundred.
        quiet = ["-Wno-deprecated-declarations", "-Wno-interference-size"]
        # No FMA contraction: fma(ca, a, cb * b) would differ from fma(cb, b, ca * a), and Adasum must be
        # bitwise symmetric.
        common = [
            "-O3",
            "-fPIC",
            "-ffp-contract=off",
            "-Wall",
            *quiet,
            *arch,
            f'-DTF_ADASUM_BUILT_FOR_TF="{version}"',
            *cflags,
        ]
        if nvcc:
            # Eigen includes cuda_runtime.h itself; TensorFlow's GPU wheel carries CUDA's headers here.
            cuda_headers = [f"{f}/third_party/gpus/cuda/include" for f in cflags if f.startswith("-I")]
            common += ["-DGOOGLE_CUDA=1", *cuda_headers]
        commands = [
            [*compiler, *common, "-c", str(ROOT / src), "-o", str(build_dir / (Path(src).stem + ".o"))]
            for src in SOURCES
        ]
        objects = [command[-1] for command in commands]
        link_cuda: list[str] = []
        if nvcc:
            cuda_object = str(build_dir / "adasum_cuda.o")
            archs = shlex.split(os.environ.get("TF_ADASUM_CUDA_ARCHS", CUDA_ARCHS))
            # No TensorFlow header in this one: plain nvcc, exact roundings (see adasum_cuda.cu).
            nvcc_flags = ["-O3", "-std=c++17", "-Xcompiler", "-fPIC", *archs]
            commands.append([nvcc, *nvcc_flags, "-c", str(ROOT / CUDA_SOURCE), "-o", cuda_object])
            objects.append(cuda_object)
            # The CUDA runtime linked in statically: the library needs no libcudart of nvcc's version.
            cuda_lib = cuda_root(nvcc) / "lib64"
            link_cuda = [f"-L{cuda_lib}", "-l:libcudart_static.a", "-ldl", "-lrt", "-lpthread"]
        print(f"tf_adasum: {plan}", file=sys.stderr)
        with open(log_path, "w") as log:
            log.write(f"tf_adasum: {plan}\n")
            log.flush()
            # The translation units compile in parallel; the TensorFlow one dominates.
            compiles = [subprocess.Popen(c, stdout=log, stderr=subprocess.STDOUT) for c in commands]
            failed = [p.args for p in compiles if p.wait() != 0]
            if not failed:
                link = [*compiler, "-shared", *objects, "-o", str(output), *lflags, *link_cuda]
                log.write(" ".join(link) + "\n")
                log.flush()
                if subprocess.run(link, stdout=log, stderr=subprocess.STDOUT, check=False).returncode != 0:
                    failed = [link]
        if failed:
            sys.stderr.write(log_path.read_text()[-6000:])
            raise RuntimeError(f"building {LIBRARY} failed; the full compiler output is in {log_path}")


setup(
    ext_modules=[Extension("tf_adasum._adasum_ops", sources=SOURCES)],
    cmdclass={"build_ext": BuildAdasumOps},
)
