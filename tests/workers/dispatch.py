"""The one entry of every test worker: `python -m tests.workers.<name> OUT MODE[,MODE...]` runs each named
mode in order, in one launch (a launch costs seconds; chained modes share it). A mode runs exactly its
scenario; an unknown mode raises, naming the modes there are, so a mistyped mode can never run another
scenario and let a test pass."""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path


def modes_of(text: str, modes: Mapping[str, Callable[[Path], None]]) -> list[str]:
    """The modes a comma-separated list names, in order; ValueError for any this worker does not have."""
    names = [name for name in text.split(",") if name]
    unknown = [name for name in names if name not in modes]
    if unknown or not names:
        raise ValueError(f"unknown mode(s) {unknown or [text]}: this worker runs {sorted(modes)}")
    return names


def main(modes: Mapping[str, Callable[[Path], None]], argv: Sequence[str] | None = None) -> None:
    """Runs the modes named in argv ([OUT, MODE[,MODE...]]; default sys.argv[1:]) with OUT as a Path."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2:
        raise SystemExit(f"usage: python -m tests.workers.<name> OUT MODE[,MODE...]; modes: {sorted(modes)}")
    out = Path(args[0])
    for name in modes_of(args[1], modes):
        modes[name](out)
