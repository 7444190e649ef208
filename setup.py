"""Builds kernels/ into tf_adasum/: the TensorFlow-free core once, and a TensorFlow adapter per release.

`pip install .`, `pip install -e .` and `pip wheel .` all run this. Two kinds of library come out:
- `_adasum_core.so`, built once and with no TensorFlow header: the hot loops, their threads, the choice
  of CPU path, the C entry points the MPI engine calls through ctypes, and (TF_ADASUM_CUDA=1) the CUDA
  kernels;
- `_adasum_ops_tf<major>_<minor>.so`, one per TensorFlow release: the ops' registration and kernels
  (kernels/adasum_ops.cc and adasum_kernels.cc), compiled with that TensorFlow's headers and its own
  flags from `tf.sysconfig`, linked against the core beside it ($ORIGIN). tf_adasum loads the one for
  the TensorFlow that is running (tf_adasum/common/loader.py).
By default the adapter is built for this interpreter's TensorFlow; TF_ADASUM_TENSORFLOWS lists other
interpreters, each with its own TensorFlow, to build one for each (`make wheel` builds every release).

The libraries do not depend on the CPU they are built on:
- the adapter compiles with TensorFlow's own flags and no instruction-set flag, so no host-specific
  option reaches TensorFlow's bundled Eigen;
- the hot loops (kernels/adasum_cpu_path.cc) compile once per CPU path, each with its own -m flags,
  and kernels/adasum_cpu.cc picks the widest one the CPU runs when the library loads. On x86-64:
  portable (the x86-64 baseline), avx2 (AVX2, FMA, F16C), avx512 (F, BW, VL, DQ), avx512bf16; on
  other architectures, portable. Every path gives the same bits.

Compiler output goes to build/adasum_build.log; on failure the error names the file, the header and
the flag that failed, and what to set.

Environment:
    TF_ADASUM_TENSORFLOWS: Python interpreters, separated by spaces, whose TensorFlow releases get an
        adapter each (default: this interpreter). Each must import tensorflow.
    TF_ADASUM_ARCH_FLAGS: opt-in host flags, for example "-march=native", added to every file in place
        of the dispatch: the library then holds one CPU path, "custom", built with these flags, and
        runs only on CPUs that have what they enable.
    CXX: the C++ compiler (default g++).
    TF_ADASUM_CUDA=1: also compile the CUDA kernels (kernels/adasum_cuda.cu, with nvcc) and register
        the ops' GPU kernels. Needs TensorFlow's GPU wheel (`tensorflow==2.21.0`), whose headers carry
        CUDA's, and nvcc: $NVCC, else $CUDA_HOME/bin/nvcc, else nvcc on PATH, else
        /usr/local/cuda/bin/nvcc. Without either the build stays CPU-only and says why, in the build
        log and at import (tf_adasum.ops.built_with_cuda() tells which it is).
    TF_ADASUM_CUDA_ARCHS: nvcc's -gencode flags (default: Turing, Ampere, Hopper, and PTX for newer).

The build steps are plain functions (`build_library`), so tests can build with another compiler, for
another CPU, into a folder of their own; setup() runs only when setuptools runs this file.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent
KERNELS = ROOT / "kernels"
CORE = "_adasum_core.so"
# TensorFlow-free, built for the architecture's baseline: blocks, threads, the choice of path, and the
# C entry points the MPI engine calls through ctypes.
CORE_SOURCES = ["adasum_cpu.cc", "adasum_c_api.cc"]
PATH_SOURCE = "adasum_cpu_path.cc"
# The TensorFlow adapter: the ops (registration and shape functions), and their kernels.
ADAPTER_SOURCES = ["adasum_ops.cc", "adasum_kernels.cc"]
CUDA_SOURCE = "adasum_cuda.cu"
CUDA_ARCHS = (
    "-gencode arch=compute_75,code=sm_75 -gencode arch=compute_80,code=sm_80 "
    "-gencode arch=compute_90,code=[sm_90,compute_90]"
)

_AVX2 = ["-mavx", "-mavx2", "-mfma", "-mf16c"]
# g++ 12's own AVX-512 intrinsic headers trip -Wmaybe-uninitialized (GCC bug 105593).
_AVX512 = [*_AVX2, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-Wno-maybe-uninitialized"]
# The CPU paths per architecture, narrowest first; kernels/adasum_cpu.cc lists the same ones.
X86_64_PATHS = {
    "portable": [],
    "avx2": _AVX2,
    "avx512": _AVX512,
    "avx512bf16": [*_AVX512, "-mavx512bf16"],
}
# TensorFlow's own headers trip these two warnings by the hundred.
QUIET = ["-Wno-deprecated-declarations", "-Wno-interference-size"]
# Warning options g++ has and clang does not (clang warns that it does not know them).
GCC_ONLY = {"-Wno-interference-size", "-Wno-maybe-uninitialized"}
# No FMA contraction: fma(ca, a, cb * b) would differ from fma(cb, b, ca * a), and Adasum must be
# bitwise symmetric; and every CPU path must round alike.
CODEGEN = ["-O3", "-fPIC", "-ffp-contract=off", "-Wall", *QUIET]

_QUERY = (
    "import json, tensorflow as tf; "
    "print(json.dumps([tf.__version__, tf.sysconfig.get_compile_flags(), tf.sysconfig.get_link_flags(), "
    "tf.test.is_built_with_cuda()]))"
)


def adapter_name(version: str) -> str:
    """The adapter's file for TensorFlow `version`, one per minor release: 2.16.2 -> _adasum_ops_tf2_16.so."""
    major, minor = version.split(".")[:2]
    return f"_adasum_ops_tf{major}_{minor}.so"


