"""The workers' one dispatch (tests/workers/dispatch.py): modes run in order; an unknown one raises; every
worker goes through it, and a worker started with a misspelled mode fails naming its modes."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.workers.dispatch import main

ROOT = Path(__file__).resolve().parents[1]


def test_modes_run_in_the_order_named_and_an_unknown_one_runs_nothing(tmp_path: Path) -> None:
    ran: list[tuple[str, Path]] = []
    modes = {"a": lambda out: ran.append(("a", out)), "b": lambda out: ran.append(("b", out))}
    main(modes, [str(tmp_path), "b,a"])
    assert ran == [("b", tmp_path), ("a", tmp_path)]
    ran.clear()
    with pytest.raises(ValueError, match=r"unknown mode\(s\) \['c'\]: this worker runs \['a', 'b'\]"):
        main(modes, [str(tmp_path), "a,c"])
    assert ran == [], "nothing runs when one of the modes is unknown"
    with pytest.raises(SystemExit, match="usage"):
        main(modes, [str(tmp_path)])


WORKERS = Path(__file__).with_name("workers")
NOT_WORKERS = {"__init__.py", "dispatch.py", "data.py"}


def worker_files() -> list[Path]:
    return sorted(p for p in WORKERS.glob("*.py") if p.name not in NOT_WORKERS)


@pytest.mark.parametrize("path", worker_files(), ids=lambda p: p.stem)
def test_every_worker_dispatches_through_main_alone(path: Path) -> None:
    """Each worker's MODES go through dispatch.main and nothing else reads its arguments, so every worker
    refuses a mode it does not have."""
    tree = ast.parse(path.read_text())
    imported = [
        node
        for node in tree.body
        if isinstance(node, ast.ImportFrom)
        and node.module == "tests.workers.dispatch"
        and [a.name for a in node.names] == ["main"]
    ]
    assert imported, f"{path.name}: `from tests.workers.dispatch import main`"
    assert any(
        isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["MODES"]
        for node in tree.body
    ), f"{path.name}: a top-level MODES"
    (entry,) = [
        node
        for node in tree.body
        if isinstance(node, ast.If) and ast.unparse(node.test) == "__name__ == '__main__'"
    ]
    assert ast.unparse(entry.body[-1]) == "main(MODES)", f"{path.name}: its __main__ ends in main(MODES)"
    reads = [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and ast.unparse(node) == "sys.argv"
        and isinstance(node.ctx, ast.Load)
    ]
    assert reads == [], f"{path.name} reads sys.argv at lines {reads}: its arguments are dispatch.main's"


def test_a_misspelled_mode_raises_naming_the_modes_and_runs_nothing(tmp_path: Path) -> None:
    """By hand, as a launcher would start it: a mode one letter off is refused, and no mode ran."""
    done = subprocess.run(
        [sys.executable, "-m", "tests.workers.matrix", str(tmp_path), "allreduce,alreduce"],
        cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="3"),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "ValueError: unknown mode(s) ['alreduce']: this worker runs ['allreduce']" in done.stderr, (
        done.stderr
    )
    assert list(tmp_path.iterdir()) == [], "no mode ran"
