"""The op library's build does not depend on the CPU it runs on (setup.py's build_library).

- The portable default compiles on hosts that look like each CPU kind: a compiler wrapper turns
  -march=native into the target, as g++ would read it on such a host; no host flag is passed at all.
- The old default, -march=native, fails on a Sapphire Rapids host in TensorFlow's Eigen, and the error
  names the file, the header, the flag and the fix; the fix builds.
- The TensorFlow-free core compiles for aarch64 with Debian's cross g++, and under qemu-user gives the
  bits the x86-64 paths give, with flush-to-zero set as TensorFlow sets it.
- No CPU path's object defines a weak symbol, and the check that guards it finds one.
"""

from __future__ import annotations

import importlib.util
import platform
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from tests.support.cases import COEFFICIENTS, coefficient_row, every_exponent
from tf_adasum import ops

ROOT = Path(__file__).resolve().parents[1]
TARGETS = ["sapphirerapids", "icelake-server", "skylake-avx512", "znver4", "haswell", "x86-64"]
X86_64 = pytest.mark.skipif(platform.machine() != "x86_64", reason="g++ here targets x86-64 CPU kinds")
CODES = {"float16": 0, "bfloat16": 1, "float32": 2, "float64": 3}


def _load_setup() -> ModuleType:
    spec = importlib.util.spec_from_file_location("tf_adasum_setup", ROOT / "setup.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)  # not __main__: defines the build functions, runs no setup()
    return module


setup = _load_setup()


@pytest.fixture(scope="module")
def tensorflow() -> object:
    return setup.tensorflow_build_info()


def _compiler_on(target: str, folder: Path) -> tuple[Path, Path]:
    """A g++ that behaves as on a host of CPU kind `target`; returns (the wrapper, its argument log)."""
    log = folder / "compiler_calls.log"
    wrapper = folder / f"g++-on-{target}"
    wrapper.write_text(
        f"#!{sys.executable}\n"
        "import os, sys\n"
        f"with open({str(log)!r}, 'a') as log:\n"
        "    log.write(' '.join(sys.argv[1:]) + '\\n')\n"
        f"args = ['-march={target}' if a == '-march=native' else '-mtune={target}' if a == '-mtune=native'"
        " else a for a in sys.argv[1:]]\n"
        "os.execvp('g++', ['g++', *args])\n"
    )
    wrapper.chmod(0o755)
    return wrapper, log


@X86_64
@pytest.mark.slow
@pytest.mark.parametrize("target", TARGETS)
def test_the_portable_build_compiles_on_every_cpu_kind(
    target: str, tmp_path: Path, tensorflow: object
) -> None:
    compiler, calls = _compiler_on(target, tmp_path)
    folder = tmp_path / "tf_adasum"
    info = setup.build_library(folder, tmp_path / "build", [tensorflow], [str(compiler)], [])
    assert (folder / setup.CORE).is_file() and (folder / setup.adapter_name(tensorflow.version)).is_file()
    assert list(info["cpu_paths"]) == ["portable", "avx2", "avx512", "avx512bf16"]
    assert info["arch_flags"] == []
    assert "native" not in calls.read_text(), "the portable build passes no host-specific flag"


@X86_64
@pytest.mark.slow
def test_the_old_native_default_fails_on_sapphirerapids_and_says_what_to_set(
    tmp_path: Path, tensorflow: object
) -> None:
    compiler, _ = _compiler_on("sapphirerapids", tmp_path)
    with pytest.raises(RuntimeError) as failure:
        setup.build_library(
            tmp_path / "lib", tmp_path / "build", [tensorflow], [str(compiler)], ["-march=native"]
        )
    message = str(failure.value)
    for part in (
        "compiling kernels/adasum_ops.cc",
        "PacketMathFP16.h",
        "TF_ADASUM_ARCH_FLAGS='-march=native'",
        "AVX512-FP16",
        "-mno-avx512fp16",
        "Unset TF_ADASUM_ARCH_FLAGS",
        "adasum_build.log",
    ):
        assert part in message, f"{part!r} not in: {message}"

    # The fix the message names builds, as one path with the host's flags everywhere.
    info = setup.build_library(
        tmp_path / "lib",
        tmp_path / "build",
        [tensorflow],
        [str(compiler)],
        ["-march=native", "-mno-avx512fp16"],
    )
    assert info["cpu_paths"] == {"custom": []}
    assert info["arch_flags"] == ["-march=native", "-mno-avx512fp16"]


def test_the_core_builds_without_tensorflow_and_each_adapter_with_its_own_release(
    tmp_path: Path, tensorflow: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    core = setup.plan_core(tmp_path, tmp_path / "build", ["g++"], [])
    for step in core.steps:
        assert not set(tensorflow.compile_flags) & set(step.command), f"{step.source} sees TensorFlow"
    older = setup.TensorFlowBuild(
        "2.16.2", ["-I/tf216/include", "-D_GLIBCXX_USE_CXX11_ABI=1"], ["-L/tf216"], False
    )
    for tf_build in (tensorflow, older):
        adapter = setup.plan_adapter(tmp_path, tmp_path / "build", tf_build, ["g++"], [])
        for step in adapter.steps:
            assert set(tf_build.compile_flags) <= set(step.command)
            assert f'-DTF_ADASUM_BUILT_FOR_TF="{tf_build.version}"' in step.command
        assert str(tmp_path / setup.adapter_name(tf_build.version)) in adapter.link
        assert {f"-l:{setup.CORE}", "-Wl,-rpath,$ORIGIN", *tf_build.link_flags} <= set(adapter.link)
    assert setup.adapter_name("2.16.2") == "_adasum_ops_tf2_16.so"
    # Two interpreters of one minor release would write one file twice.
    monkeypatch.setenv("TF_ADASUM_TENSORFLOWS", f"{sys.executable} {sys.executable}")
    with pytest.raises(RuntimeError, match="two interpreters of one TensorFlow minor release"):
        setup.tensorflow_builds()


def test_a_portable_failure_names_the_file_and_where(tmp_path: Path) -> None:
    step = setup.Step("kernels/adasum_cpu.cc", ["g++"], str(tmp_path / "x.o"))
    output = "/src/kernels/adasum_cpu.cc:12:3: error: 'foo' was not declared in this scope\n"
    message = setup.explain_failure(step, output, ["g++"], [])
    assert (
        "compiling kernels/adasum_cpu.cc with g++ failed at /src/kernels/adasum_cpu.cc:12: 'foo' was"
        in message
    )
    assert "portable default build" in message


def _core_objects(compiler: list[str], folder: Path, machine: str, extra: list[str]) -> list[str]:
    """Compiles the TensorFlow-free core (kernels/adasum_cpu.cc, adasum_c_api.cc, every path for the
    machine) with the build's own flags; returns the objects."""
    objects = []
    sources = [(source, []) for source in setup.CORE_SOURCES]
    sources += [
        (setup.PATH_SOURCE, [*flags, f"-DADASUM_CPU_PATH={name}"])
        for name, flags in setup.cpu_paths(machine, []).items()
    ]
    for i, (source, flags) in enumerate(sources):
        obj = folder / f"{i}.o"
        command = [
            *compiler,
            *setup.CODEGEN,
            "-std=c++17",
            *extra,
            *flags,
            "-c",
            str(setup.KERNELS / source),
            "-o",
            str(obj),
        ]
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        assert result.returncode == 0, f"{' '.join(command)}\n{result.stdout}{result.stderr}"
        objects.append(str(obj))
    return objects


def _driver_input(dtype: str, a: np.ndarray, b: np.ndarray, bounds: list[int]) -> bytes:
    crafted = np.array([[coefficient_row(ca, cb)] * (len(bounds) - 1) for ca, cb in COEFFICIENTS], np.float64)
    header = struct.pack("<iiqi", CODES[dtype], len(bounds) - 1, len(a), len(COEFFICIENTS))
    return header + np.asarray(bounds, np.int64).tobytes() + a.tobytes() + b.tobytes() + crafted.tobytes()


def _library_results(dtype: str, a: np.ndarray, b: np.ndarray, bounds: list[int]) -> bytes:
    """What the driver prints, from the loaded library's own entry points on the current path."""
    rows = ops.host_segment_dot_norms(a, b, bounds, threads=2)
    out = np.empty_like(a)
    results = [rows.tobytes()]
    if np.all(np.isfinite(rows)):
        ops.host_segment_combine(a, b, rows, out, bounds, threads=2)
        results.append(out.tobytes())
    for ca, cb in COEFFICIENTS:
        ops.host_segment_combine(
            a, b, np.array([coefficient_row(ca, cb)] * (len(bounds) - 1)), out, bounds, threads=2
        )
        results.append(out.tobytes())
    return b"".join(results)


def _check_driver(run: list[str], label: str) -> None:
    """The driver's output, per dtype, equals the loaded library's on every path this CPU runs."""
    rng = np.random.default_rng(31)
    for dtype in CODES:
        a, b = every_exponent(rng, dtype, 5003), every_exponent(rng, dtype, 5003)
        bounds = [0, 1, 18, 1000, 5003]
        result = subprocess.run(
            run, input=_driver_input(dtype, a, b, bounds), capture_output=True, timeout=120, check=False
        )
        assert result.returncode == 0, f"{label}: {result.stderr.decode()}"
        for path, runs in ops.build_info()["cpu_paths_runnable"].items():
            if runs:
                ops.set_cpu_path(path)
                assert result.stdout == _library_results(dtype, a, b, bounds), (
                    f"{label} {dtype} against {path}"
                )
    ops.set_cpu_path(None)


@X86_64
def test_the_core_keeps_gradual_underflow_under_flush_to_zero(tmp_path: Path) -> None:
    # The driver sets FTZ and DAZ as TensorFlow does around its kernels; the results must not change.
    objects = _core_objects(["g++"], tmp_path, "x86_64", [])
    driver = tmp_path / "core_driver"
    command = [
        "g++",
        "-std=c++17",
        "-O2",
        str(ROOT / "tests" / "core_driver.cc"),
        *objects,
        "-o",
        str(driver),
        "-lpthread",
    ]
    subprocess.run(command, check=True, capture_output=True)
    _check_driver([str(driver)], "x86-64 with FTZ and DAZ")


CROSS = shutil.which("aarch64-linux-gnu-g++")


@pytest.mark.skipif(
    CROSS is None, reason="no aarch64-linux-gnu-g++: `make cross-tools` installs it (as root)"
)
def test_the_core_compiles_for_aarch64_and_gives_the_same_bits(tmp_path: Path) -> None:
    objects = _core_objects([str(CROSS)], tmp_path, "aarch64", [])
    assert setup.target_machine([str(CROSS)]) == "aarch64"
    assert list(setup.cpu_paths("aarch64", [])) == ["portable"]
    driver = tmp_path / "core_driver"
    command = [str(CROSS), "-std=c++17", "-O2", "-static", str(ROOT / "tests" / "core_driver.cc"), *objects]
    result = subprocess.run(
        [*command, "-o", str(driver), "-lpthread"], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    qemu = shutil.which("qemu-aarch64")
    if qemu is None:
        pytest.skip("compiled for aarch64; no qemu-aarch64 to run it (`make cross-tools` installs it)")
    _check_driver([qemu, str(driver)], "aarch64 under qemu-user, FZ set")


@X86_64
def test_no_cpu_path_defines_a_weak_symbol(tmp_path: Path) -> None:
    objects = _core_objects(["g++"], tmp_path, "x86_64", [])[len(setup.CORE_SOURCES) :]
    for obj in objects:
        assert setup.weak_symbols(obj, ["g++"]) == [], obj
    # The check finds one: an inline function with external linkage is a weak symbol.
    source = tmp_path / "weak.cc"
    source.write_text("inline int twice(int x) { return 2 * x; }\nint (*use)(int) = twice;\n")
    subprocess.run(["g++", "-O2", "-c", str(source), "-o", str(tmp_path / "weak.o")], check=True)
    weak = setup.weak_symbols(str(tmp_path / "weak.o"), ["g++"])
    assert weak and "twice" in weak[0]