@dataclass
class TensorFlowBuild:
    """What the library is compiled against: this interpreter's TensorFlow."""

    version: str
    compile_flags: list[str]
    link_flags: list[str]
    with_cuda: bool

    @property
    def include_dirs(self) -> list[str]:
        return [f[2:] for f in self.compile_flags if f.startswith("-I")]


def tensorflow_build_info(python: str = sys.executable) -> TensorFlowBuild:
    """Version, compile and link flags, and CUDA support of the TensorFlow that `python` imports.

    pip builds in an isolated environment that hides the installed TensorFlow, so the query runs in a
    fresh interpreter without pip's PYTHONPATH, which sees the real site-packages.
    """
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONNOUSERSITE")}
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    result = subprocess.run(
        [python, "-c", _QUERY], env=env, capture_output=True, text=True, cwd="/", check=False
    )
    if result.returncode != 0:
        raise RuntimeError(
            "tf_adasum builds its ops against the installed TensorFlow, but "
            f"`{python} -c 'import tensorflow'` failed:\n{result.stderr[-2000:]}\n"
            "Install TensorFlow first, for example `pip install tensorflow-cpu==2.21.0`."
        )
    version, cflags, lflags, has_cuda = json.loads(result.stdout.strip().splitlines()[-1])
    return TensorFlowBuild(version, cflags, lflags, has_cuda)


def tensorflow_builds() -> list[TensorFlowBuild]:
    """The TensorFlow releases to build an adapter for: those of $TF_ADASUM_TENSORFLOWS's interpreters, or
    of this one. Two interpreters of the same minor release would build the same file: refused."""
    builds = [tensorflow_build_info(p) for p in shlex.split(os.environ.get("TF_ADASUM_TENSORFLOWS", ""))]
    builds = builds or [tensorflow_build_info()]
    names = [adapter_name(b.version) for b in builds]
    if len(set(names)) != len(names):
        raise RuntimeError(
            f"TF_ADASUM_TENSORFLOWS holds two interpreters of one TensorFlow minor release "
            f"({', '.join(b.version for b in builds)}): one adapter serves each minor release"
        )
    return builds


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
        [nvcc, "--dryrun", "-c", str(KERNELS / CUDA_SOURCE), "-o", os.devnull],
        capture_output=True,
        text=True,
        check=False,
    )
    for line in (probe.stdout + probe.stderr).splitlines():
        if line.startswith("#$ TOP="):
            return Path(line.split("=", 1)[1]).resolve()
    return Path(nvcc).resolve().parent.parent


