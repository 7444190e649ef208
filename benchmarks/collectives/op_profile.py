"""Where one compiled call's time goes, op by op: TensorFlow's profiler on one rank's call, reduced.

The Timeline (tf_adasum.timeline) records a sync's phases as Python builds them; inside a compiled call
it sees the whole call as one phase. TensorFlow's profiler (tf.profiler.experimental) records every op
the executor runs, on every thread, the collectives included. record() runs one call under it and keeps
the ops; summary() splits the call's wall time into its collectives (launch, waiting for the peer and
the transfer together, each in program order), the time between them, and the arithmetic.

Usage (bench_cluster.py --ops-profile runs it in every all-reduce job of the TF engine):
    record(fn, path, before=barrier)    # writes path: {"call_ms": ..., "ops": [[name, type, start, ms]]}
    summary([path_rank0, path_rank1, ...])
"""

from __future__ import annotations

import glob
import json
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def record(fn: Callable[[], Any], path: Path, before: Callable[[], Any] | None = None) -> None:
    """Runs fn() once under TensorFlow's profiler and writes its ops to `path` as JSON: the call's wall
    time, and each op the executor ran as [name, type, start ms from the call's start, ms]."""
    import tensorflow as tf
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    logdir = tempfile.mkdtemp(prefix="op_profile_")
    try:
        if before is not None:
            before()
        tf.profiler.experimental.start(logdir)
        try:
            start_ns = time.time_ns()
            fn()
            end_ns = time.time_ns()
        finally:  # a call that raises leaves no profiler running
            tf.profiler.experimental.stop()
        written = sorted(glob.glob(f"{logdir}/**/*.xplane.pb", recursive=True))
        if not written:
            raise RuntimeError(f"TensorFlow's profiler wrote no trace under {logdir}")
        space = xplane_pb2.XSpace()
        space.ParseFromString(Path(written[-1]).read_bytes())
    finally:
        shutil.rmtree(logdir, ignore_errors=True)
    ops, first = [], float("inf")
    for plane in space.planes:
        if plane.name != "/host:CPU":
            continue
        for line in plane.lines:
            for event in line.events:
                begin = (line.timestamp_ns * 1000 + event.offset_ps) / 1e9  # ms, on the profiler's clock
                first = min(first, begin)  # the profiler starts right before the call
                name = plane.event_metadata[event.metadata_id].name
                op, colon, kind = name.rpartition(":")
                if colon and op and " " not in name and "::" not in name:  # not the runtime's own events
                    ops.append([op, kind, begin, event.duration_ps / 1e9])
    for o in ops:
        o[2] -= first
    ops.sort(key=lambda o: o[2])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"call_ms": (end_ns - start_ns) / 1e6, "ops": ops}))


def _union_ms(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def summary(paths: Sequence[Path]) -> list[dict[str, Any]]:
    """One row per rank's recorded call:
    call_ms          the call's wall time, from Python
    collectives      each collective op in the order it started: [op type, start ms, ms]; its time is
                     its launch, the wait for its peers and the transfer
    in_collectives_ms  the time some collective was running (their union)
    between_ms       the rest of the call: the arithmetic and copies between collectives, the executor's
                     scheduling, and the call's entry and exit
    arithmetic_ms    the time some other op ran, outside every collective (their union)
    """
    rows = []
    for path in paths:
        data = json.loads(Path(path).read_text())
        collectives = [o for o in data["ops"] if o[1].startswith("Collective")]
        spans = [(o[2], o[2] + o[3]) for o in collectives]
        others = [(o[2], o[2] + o[3]) for o in data["ops"] if not o[1].startswith("Collective")]
        inside = _union_ms(spans)
        outside = _union_ms(others + spans) - inside
        rows.append(
            {
                "path": str(path),
                "call_ms": round(data["call_ms"], 2),
                "collectives": [[o[1], round(o[2], 2), round(o[3], 2)] for o in collectives],
                "in_collectives_ms": round(inside, 2),
                "between_ms": round(data["call_ms"] - inside, 2),
                "arithmetic_ms": round(outside, 2),
            }
        )
    return rows
