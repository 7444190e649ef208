"""The Timeline: each rank's phases of every sync as a Chrome trace (Horovod's hvd.start_timeline and
HOROVOD_TIMELINE), and as named events in TensorBoard's profiler trace.

The phases: the agreement, the copies into and out of the fused buffer, the fold, each VHDD halving
level (its exchange with the peer, the dot products and norms, the block sum, the combine), each gather
level, and the waits inside every exchange; each with its bytes and its peer. A rank's slow phase shows
as a long bar on its row; a peer's slowness shows as a long wait.

Each rank writes its own file, streamed as the phases end, so a file is readable even when its process
dies: `path` in a job of one process, else `path` with `.rank<r>` before its suffix. `python -m
tf_adasum.timeline merge OUT IN...` joins the ranks' files into one trace, a row per rank, for
chrome://tracing or ui.perfetto.dev. Times are each host's wall clock.

What is timed: every phase that runs in Python, which is every phase under the MPI engine (eager, or
compiled: its whole sync is one host call) and under the TF engine when called eagerly. Inside a
compiled step under the TF engine the phases are ops of TensorFlow's graph, which Python does not see
run; their ops are named after the phases (tf.name_scope), so TensorBoard's profiler shows them.

Off (no timeline, TensorFlow's profiler not recording), a phase costs one check of about 0.1 µs.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import tensorflow as tf

from tf_adasum import _compat
from tf_adasum.common import settings


class _Writer:
    """One rank's trace file: Chrome's JSON array format, one complete ("X") event per phase."""

    def __init__(self, path: str, rank: int, mark_cycles: bool) -> None:
        self.path = path
        self.rank = rank
        self.mark_cycles = mark_cycles
        self.lock = threading.Lock()
        self.threads: dict[int, int] = {}
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.file = open(path, "w")
        self.file.write("[\n")
        # Microseconds since the epoch, counted by the monotonic clock from here: the ranks' files line
        # up as well as their hosts' clocks do.
        self.wall_us = time.time_ns() / 1e3
        self.origin_ns = time.perf_counter_ns()
        self._write({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}})
        self._write({"name": "process_sort_index", "ph": "M", "pid": rank, "args": {"sort_index": rank}})

    def _write(self, event: dict[str, Any]) -> None:
        self.file.write(json.dumps(event, separators=(",", ":")) + ",\n")

    def _tid(self) -> int:
        ident = threading.get_ident()
        tid = self.threads.get(ident)
        if tid is None:
            tid = self.threads[ident] = len(self.threads)
            name = threading.current_thread().name
            self._write(
                {"name": "thread_name", "ph": "M", "pid": self.rank, "tid": tid, "args": {"name": name}}
            )
        return tid

    def us(self, ns: int) -> float:
        return self.wall_us + (ns - self.origin_ns) / 1e3

    def complete(self, name: str, start_ns: int, end_ns: int, args: dict[str, Any]) -> None:
        with self.lock:
            event = {"name": name, "ph": "X", "pid": self.rank, "tid": self._tid(), "ts": self.us(start_ns)}
            event["dur"] = (end_ns - start_ns) / 1e3
            if args:
                event["args"] = args
            self._write(event)

    def instant(self, name: str, args: dict[str, Any]) -> None:
        with self.lock:
            event = {"name": name, "ph": "i", "s": "p", "pid": self.rank, "tid": self._tid()}
            event["ts"] = self.us(time.perf_counter_ns())
            if args:
                event["args"] = args
            self._write(event)
            self.file.flush()

    def close(self) -> None:
        with self.lock:
            end = {"name": "timeline end", "ph": "i", "s": "g", "pid": self.rank}
            end["ts"] = self.us(time.perf_counter_ns())
            self.file.write(json.dumps(end, separators=(",", ":")) + "\n]\n")
            self.file.close()


_writer: _Writer | None = None


class _Phase:
    """A phase being timed; also a named event in TensorFlow's profiler while it records."""

    __slots__ = ("args", "name", "start", "traceme")

    def __init__(self, name: str, args: dict[str, Any]) -> None:
        self.name = name
        self.args = args
        self.traceme: Any = None

    def __enter__(self) -> _Phase:
        if _compat.profiler_recording():
            self.traceme = tf.profiler.experimental.Trace(f"tf_adasum {self.name}", **self.args)
            self.traceme.__enter__()
        self.start = time.perf_counter_ns()
        return self

    def __exit__(self, *exc: Any) -> None:
        end = time.perf_counter_ns()
        if self.traceme is not None:
            self.traceme.__exit__(*exc)
        writer = _writer
        if writer is not None:
            writer.complete(self.name, self.start, end, self.args)