def cuda_plan(tensorflows: list[TensorFlowBuild]) -> tuple[str | None, str]:
    """(nvcc to build the GPU kernels with, or None; why, for the log). Every adapter needs a TensorFlow
    built with CUDA, whose headers carry CUDA's."""
    if os.environ.get("TF_ADASUM_CUDA", "0") != "1":
        return None, "CPU-only build (set TF_ADASUM_CUDA=1 to build the GPU kernels)"
    without = [tf.version for tf in tensorflows if not tf.with_cuda]
    if without:
        return None, (
            f"TF_ADASUM_CUDA=1, but TensorFlow {', '.join(without)} has no CUDA support (tensorflow-cpu?): "
            "building CPU-only; install the GPU wheel, for example `pip install tensorflow==2.21.0`"
        )
    for tf in tensorflows:
        if not any(
            (Path(d) / "third_party/gpus/cuda/include/cuda_runtime_api.h").exists() for d in tf.include_dirs
        ):
            return (
                None,
                f"TF_ADASUM_CUDA=1, but TensorFlow {tf.version}'s headers carry no CUDA headers: "
                "building CPU-only",
            )
    nvcc = find_nvcc()
    if nvcc is None:
        return None, "TF_ADASUM_CUDA=1, but no nvcc was found ($NVCC, $CUDA_HOME, PATH): building CPU-only"
    return nvcc, f"building the GPU kernels with {nvcc}"


def target_machine(compiler: list[str]) -> str:
    """The architecture the compiler builds for, from its target triple (x86_64, aarch64, ...)."""
    result = subprocess.run([*compiler, "-dumpmachine"], capture_output=True, text=True, check=False)
    if result.returncode != 0 or not result.stdout.strip():
        raise RuntimeError(f"`{shlex.join(compiler)} -dumpmachine` failed: is {compiler[0]} a C++ compiler?")
    return result.stdout.strip().split("-")[0]


def cpu_paths(machine: str, arch_flags: list[str]) -> dict[str, list[str]]:
    """The CPU paths to build for `machine`, each with its own flags."""
    if arch_flags:
        return {"custom": []}  # the host flags go to every file; one path
    return dict(X86_64_PATHS) if machine == "x86_64" else {"portable": []}


@dataclass
class Step:
    """One compiler run: what it builds, and its command."""

    source: str  # for messages: "kernels/adasum_cpu_path.cc (path avx2)"
    command: list[str]
    output: str
    path_object: bool = False  # an object of one CPU path: must define no weak symbol


@dataclass
class Plan:
    steps: list[Step]
    link: list[str]
    info: dict[str, object] = field(default_factory=dict)


def compiler_version(compiler: list[str]) -> str:
    result = subprocess.run([*compiler, "--version"], capture_output=True, text=True, check=False)
    return (result.stdout.splitlines() or ["unknown"])[0]


def plan_core(
    folder: Path, build_dir: Path, compiler: list[str], arch_flags: list[str], nvcc: str | None = None
) -> Plan:
    """The compiler runs and the link that build the TensorFlow-free core, `folder`/_adasum_core.so."""
    machine = target_machine(compiler)
    version = compiler_version(compiler)
    paths = cpu_paths(machine, arch_flags)
    if "clang" in version:
        paths = {name: [f for f in flags if f not in GCC_ONLY] for name, flags in paths.items()}
    codegen = [f for f in CODEGEN if "clang" not in version or f not in GCC_ONLY]
    common = [*compiler, *codegen, "-std=c++17", *arch_flags]
    common += ["-DADASUM_CPU_PATH_CUSTOM"] if arch_flags else []
    steps = []
    for name, flags in paths.items():
        obj = str(build_dir / f"adasum_cpu_path_{name}.o")
        command = [*common, *flags, f"-DADASUM_CPU_PATH={name}", "-c", str(KERNELS / PATH_SOURCE), "-o", obj]
        steps.append(Step(f"kernels/{PATH_SOURCE} (path {name})", command, obj, True))
    for source in CORE_SOURCES:
        obj = str(build_dir / (Path(source).stem + ".o"))
        command = [*common, f"-I{build_dir}", "-c", str(KERNELS / source), "-o", obj]
        steps.append(Step(f"kernels/{source}", command, obj))
    link_cuda: list[str] = []
    if nvcc:
        obj = str(build_dir / "adasum_cuda.o")
        archs = shlex.split(os.environ.get("TF_ADASUM_CUDA_ARCHS", CUDA_ARCHS))
        # No TensorFlow header in this one: plain nvcc, exact roundings (see adasum_cuda.cu).
        command = [nvcc, "-O3", "-std=c++17", "-Xcompiler", "-fPIC", *archs]
        steps.append(
            Step(f"kernels/{CUDA_SOURCE}", [*command, "-c", str(KERNELS / CUDA_SOURCE), "-o", obj], obj)
        )
        # The CUDA runtime linked in statically: the library needs no libcudart of nvcc's version.
        link_cuda = [f"-L{cuda_root(nvcc) / 'lib64'}", "-l:libcudart_static.a", "-ldl", "-lrt"]
    output = str(folder / CORE)
    link = [*compiler, "-shared", f"-Wl,-soname,{CORE}", *[s.output for s in steps], "-o", output]
    link += [*link_cuda, "-lpthread"]
    info = {
        "compiler": version,
        "machine": machine,
        "arch_flags": arch_flags,
        "cpu_paths": paths,
        "flags": [*codegen, *arch_flags],
        "cuda": bool(nvcc),
    }
    return Plan(steps, link, info)


