"""The Timeline (tf_adasum/timeline.py): each rank's phases as a Chrome trace, read back.

Real processes write it under mpirun (the MPI engine, eager and compiled) and under tf_adasum.run (the
TF engine, eager), from HOROVOD_TIMELINE and from hvd.start_timeline; a phase is a named event in
TensorFlow's profiler while it records; off, a phase is one shared no-op.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorflow as tf

from tests.support import processes
from tf_adasum import timeline

WORKER = ["-m", "tests.workers.timeline"]


def _events(path: Path) -> list[dict[str, Any]]:
    return [e for e in timeline.read(path) if e.get("ph") == "X"]


def _named(events: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [e for e in events if e["name"] == name]


def _inside(inner: dict[str, Any], outer: dict[str, Any]) -> bool:
    return outer["ts"] <= inner["ts"] and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"] + 1e-3


def test_off_a_phase_is_one_shared_no_op_and_on_it_writes_an_event(tmp_path: Path) -> None:
    assert not timeline.active()
    assert timeline.phase("combine", bytes=8) is timeline.phase("exchange", peer=1)
    with timeline.recording(tmp_path / "t.json") as path:
        with timeline.phase("combine", bytes=8):
            with timeline.phase("wait", on="rank 1"):
                pass
    (outer,) = _named(_events(Path(path)), "combine")
    (inner,) = _named(_events(Path(path)), "wait")
    assert outer["args"] == {"bytes": 8} and inner["args"] == {"on": "rank 1"} and _inside(inner, outer)
    assert not timeline.active()


def test_a_file_cut_short_still_reads_and_the_ranks_merge(tmp_path: Path) -> None:
    paths = []
    for rank in (0, 1):
        path = timeline.start(tmp_path / "t.json", rank, 2)
        assert path == str(tmp_path / f"t.rank{rank}.json")
        with timeline.phase("agreement"):
            pass
        paths.append(path)
        if rank == 0:
            timeline.stop()
    # Rank 1's process "died": its file has no closing bracket.
    timeline._writer.file.flush()
    assert not Path(paths[1]).read_text().rstrip().endswith("]")
    assert len(_named(_events(Path(paths[1])), "agreement")) == 1
    timeline.stop()
    count = timeline.merge(paths, tmp_path / "merged.json")
    merged = json.loads((tmp_path / "merged.json").read_text())["traceEvents"]
    assert count == len(merged) and {e["pid"] for e in merged if e["name"] == "agreement"} == {0, 1}


def _event(name: str, ts_ms: float, dur_ms: float, pid: int = 0, **args: Any) -> dict[str, Any]:
    return {
        "name": name,
        "ph": "X",
        "pid": pid,
        "tid": 0,
        "ts": ts_ms * 1e3,
        "dur": dur_ms * 1e3,
        "args": args,
    }


def test_the_profile_gives_each_phases_own_time_per_call_and_the_exchanges_rate() -> None:
    """A sync of 100 ms: a halving level of 60 (an exchange of 50 holding a wait of 40, a combine of 5)
    and an agreement of 10. Two calls, the second twice as slow; and a second rank."""
    events = []
    for call, scale in ((0, 1), (1, 2)):
        t = call * 1000.0
        events += [
            _event("adasum sync", t, 100 * scale, bytes=8 << 20, tensors=2),
            _event("agreement", t + 1 * scale, 10 * scale),
            _event("halving level 1", t + 20 * scale, 60 * scale),
            _event("exchange", t + 20 * scale, 50 * scale, bytes_sent=5_000_000),
            _event("wait", t + 25 * scale, 40 * scale),
            _event("combine", t + 72 * scale, 5 * scale),
        ]
    events.append(_event("adasum sync", 0, 7, pid=1, bytes=8 << 20, tensors=2))
    events.append({"name": "adasum sync", "ph": "i", "pid": 0, "ts": 0})  # a marked cycle: not a call
    rows = timeline.profile(events)
    assert [(r["rank"], r["calls"]) for r in rows] == [(0, 2), (1, 1)]
    row = rows[0]
    assert (row["sync"], row["bytes"], row["tensors"], row["ms"]) == ("adasum sync", 8 << 20, 2, 150.0)
    assert row["phases"] == pytest.approx(
        {
            "wait": 60,
            "agreement": 15,
            "exchange": 15,
            "halving level 1": 7.5,
            "combine": 7.5,
            "(not in a phase)": 45,
        }
    )
    assert next(iter(row["phases"])) == "wait"  # the longest first
    assert row["bytes_sent"] == 5_000_000
    assert row["exchange_mb_s"] == pytest.approx(5 / 0.075)
    text = timeline.format_profile(rows)
    assert "rank 0: 2 x adasum sync of 8.00 MiB in 2 tensor(s): 150.0 ms a call" in text
    assert "     60.0 ms   40.0%  wait" in text


def test_a_phase_is_a_named_event_in_tensorflows_profiler_trace(tmp_path: Path) -> None:
    tf.profiler.experimental.start(str(tmp_path))
    try:
        with timeline.phase("halving level 1", peer=1, bytes=64):
            tf.reduce_sum(tf.ones([8]))
    finally:
        tf.profiler.experimental.stop()
    traces = list(tmp_path.rglob("*.xplane.pb"))
    assert traces and any(b"tf_adasum halving level 1" in p.read_bytes() for p in traces)


def _check_rank(
    path: Path, rank: int, size: int, levels: int, compiled_syncs: int, folded: bool = False
) -> dict[str, Any]:
    events = _events(path)
    syncs = _named(events, "adasum sync")
    assert len(syncs) == 1 + compiled_syncs, [e["name"] for e in events]
    for name in ("agreement", "copy in"):
        assert _named(events, name), f"rank {rank}: no {name!r} phase"
    if folded:  # handed its buffer over, then waited for the result: no level of its own
        assert _named(events, "fold") and _named(events, "result to folded rank")
        assert not _named(events, "halving level 1")
        return {"events": events, "syncs": syncs}
    peers = set()
    for level in range(1, levels + 1):
        halving = _named(events, f"halving level {level}")
        assert halving, f"rank {rank}: no halving level {level}"
        peers |= {e["args"]["peer"] for e in halving}
        combines = [c for c in _named(events, "combine") if any(_inside(c, h) for h in halving)]
        assert combines, f"rank {rank}: no combine inside halving level {level}"
        assert _named(events, f"gather level {level}")
    assert peers and peers <= set(range(size)) - {rank}
    return {"events": events, "syncs": syncs}


@pytest.mark.multiprocess
def test_mpi_ranks_write_every_phase_with_its_bytes_and_peer(tmp_path: Path) -> None:
    env = {"HOROVOD_TIMELINE": str(tmp_path / "timeline.json")}
    code = processes.launch("mpi", 3, tmp_path, [*WORKER, str(tmp_path), "sync"], env)
    assert code == 0, processes.log_tail(tmp_path)
    for rank in range(3):
        # 3 ranks: rank 1 folds into rank 0 and waits for the result; 0 and 2 run the halving level.
        path = tmp_path / f"timeline.rank{rank}.json"
        events = _check_rank(path, rank, 3, levels=1, compiled_syncs=1, folded=rank == 1)["events"]
        exchanges = _named(events, "exchange")
        assert all(e["args"]["peer"] != rank for e in exchanges)
        waits = _named(events, "wait")
        assert any(any(_inside(w, x) for x in exchanges) for w in waits), "waits inside exchanges"
    level = _named(_events(tmp_path / "timeline.rank2.json"), "halving level 1")
    # Rank 2 (virtual rank 1) gives the lower half of the float32 buffer: 2^20 elements, 4 MiB.
    assert {e["args"]["bytes"] for e in level} >= {2**20 * 4}


@pytest.mark.multiprocess
def test_tf_engine_ranks_write_each_eager_sync(tmp_path: Path) -> None:
    env = {"HOROVOD_TIMELINE": str(tmp_path / "timeline.json")}
    code = processes.launch("tf", 2, tmp_path, [*WORKER, str(tmp_path), "sync"], env)
    assert code == 0, processes.log_tail(tmp_path)
    for rank in range(2):
        # The TF engine compiles even an eager sync: the whole sync is one event, with its bytes; its
        # phases are graph ops, named after them for TensorBoard's profiler, which Python does not see run.
        events = _events(tmp_path / f"timeline.rank{rank}.json")
        (whole,) = _named(events, "adasum sync (compiled)")
        assert whole["args"] == {"tensors": 2, "bytes": 2**21 * 4 + 1031 * 8} and whole["dur"] > 0
        names = json.loads((tmp_path / f"ops{rank}.json").read_text())
        for scope in ("adasum_sync/", "/halving_level_1/", "/gather_level_1/", "/combine/", "/copy_in/"):
            assert any(scope in name for name in names), f"rank {rank}: no op under {scope}"


@pytest.mark.multiprocess
def test_start_timeline_marks_each_sync(tmp_path: Path) -> None:
    code = processes.launch("mpi", 2, tmp_path, [*WORKER, str(tmp_path), "api"])
    assert code == 0, processes.log_tail(tmp_path)
    for rank in range(2):
        marks = [e for e in timeline.read(tmp_path / f"api.rank{rank}.json") if e.get("ph") == "i"]
        assert [e["name"] for e in marks] == ["adasum sync", "timeline end"]
        assert np.isfinite(marks[0]["ts"])
