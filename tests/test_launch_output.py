"""What the launchers show of their processes' output (tf_adasum/launch_output.py): in a log, whole lines
prefixed with the rank, a progress bar once as it ends; on a terminal, rank 0's progress bar alone; with
--output-filename, one folder per rank."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

from tf_adasum.launch_output import Output, RankStream, as_it_stands

# A Keras progress bar as it reaches a pipe: rewritten in place with "\b" and "\r", then a newline.
BAR = b"1/2 \xe2\x94\x81\x1b[0m - loss: 1.0\b\b\b\b\b\b\b\b\b\b\r2/2 done - loss: 0.5\n"


def test_a_line_rewritten_in_place_is_taken_as_it_stands() -> None:
    assert as_it_stands(b"abc\rxy") == (b"xy", True)
    assert as_it_stands(b"abcd\b\bX") == (b"abX", True)
    assert as_it_stands(b"plain") == (b"plain", False)


def test_in_a_log_every_rank_writes_whole_prefixed_lines_and_bars_as_they_end() -> None:
    stream = RankStream(1, terminal=False)
    assert stream.feed(b"Epoch 1/2\nhalf") == b"[1] Epoch 1/2\n"
    assert stream.feed(b" a line\n" + BAR) == b"[1] half a line\n[1] 2/2 done - loss: 0.5\n"
    assert stream.feed(b"last words") == b""
    assert stream.close() == b"[1] last words\n"


def test_on_a_terminal_rank_0_passes_through_and_the_others_lose_their_bars_only() -> None:
    assert RankStream(0, terminal=True).feed(BAR) == BAR
    other = RankStream(2, terminal=True)
    assert (
        other.feed(BAR + b"Traceback (most recent call last):\n")
        == b"[2] Traceback (most recent call last):\n"
    )


class Screen(io.BytesIO):
    def __init__(self, terminal: bool) -> None:
        super().__init__()
        self.terminal = terminal

    def isatty(self) -> bool:
        return self.terminal


def _process(code: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dict(os.environ)
    )


def test_processes_are_followed_to_the_screen_and_to_a_folder_per_rank(tmp_path: Path) -> None:
    screen = Screen(terminal=False)
    output = Output(tmp_path / "out", screen)
    code = (
        "import sys; print('to stdout'); print('to stderr', file=sys.stderr); sys.stdout.write('no newline')"
    )
    processes = [_process(code) for _ in range(2)]
    for rank, process in enumerate(processes):
        output.follow(rank, process.stdout, process.stderr)
    for process in processes:
        process.wait(timeout=60)
    output.wait()
    lines = screen.getvalue().decode().splitlines()
    for rank in (0, 1):
        assert {f"[{rank}] to stdout", f"[{rank}] to stderr", f"[{rank}] no newline"} <= set(lines)
        assert (tmp_path / "out" / f"rank.{rank}" / "stdout").read_text() == "to stdout\nno newline"
        assert (tmp_path / "out" / f"rank.{rank}" / "stderr").read_text() == "to stderr\n"


def test_another_ranks_line_starts_on_a_line_of_its_own_after_rank_0s_bar() -> None:
    screen = Screen(terminal=True)
    output = Output(None, screen)
    zero, one = RankStream(0, True), RankStream(1, True)
    output._show(zero, zero.feed(b"1/2 ===\r"))
    output._show(one, one.feed(b"a warning\n"))
    assert screen.getvalue() == b"1/2 ===\r\n[1] a warning\n"