def plan_adapter(
    folder: Path,
    build_dir: Path,
    tf: TensorFlowBuild,
    compiler: list[str],
    arch_flags: list[str],
    with_cuda: bool = False,
) -> Plan:
    """The compiler runs and the link that build the adapter for `tf`, linked against the core in `folder`
    and finding it there at run time ($ORIGIN)."""
    version = compiler_version(compiler)
    codegen = [f for f in CODEGEN if "clang" not in version or f not in GCC_ONLY]
    command = [
        *compiler,
        *codegen,
        *arch_flags,
        *tf.compile_flags,
        f'-DTF_ADASUM_BUILT_FOR_TF="{tf.version}"',
    ]
    if with_cuda:
        # Eigen includes cuda_runtime.h itself; TensorFlow's GPU wheel carries CUDA's headers here.
        command += ["-DGOOGLE_CUDA=1", *[f"-I{d}/third_party/gpus/cuda/include" for d in tf.include_dirs]]
    objects = build_dir / Path(adapter_name(tf.version)).stem
    objects.mkdir(parents=True, exist_ok=True)
    steps = []
    for source in ADAPTER_SOURCES:
        obj = str(objects / (Path(source).stem + ".o"))
        steps.append(
            Step(
                f"kernels/{source} (TensorFlow {tf.version})",
                [*command, "-c", str(KERNELS / source), "-o", obj],
                obj,
            )
        )
    output = str(folder / adapter_name(tf.version))
    link = [*compiler, "-shared", *[s.output for s in steps], "-o", output, f"-L{folder}", f"-l:{CORE}"]
    link += ["-Wl,-rpath,$ORIGIN", *tf.link_flags]
    return Plan(steps, link, {"tensorflow": tf.version, "tensorflow_flags": tf.compile_flags})


def weak_symbols(obj: str, compiler: list[str]) -> list[str] | None:
    """The weak (W, V) and unique (u) symbols an object defines, by the compiler's nm; None where no nm
    can read it."""
    nm_name = subprocess.run([*compiler, "-print-prog-name=nm"], capture_output=True, text=True, check=False)
    nm = shutil.which(nm_name.stdout.strip() or "nm") or shutil.which("nm")
    if nm is None:
        return None
    listing = subprocess.run([nm, "-C", "--defined-only", obj], capture_output=True, text=True, check=False)
    if listing.returncode != 0:
        return None
    return [line for line in listing.stdout.splitlines() if line[17:19] in ("W ", "V ", "u ")]


_ERROR = re.compile(r"^(?P<file>[^\s:][^:]*):(?P<line>\d+):(?:\d+:)? (?:fatal )?error: (?P<what>.*)$", re.M)