_OFF = contextlib.nullcontext()


def phase(name: str, **args: Any) -> contextlib.AbstractContextManager[Any]:
    """Times the `with` block as the phase `name` (args: bytes, peer, ...), where a timeline is on or
    TensorFlow's profiler records; otherwise a shared no-op (one check). For code on host memory."""
    if _writer is None and not _compat.profiler_recording():
        return _OFF
    return _Phase(name, args)


def ops_phase(name: str, **args: Any) -> contextlib.AbstractContextManager[Any]:
    """phase() for code that builds TensorFlow ops: eagerly, the same; while a function is traced, the
    ops built in the block are named after the phase, for TensorBoard's profiler (always: profiling
    often starts after tracing), and nothing is timed."""
    if not tf.executing_eagerly():
        return tf.name_scope(name.replace(" ", "_"))
    return phase(name, **args)


def mark_cycle(what: str, **args: Any) -> None:
    """Marks the start of a sync (Horovod's mark_cycles) on the timeline, if one is on and asked."""
    writer = _writer
    if writer is not None and writer.mark_cycles:
        writer.instant(what, args)


def rank_path(path: str | os.PathLike[str], rank: int, size: int) -> str:
    """Where rank `rank` of `size` writes its part of the timeline `path`."""
    path = Path(path)
    if size == 1:
        return str(path)
    return str(path.with_name(f"{path.stem}.rank{rank}{path.suffix}"))


def start(path: str | os.PathLike[str], rank: int, size: int, mark_cycles: bool = False) -> str:
    """Starts this rank's timeline (stopping one already on); returns the file it writes."""
    global _writer
    stop()
    _writer = _Writer(rank_path(path, rank, size), rank, mark_cycles)
    return _writer.path


def stop() -> None:
    """Stops this rank's timeline and closes its file; nothing if none is on."""
    global _writer
    writer, _writer = _writer, None
    if writer is not None:
        writer.close()


def active() -> bool:
    return _writer is not None


def start_from_environment(rank: int, size: int) -> str | None:
    """Starts the timeline $HOROVOD_TIMELINE (or $TF_ADASUM_TIMELINE) names, with
    $HOROVOD_TIMELINE_MARK_CYCLES; returns the file, or None where neither is set."""
    path = settings.timeline_path()
    if path is None or _writer is not None:
        return None
    mark_cycles = os.environ.get("HOROVOD_TIMELINE_MARK_CYCLES", "0") not in ("", "0", "false", "False")
    return start(path, rank, size, mark_cycles)


atexit.register(stop)


