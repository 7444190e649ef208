"""What the launchers show of their processes' output (tf_adasum/launch/output.py): in a log, whole lines
prefixed with the rank, a progress bar once as it ends; on a terminal, rank 0's progress bar alone; with
--output-filename, one folder per rank."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tf_adasum.launch.output import MAX_LINE_BYTES, Output, RankStream

# A Keras progress bar as it reaches a pipe: rewritten in place with "\b" and "\r", then a newline.
BAR = b"1/2 \xe2\x94\x81\x1b[0m - loss: 1.0\b\b\b\b\b\b\b\b\b\b\r2/2 done - loss: 0.5\n"


def test_a_line_rewritten_in_place_is_taken_as_it_stands() -> None:
    log, terminal = RankStream(1, terminal=False), RankStream(1, terminal=True)
    for stream, shown in ((log, b"[1] xy\n"), (terminal, b"")):  # a rewritten line: a bar, on a terminal
        assert stream.feed(b"abc\rxy\n") == shown
    assert log.feed(b"abcd\b\bX\n") == b"[1] abX\n"
    assert log.feed(b"ab\b\b\b\bcd\n") == b"[1] cd\n"  # more backspaces than characters
    assert terminal.feed(b"plain\n") == b"[1] plain\n"
    # Rewritten across reads: a backspace or a carriage return in one, what it rewrites in the last.
    assert log.feed(b"50%") == b"" and log.feed(b"\b\b\b") == b"" and log.feed(b"60%\r70%") == b""
    assert log.feed(b"\n") == b"[1] 70%\n"


def test_a_stream_of_progress_bars_is_kept_as_one_frame_not_as_everything_written() -> None:
    """A bar rewritten with "\r" for a whole epoch, with no newline: what the stream holds is the frame
    that stands, so each read costs its own size (the whole line so far was searched and joined at every
    read: 33 MB of bars took 16.5 s to forward, against 1.7 s for the worker alone)."""
    stream = RankStream(1, terminal=False)
    frame = b"\r" + b"=" * 60 + b" 123/1000 - loss: 0.5"
    for _ in range(2000):
        assert stream.feed(frame * 32) == b""
        assert len(stream.line) < 2 * len(frame)
    assert stream.feed(b"\n") == b"[1] " + frame[1:] + b"\n"


def test_a_line_without_an_end_is_shown_in_parts() -> None:
    stream = RankStream(1, terminal=False)
    shown = b"".join(stream.feed(b"x" * 65536) for _ in range(2 * MAX_LINE_BYTES // 65536 + 1))
    assert shown.count(b"\n") == 1 and len(stream.line) <= MAX_LINE_BYTES


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
    output = Output(tmp_path / "out", screen, ranks=2)
    for rank in (0, 1):  # made before any process starts, private to this user
        assert (tmp_path / "out" / f"rank.{rank}" / "stdout").stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o700
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


def test_a_folder_that_cannot_be_written_fails_before_any_process_starts(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(NotADirectoryError, match=r"--output-filename .*file is not a folder"):
        Output(tmp_path / "file" / "out", Screen(terminal=False), ranks=2)
    (tmp_path / "out" / "rank.1").mkdir(parents=True)
    os.symlink(tmp_path / "elsewhere", tmp_path / "out" / "rank.1" / "stdout")  # never followed
    with pytest.raises(OSError):
        Output(tmp_path / "out", Screen(terminal=False), ranks=2)
    assert not (tmp_path / "elsewhere").exists()