def explain_failure(step: Step, output: str, compiler: list[str], arch_flags: list[str]) -> str:
    """What failed, where, with which flags, and what to set: for the error a failed build raises."""
    found = _ERROR.search(output)
    where = f"{found['file']}:{found['line']}: {found['what']}" if found else output.strip()[-600:]
    message = f"compiling {step.source} with {compiler[0]} failed at {where}"
    if not arch_flags:
        return (
            f"{message}. This is the portable default build (no host flags); the full command is in "
            "build/adasum_build.log: please report it with that log."
        )
    message += f". The flags beyond TensorFlow's own were TF_ADASUM_ARCH_FLAGS={shlex.join(arch_flags)!r}"
    header = found["file"] if found else ""
    if "Eigen" in header and "FP16" in header:
        macros = subprocess.run(
            [*compiler, *arch_flags, "-dM", "-E", "-x", "c++", os.devnull],
            capture_output=True,
            text=True,
            check=False,
        ).stdout
        if "__AVX512FP16__" in macros:
            message += (
                f", which turn on AVX512-FP16 on this CPU; TensorFlow's bundled Eigen ({Path(header).name}) "
                "does not compile under g++ with it. Add -mno-avx512fp16 to TF_ADASUM_ARCH_FLAGS"
            )
    return (
        f"{message}. Unset TF_ADASUM_ARCH_FLAGS for the portable build, which passes no host flag to "
        "TensorFlow's headers and picks the CPU's instruction set at run time."
    )


def build_header(build_dir: Path, info: dict[str, object]) -> None:
    """build/adasum_build_info.h: the build's description, which tf_adasum.ops.build_info() returns."""
    text = json.dumps(info)
    (build_dir / "adasum_build_info.h").write_text(
        f'#define TF_ADASUM_BUILD_INFO R"tf_adasum_json({text})tf_adasum_json"\n'
    )


def run_steps(steps: list[Step], log, jobs: int) -> tuple[Step, int] | None:
    """Runs the compiler steps, `jobs` at a time; returns the first failure (step, its log offset)."""
    pending = list(steps)
    running: list[tuple[Step, subprocess.Popen, Path]] = []
    failed = None
    while pending or running:
        while pending and len(running) < jobs and failed is None:
            step = pending.pop(0)
            out = Path(step.output + ".log")
            with open(out, "w") as handle:
                running.append(
                    (step, subprocess.Popen(step.command, stdout=handle, stderr=subprocess.STDOUT), out)
                )
        step, process, out = running.pop(0)
        code = process.wait()
        log.write(shlex.join(step.command) + "\n" + out.read_text())
        log.flush()
        if code != 0 and failed is None:
            failed = (step, code)
        if failed is not None and not running:
            pending.clear()
    return failed


def build_library(
    folder: Path,
    build_dir: Path,
    tensorflows: list[TensorFlowBuild],
    compiler: list[str],
    arch_flags: list[str],
    nvcc: str | None = None,
    plan_note: str = "",
) -> dict[str, object]:
    """Compiles and links the core and an adapter for each of `tensorflows` into `folder`; returns the
    build's description: the core's, with "tensorflow", the releases served.

    Raises:
        RuntimeError: a compile or link failed; the message says which file, where and what to set.
    """
    folder.mkdir(parents=True, exist_ok=True)
    build_dir.mkdir(parents=True, exist_ok=True)
    log_path = build_dir / "adasum_build.log"
    core = plan_core(folder, build_dir, compiler, arch_flags, nvcc)
    adapters = [plan_adapter(folder, build_dir, tf, compiler, arch_flags, bool(nvcc)) for tf in tensorflows]
    build_header(build_dir, core.info)
    with open(log_path, "w") as log:
        if plan_note:
            log.write(f"tf_adasum: {plan_note}\n")
        log.write(f"tf_adasum: CPU paths {', '.join(core.info['cpu_paths'])} for {core.info['machine']}\n")
        log.write(f"tf_adasum: adapters for TensorFlow {', '.join(tf.version for tf in tensorflows)}\n")
        steps = [step for plan in (core, *adapters) for step in plan.steps]
        failure = run_steps(steps, log, jobs=max(1, os.cpu_count() or 1))
        if failure is not None:
            step, _ = failure
            text = Path(step.output + ".log").read_text()
            raise RuntimeError(
                f"building {step.source} failed: {explain_failure(step, text, compiler, arch_flags)} "
                f"(full compiler output: {log_path})"
            )
        for step in (s for s in core.steps if s.path_object):
            weak = weak_symbols(step.output, compiler)
            if weak is None:
                log.write(f"tf_adasum: no nm reads {step.output}: its symbols are not checked\n")
            elif weak:
                raise RuntimeError(
                    f"{step.source} defines weak symbols, which the linker could merge with another path's "
                    f"copy so that one path runs another's instructions: {weak[:5]}; give them internal "
                    "linkage (kernels/adasum_cpu_path.h)"
                )
        for plan in (core, *adapters):  # the core first: the adapters link against it
            log.write(shlex.join(plan.link) + "\n")
            log.flush()
            linked = subprocess.run(plan.link, stdout=log, stderr=subprocess.STDOUT, check=False)
            if linked.returncode != 0:
                name = Path(plan.link[plan.link.index("-o") + 1]).name
                raise RuntimeError(f"linking {name} failed; the full output is in {log_path}")
    return {**core.info, "tensorflow": [tf.version for tf in tensorflows]}