def read(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The events of one trace file, also one whose process died before closing it."""
    text = Path(path).read_text().rstrip()
    if text.startswith("{"):
        return list(json.loads(text)["traceEvents"])
    if not text.endswith("]"):
        text = text.rstrip(",") + "]"
    return list(json.loads(text))


def merge(paths: Sequence[str | os.PathLike[str]], out: str | os.PathLike[str]) -> int:
    """Joins the ranks' files into one trace (a row per rank); returns the number of events."""
    events = [event for path in paths for event in read(path)]
    Path(out).write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return len(events)


SYNCS = ("adasum sync", "adasum sync (compiled)")


def profile(events: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Where each rank's syncs spent their time: one row per rank and kind of sync (its name, bytes and
    tensors), with `calls`, the median `ms` of a call, and `phases`: each phase's own time in a call
    (its time less that of the phases inside it; median over the calls), in ms. An exchange's own time
    is what it took beyond its waits; `bytes_sent` per call and `exchange_mb_s`, the bytes sent over
    the time from the exchanges' start to their end, waits included."""
    by_thread: dict[tuple[Any, Any], list[dict[str, Any]]] = {}
    for event in events:
        if event.get("ph") == "X":
            by_thread.setdefault((event["pid"], event.get("tid")), []).append(event)
    calls: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for (pid, _), thread in by_thread.items():
        thread.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[tuple[dict[str, Any], dict[str, Any] | None]] = []  # (event, the call it counts towards)
        for event in thread:
            while stack and event["ts"] >= stack[-1][0]["ts"] + stack[-1][0]["dur"]:
                stack.pop()
            call = stack[-1][1] if stack else None
            if event["name"] in SYNCS and call is None:
                args = event.get("args", {})
                call = {"ms": event["dur"] / 1e3, "own": {}, "bytes_sent": 0, "exchange_ms": 0.0}
                key = (pid, event["name"], args.get("bytes"), args.get("tensors"))
                calls.setdefault(key, []).append(call)
            if call is not None:
                own = call["own"]
                own[event["name"]] = own.get(event["name"], 0.0) + event["dur"] / 1e3
                if stack and stack[-1][1] is call:
                    parent = stack[-1][0]["name"]
                    own[parent] = own.get(parent, 0.0) - event["dur"] / 1e3
                if event["name"] in ("exchange", "allgather"):
                    call["bytes_sent"] += int(event.get("args", {}).get("bytes_sent", 0))
                    call["exchange_ms"] += event["dur"] / 1e3
            stack.append((event, call))
    rows = []
    for (pid, name, nbytes, tensors), found in sorted(calls.items(), key=lambda kv: repr(kv[0])):
        phases = {
            n: _median([c["own"].get(n, 0.0) for c in found]) for n in {n for c in found for n in c["own"]}
        }
        exchange_ms = _median([c["exchange_ms"] for c in found])
        sent = _median([c["bytes_sent"] for c in found])
        rows.append(
            {
                "rank": pid,
                "sync": name,
                "bytes": nbytes,
                "tensors": tensors,
                "calls": len(found),
                "ms": _median([c["ms"] for c in found]),
                "phases": dict(
                    sorted(((n, ms) for n, ms in phases.items() if n not in SYNCS), key=lambda p: -p[1])
                )
                | {"(not in a phase)": phases[name]},
                "bytes_sent": sent,
                "exchange_mb_s": sent / 1e6 / (exchange_ms / 1e3) if exchange_ms else None,
            }
        )
    return rows


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def format_profile(rows: Sequence[dict[str, Any]]) -> str:
    """profile()'s rows as text: a block per rank and kind of sync, its phases by time."""
    lines = []
    for row in rows:
        size = f"{row['bytes'] / 2**20:.2f} MiB" if row["bytes"] else "?"
        speed = f", exchanges at {row['exchange_mb_s']:.0f} MB/s" if row["exchange_mb_s"] else ""
        lines.append(
            f"rank {row['rank']}: {row['calls']} x {row['sync']} of {size} in {row['tensors']} tensor(s): "
            f"{row['ms']:.1f} ms a call, {row['bytes_sent'] / 2**20:.2f} MiB sent{speed}"
        )
        for name, ms in row["phases"].items():
            if ms >= 0.05:
                lines.append(f"    {ms:9.1f} ms  {100 * ms / row['ms']:5.1f}%  {name}")
    return "\n".join(lines)


@contextlib.contextmanager
def recording(path: str | os.PathLike[str], rank: int = 0, size: int = 1) -> Iterator[str]:
    """A timeline on for the `with` block; yields the file it writes."""
    written = start(path, rank, size)
    try:
        yield written
    finally:
        stop()


USAGE = """usage: python -m tf_adasum.timeline merge OUT IN [IN ...]   join the ranks' files into OUT
       python -m tf_adasum.timeline profile IN [IN ...]      where each rank's syncs spent their time
"""


def main(argv: Sequence[str]) -> int:
    if len(argv) >= 2 and argv[0] == "profile":
        print(format_profile(profile([e for path in argv[1:] for e in read(path)])))
        return 0
    if len(argv) < 3 or argv[0] != "merge":
        sys.stderr.write(USAGE)
        return 2
    count = merge(argv[2:], argv[1])
    print(f"{argv[1]}: {count} events from {len(argv) - 2} file(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
