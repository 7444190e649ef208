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

from tf_adasum.launch.private_files import open_private, private_directory

NEWLINE, RETURN, BACKSPACE = b"\n", b"\r", b"\b"
# A line longer than this without a newline is shown in parts, so that memory stays bounded.
MAX_LINE_BYTES = 1 << 20


class RankStream:
    """One rank's stream, turned into what the launcher shows (see the module's doc), in time linear in
    its size: the line being written is kept as it stands so far (what follows its last carriage return,
    its backspaces applied), never as everything a progress bar wrote into it."""

    def __init__(self, rank: int, terminal: bool) -> None:
        self.rank = rank
        self.passthrough = terminal and rank == 0
        self.terminal = terminal
        self.prefix = f"[{rank}] ".encode()
        self.line = bytearray()  # the current line as a terminal would show it now
        self.rewritten = False  # whether it was rewritten in place (a progress bar)

    def feed(self, data: bytes) -> bytes:
        if self.passthrough:
            return data
        shown = []
        pieces = data.split(NEWLINE)
        for piece in pieces[:-1]:  # each ended by a newline
            self._add(piece)
            shown.append(self._end_line())
        self._add(pieces[-1])
        if len(self.line) > MAX_LINE_BYTES:  # a line with no end in sight: shown in parts
            shown.append(self._end_line())
        return b"".join(shown)

    def close(self) -> bytes:
        """The last words, without a newline of their own: as a whole line."""
        if self.passthrough or not self.line:
            return b""
        return self._end_line()

    def _add(self, piece: bytes) -> None:
        if RETURN in piece:
            self.rewritten = True
            self.line.clear()
            piece = piece.rpartition(RETURN)[2]
        if BACKSPACE in piece:
            self.rewritten = True
            first, *rest = piece.split(BACKSPACE)
            self.line += first
            for part in rest:
                if self.line:
                    del self.line[-1]
                self.line += part
        else:
            self.line += piece

    def _end_line(self) -> bytes:
        text, rewritten = bytes(self.line), self.rewritten
        self.line.clear()
        self.rewritten = False
        if self.terminal and rewritten:  # another rank's progress bar: rank 0's alone is shown
            return b""
        return self.prefix + text + NEWLINE


class Output:
    """Every process's stdout and stderr, forwarded by a thread each, to `screen` (the launcher's stdout)
    and, with `directory`, to per-rank files: those of ranks 0..ranks-1 are made at once, in a private
    folder (private_files), so that a folder that cannot be written fails before any process starts."""

    def __init__(
        self, directory: str | os.PathLike[str] | None = None, screen: Any = None, ranks: int = 0
    ) -> None:
        self.screen = screen if screen is not None else sys.stdout.buffer
        self.terminal = bool(getattr(self.screen, "isatty", lambda: False)())
        self.directory = Path(private_directory(str(directory), "--output-filename")) if directory else None
        self.lock = threading.Lock()
        self.mid_line = False  # rank 0's last bytes on a terminal ended mid-line (a progress bar)
        self.threads: list[threading.Thread] = []
        self._files = {rank: self._open(rank) for rank in range(ranks)} if self.directory else {}

    def _open(self, rank: int) -> tuple[IO[bytes], IO[bytes]]:
        assert self.directory is not None
        folder = self.directory / f"rank.{rank}"
        folder.mkdir(mode=0o700, exist_ok=True)
        out = os.fdopen(open_private(str(folder / "stdout")), "wb")
        try:
            return out, os.fdopen(open_private(str(folder / "stderr")), "wb")
        except BaseException:
            out.close()
            raise

    def files(self, rank: int) -> tuple[IO[bytes] | None, IO[bytes] | None]:
        if self.directory is None:
            return None, None
        return self._files.pop(rank, None) or self._open(rank)

    def close(self) -> None:
        """Closes the files of ranks that were never followed."""
        for out, err in self._files.values():
            out.close()
            err.close()
        self._files.clear()

    def follow(self, rank: int, stdout: IO[bytes] | None, stderr: IO[bytes] | None, tail: Any = None) -> None:
        """Starts forwarding one process's pipes; `tail` (a deque) keeps its last lines, for errors."""
        out_file, err_file = self.files(rank)
        for pipe, file in ((stdout, out_file), (stderr, err_file)):
            if pipe is None:
                if file is not None:
                    file.close()
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
                if tail is not None:  # its last lines only: what the deque keeps of this chunk
                    lines = data.replace(RETURN, NEWLINE).split(NEWLINE)
                    for line in lines[-2 * (tail.maxlen or len(lines)) :]:
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
