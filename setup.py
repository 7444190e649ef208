"""Builds kernels/ into tf_adasum/_adasum_ops.so against the installed TensorFlow.

`pip install .` and `pip install -e .` both run this. The compiler and link flags come from
`tf.sysconfig`, so the library matches the TensorFlow it will be loaded into. Compiler output goes to
build/adasum_build.log; on failure its end is shown.

Environment:
    TF_ADASUM_ARCH_FLAGS: CPU code-generation flags (default "-march=native"). Set it, for example to
        "-mavx2 -mfma -mf16c", when the library is built on one machine and run on others.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
SOURCES = ["kernels/adasum_cpu.cc", "kernels/adasum_ops.cc"]
LIBRARY = "tf_adasum/_adasum_ops.so"

_QUERY = (
    "import json, tensorflow as tf; "
    "print(json.dumps([tf.__version__, tf.sysconfig.get_compile_flags(), tf.sysconfig.get_link_flags()]))"
)


def tensorflow_build_info() -> tuple[str, list[str], list[str]]:
    """Returns (version, compile flags, link flags) of the TensorFlow installed for this interpreter.

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
    version, cflags, lflags = json.loads(result.stdout.strip().splitlines()[-1])
    return version, cflags, lflags


class BuildAdasumOps(build_ext):
    """Compiles the ops with $CXX (default g++) and TensorFlow's own flags instead of distutils' defaults."""

    def get_ext_filename(self, fullname: str) -> str:
        # A plain `_adasum_ops.so`, without the interpreter tag: the library depends on TensorFlow's
        # ABI, not Python's. setuptools calls this with both the dotted and the bare name.
        return os.path.join(*fullname.split(".")[:-1], Path(LIBRARY).name)

    def build_extension(self, ext: Extension) -> None:
        version, cflags, lflags = tensorflow_build_info()
        output = Path(self.get_ext_fullpath(ext.name))
        output.parent.mkdir(parents=True, exist_ok=True)
        build_dir = ROOT / "build"
        build_dir.mkdir(exist_ok=True)
        log_path = build_dir / "adasum_build.log"
        arch = shlex.split(os.environ.get("TF_ADASUM_ARCH_FLAGS", "-march=native"))
        compiler = shlex.split(os.environ.get("CXX") or "g++")
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
        objects = [build_dir / (Path(src).stem + ".o") for src in SOURCES]
        with open(log_path, "w") as log:
            # The two translation units compile in parallel; the TensorFlow one dominates.
            compiles = [
                subprocess.Popen(
                    [*compiler, *common, "-c", str(ROOT / src), "-o", str(obj)],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
                for src, obj in zip(SOURCES, objects, strict=True)
            ]
            failed = [p.args for p in compiles if p.wait() != 0]
            if not failed:
                link = [*compiler, "-shared", *map(str, objects), "-o", str(output), *lflags]
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
