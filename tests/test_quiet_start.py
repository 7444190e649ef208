"""`python -m tf_adasum.demo` and the examples start without TensorFlow's C++ start-up log
(tf_adasum/common/quiet.py), and only they: a log level the user set, or any other program, still gets
TensorFlow's lines.

Each run is a real process that imports TensorFlow and stops at argparse (a bad --replicas), a few
seconds; the demo itself never trains here.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

# absl's prefix of an INFO or WARNING line, "I0000 00:00:1796036756.151368   16885 port.cc:153] ", and
# the notice absl prints before its first line.
TENSORFLOW_LINE = re.compile(r"^[IW]\d{4} [\d:.]+ +\d+ \S+:\d+\] |absl::InitializeLog|oneDNN", re.MULTILINE)


def python(args: list[str], env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    return subprocess.run(
        [sys.executable, *args], env=base | env, capture_output=True, text=True, timeout=timeout
    )


def test_the_demo_starts_without_tensorflows_log() -> None:
    done = python(["-m", "tf_adasum.demo", "--replicas", "x"], {})
    assert done.returncode == 2, done.stderr
    assert "argument --replicas: invalid int value: 'x'" in done.stderr  # stderr is back after the import
    assert not TENSORFLOW_LINE.search(done.stderr), done.stderr
    # Before argparse's message, only tf_adasum's own warnings (a line, then the source line) may come.
    start = done.stderr[: done.stderr.index("usage: ")]
    assert all("Warning: tf_adasum" in line or line.startswith(" ") for line in start.splitlines()), start


def test_tensorflows_log_stays_for_a_level_the_user_set_and_for_other_programs() -> None:
    # Also shows that this TensorFlow logs at start-up, so the test above can fail.
    user_level = python(["-m", "tf_adasum.demo", "--replicas", "x"], {"TF_CPP_MIN_LOG_LEVEL": "0"})
    assert TENSORFLOW_LINE.search(user_level.stderr), user_level.stderr
    library = python(["-c", "import tf_adasum"], {})
    assert library.returncode == 0, library.stderr
    assert TENSORFLOW_LINE.search(library.stderr), library.stderr


def test_only_absl_info_and_warning_lines_are_left_out(tmp_path: Path) -> None:
    # A stand-in TensorFlow that writes to the stderr file descriptor, as TensorFlow's libraries do,
    # and then fails to import: the other lines and the error must reach the user.
    fake = tmp_path / "tensorflow"
    fake.mkdir()
    (fake / "__init__.py").write_text(
        "import os\n"
        "os.write(2, b'WARNING: All log messages before absl::InitializeLog() is called are written to "
        "STDERR\\n')\n"
        "os.write(2, b'I0000 00:00:1796036756.151368   16885 port.cc:153] oneDNN custom operations\\n')\n"
        "os.write(2, b'W0000 00:00:1796036756.151368   16885 dataset.cc:997] a warning\\n')\n"
        "os.write(2, b'E0000 00:00:1796036756.151368   16885 util.cc:131] an error\\n')\n"
        "os.write(2, b'a line of the library\\n')\n"
        "raise ImportError('this TensorFlow is broken')\n"
    )
    done = python(["-m", "tf_adasum.demo"], {"PYTHONPATH": str(tmp_path)}, timeout=60)
    assert done.returncode == 1
    kept = done.stderr.splitlines()
    assert kept[:2] == [
        "E0000 00:00:1796036756.151368   16885 util.cc:131] an error",
        "a line of the library",
    ]
    assert "ImportError: this TensorFlow is broken" in done.stderr
    assert "absl::InitializeLog" not in done.stderr and "oneDNN" not in done.stderr
    assert "a warning" not in done.stderr


def test_the_examples_and_the_demo_start_quietly_and_nothing_else(monkeypatch: pytest.MonkeyPatch) -> None:
    from tf_adasum.common import quiet as _quiet

    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)
    monkeypatch.delitem(sys.modules, "tensorflow")  # as before the program's first import
    examples = Path(__file__).resolve().parents[1] / "examples"
    benchmark = Path(__file__).resolve().parents[1] / "benchmarks" / "micro" / "bench_ops.py"
    for argv, orig_argv, quiet in (
        ([str(examples / "single_machine.py")], ["python", "examples/single_machine.py"], True),
        ([str(benchmark)], ["python", "benchmarks/micro/bench_ops.py"], True),
        (["-m"], ["python", "-m", "tf_adasum.demo"], True),
        (["-m"], ["python", "-m", "pytest"], False),
        (["train.py"], ["python", "train.py"], False),
    ):
        monkeypatch.setattr(sys, "argv", argv)
        monkeypatch.setattr(sys, "orig_argv", orig_argv)
        assert _quiet.wanted() is quiet, argv
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "0")  # a level the user chose wins
    monkeypatch.setattr(sys, "argv", [str(examples / "single_machine.py")])
    assert not _quiet.wanted()
