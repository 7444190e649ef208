"""What a launcher shows of its processes' output (`tf_adasum.run`, plain and --elastic), as horovodrun
and mpirun show it:

- in a log (the launcher's stdout is not a terminal): whole lines, each prefixed with "[rank] ". A line
  that a program rewrites in place (a Keras progress bar: "\\r" and "\\b") is written once, as it stands
  when the line ends;
- on a terminal: rank 0's output as it comes, so its progress bar moves, and the other ranks' whole
  lines, prefixed, but not their progress bars;
- with --output-filename DIR, besides: every rank's stdout and stderr as they come, in
  DIR/rank.<r>/stdout and DIR/rank.<r>/stderr (horovodrun's layout).

A process's last words without a newline are written as a line of their own, never glued to another
rank's. No TensorFlow here.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from typing import IO, Any

NEWLINE, RETURN, BACKSPACE = b"\n", b"\r", b"\b"


def as_it_stands(line: bytes) -> tuple[bytes, bool]:
    """A line as a terminal would show it when it ends: what follows its last carriage return, with its
    backspaces applied; and whether it was rewritten in place (a progress bar)."""
    rewritten = RETURN in line or BACKSPACE in line
    shown = line.rpartition(RETURN)[2]
    if BACKSPACE in shown:
        kept = bytearray()
        for byte in shown:
            if byte == BACKSPACE[0]:
                if kept:
                    kept.pop()
            else:
                kept.append(byte)
        shown = bytes(kept)
    return shown, rewritten


class RankStream:
    """One rank's stream, turned into what the launcher shows (see the module's doc)."""

    def __init__(self, rank: int, terminal: bool) -> None:
        self.rank = rank
        self.passthrough = terminal and rank == 0
        self.terminal = terminal
        self.prefix = f"[{rank}] ".encode()
        self.pending = b""

    def feed(self, data: bytes) -> bytes:
        if self.passthrough:
            return data
        self.pending += data
        shown = []
        while NEWLINE in self.pending:
            line, _, self.pending = self.pending.partition(NEWLINE)
            shown.append(self._line(line))
        return b"".join(shown)

    def close(self) -> bytes:
        """The last words, without a newline of their own: as a whole line."""
        if self.passthrough:
            return b""
        line, self.pending = self.pending, b""
        return self._line(line) if line else b""

    def _line(self, line: bytes) -> bytes:
        text, rewritten = as_it_stands(line)
        if self.terminal and rewritten:  # another rank's progress bar: rank 0's alone is shown
            return b""
        return self.prefix + text + NEWLINE


class Output:
    """Every process's stdout and stderr, forwarded by a thread each, to `screen` (the launcher's stdout)
    and, with `directory`, to per-rank files."""

    def __init__(self, directory: str | os.PathLike[str] | None = None, screen: Any = None) -> None:
        self.screen = screen if screen is not None else sys.stdout.buffer
        self.terminal = bool(getattr(self.screen, "isatty", lambda: False)())
        self.directory = Path(directory) if directory else None
        self.lock = threading.Lock()
        self.mid_line = False  # rank 0's last bytes on a terminal ended mid-line (a progress bar)
        self.threads: list[threading.Thread] = []

    def files(self, rank: int) -> tuple[IO[bytes] | None, IO[bytes] | None]:
        if self.directory is None:
            return None, None
        folder = self.directory / f"rank.{rank}"
        folder.mkdir(parents=True, exist_ok=True)
        return open(folder / "stdout", "wb"), open(folder / "stderr", "wb")

    def follow(self, rank: int, stdout: IO[bytes] | None, stderr: IO[bytes] | None, tail: Any = None) -> None:
        """Starts forwarding one process's pipes; `tail` (a deque) keeps its last lines, for errors."""
        out_file, err_file = self.files(rank)
        for pipe, file in ((stdout, out_file), (stderr, err_file)):
            if pipe is None:
                continue
            thread = threading.Thread(
                target=self._forward, args=(RankStream(rank, self.terminal), pipe, file, tail), daemon=True
            )
            thread.start()
            self.threads.append(thread)

    def _forward(self, stream: RankStream, pipe: IO[bytes], file: IO[bytes] | None, tail: Any) -> None:
        try:
            for data in iter(lambda: os.read(pipe.fileno(), 65536), b""):
                if file is not None:
                    file.write(data)
                    file.flush()
                if tail is not None:
                    for line in data.replace(RETURN, NEWLINE).split(NEWLINE):
                        if line.strip():
                            tail.append(line.decode(errors="replace"))
                self._show(stream, stream.feed(data))
            self._show(stream, stream.close())
        finally:
            if file is not None:
                file.close()

    def _show(self, stream: RankStream, data: bytes) -> None:
        if not data:
            return
        with self.lock:
            if stream.passthrough:
                self.mid_line = not data.endswith(NEWLINE)
            elif self.mid_line:
                data = NEWLINE + data  # off rank 0's progress bar first
                self.mid_line = False
            self.screen.write(data)
            self.screen.flush()

    def wait(self, timeout: float = 5.0) -> None:
        """Waits for the forwarding threads to pass on what the processes wrote last."""
        for thread in self.threads:
            thread.join(timeout)
