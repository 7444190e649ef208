"""benchmarks/collectives/op_profile.py: TensorFlow's profiler on one compiled call gives its ops, and
the summary splits the call's time into collectives, the time between them and the arithmetic."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import tensorflow as tf

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "collectives"))

import op_profile  # noqa: E402


def test_a_compiled_call_under_the_profiler_gives_its_ops_by_name_and_type(tmp_path: Path) -> None:
    x = tf.constant(np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32))
    f = tf.function(lambda a: tf.reduce_sum(tf.matmul(a, a, name="square"), name="total"))
    f(x)  # traced outside the profile
    op_profile.record(lambda: np.asarray(f(x)), tmp_path / "call.json")
    data = json.loads((tmp_path / "call.json").read_text())
    names = {name.rpartition("/")[2] for name, _, _, _ in data["ops"]}
    assert {"square", "total"} <= names, data["ops"]  # (oneDNN may run MatMul as _MklMatMul)
    assert "Sum" in {kind for _, kind, _, _ in data["ops"]}, data["ops"]
    assert all(0 <= start <= data["call_ms"] and ms >= 0 for _, _, start, ms in data["ops"]), data["ops"]
    (row,) = op_profile.summary([tmp_path / "call.json"])
    assert row["collectives"] == [] and row["in_collectives_ms"] == 0
    assert row["between_ms"] == round(data["call_ms"], 2) and 0 < row["arithmetic_ms"] <= row["call_ms"]


def test_the_summary_counts_overlapping_ops_once(tmp_path: Path) -> None:
    ops = [
        ["a/CollectiveGatherV2", "CollectiveGatherV2", 1.0, 3.0],  # 1-4
        ["b/CollectiveReduceV2", "CollectiveReduceV2", 2.0, 4.0],  # 2-6, beside the first
        ["c/MatMul", "MatMul", 5.0, 2.0],  # 5-7: 1 ms of it outside the collectives
        ["d/Add", "Add", 8.0, 1.0],  # 8-9
    ]
    (tmp_path / "call.json").write_text(json.dumps({"call_ms": 10.0, "ops": ops}))
    (row,) = op_profile.summary([tmp_path / "call.json"])
    assert row["collectives"] == [["CollectiveGatherV2", 1.0, 3.0], ["CollectiveReduceV2", 2.0, 4.0]]
    assert row["in_collectives_ms"] == 5.0
    assert row["between_ms"] == 5.0
    assert row["arithmetic_ms"] == 2.0
