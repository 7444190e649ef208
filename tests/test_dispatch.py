"""The workers' one dispatch (tests/workers/dispatch.py): modes run in order; an unknown one raises."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.workers.dispatch import main


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