if __name__ == "__main__":  # setuptools runs this file as __main__; tests import it for build_library
    import setuptools
    from setuptools import Extension, setup

    if int(setuptools.__version__.split(".")[0]) < 77:
        # A stock venv's setuptools (65.5 in Python 3.11's) rejects pyproject.toml's SPDX license, and
        # `pip install --no-build-isolation` builds with the venv's own.
        sys.exit(
            f"tf_adasum builds with setuptools 77 or later, and this environment has setuptools "
            f"{setuptools.__version__}: run `pip install --upgrade 'setuptools>=77' wheel` first"
        )
    from setuptools.command.build_ext import build_ext

    try:
        from setuptools.command.bdist_wheel import bdist_wheel
    except ImportError:  # setuptools < 70.1
        from wheel.bdist_wheel import bdist_wheel

    class BuildAdasumOps(build_ext):
        """Compiles the ops with $CXX (default g++) and TensorFlow's own flags, not distutils' defaults."""

        def get_ext_filename(self, fullname: str) -> str:
            # A plain `_adasum_core.so`, without the interpreter tag: the libraries depend on TensorFlow's
            # ABI, not Python's. setuptools calls this with both the dotted and the bare name.
            return os.path.join(*fullname.split(".")[:-1], CORE)

        def get_outputs(self) -> list[str]:
            return [*super().get_outputs(), *map(str, getattr(self, "adapters", []))]

        def copy_extensions_to_source(self) -> None:
            # `pip install -e .`: the adapters too, and none of a release this build left out.
            super().copy_extensions_to_source()
            package = ROOT / "tf_adasum"
            for stale in package.glob("_adasum_ops_tf*.so"):
                stale.unlink()
            for adapter in self.adapters:
                self.copy_file(str(adapter), str(package / adapter.name), level=self.verbose)

        def build_extension(self, ext: Extension) -> None:
            tensorflows = tensorflow_builds()
            nvcc, note = cuda_plan(tensorflows)
            print(f"tf_adasum: {note}", file=sys.stderr)
            try:
                # The adapters go beside the core, which is the extension setuptools knows of.
                folder = Path(self.get_ext_fullpath(ext.name)).parent
                for stale in folder.glob("_adasum_ops_tf*.so"):  # an earlier build's, in build/lib
                    stale.unlink()
                self.adapters = [folder / adapter_name(tf.version) for tf in tensorflows]
                build_library(
                    folder,
                    ROOT / "build",
                    tensorflows,
                    shlex.split(os.environ.get("CXX") or "g++"),
                    shlex.split(os.environ.get("TF_ADASUM_ARCH_FLAGS", "")),
                    nvcc,
                    note,
                )
            except RuntimeError as error:
                sys.stderr.write((ROOT / "build" / "adasum_build.log").read_text()[-6000:] + "\n")
                raise RuntimeError(str(error)) from None

    class PlatformWheel(bdist_wheel):
        """py3-none-<platform>: the libraries are loaded by TensorFlow, not by Python, so they serve every
        Python that the TensorFlow releases serve, on this platform only."""

        def get_tag(self) -> tuple[str, str, str]:
            return ("py3", "none", super().get_tag()[2])

    setup(
        ext_modules=[
            Extension(
                "tf_adasum._adasum_core",
                sources=[f"kernels/{s}" for s in [*CORE_SOURCES, PATH_SOURCE, *ADAPTER_SOURCES]],
            )
        ],
        cmdclass={"build_ext": BuildAdasumOps, "bdist_wheel": PlatformWheel},
    )
