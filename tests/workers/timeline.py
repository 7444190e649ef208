"""The worker of tests/test_timeline.py: Adasum syncs while a Timeline records, eagerly and compiled.

Modes:
    sync   the timeline HOROVOD_TIMELINE names (the test sets it): an eager Adasum all-reduce of a list
           (two dtypes) and a compiled one, then the timeline stopped so the files are whole; the names
           of the compiled function's ops go to OUT/ops<rank>.json
    api    hvd.start_timeline(OUT/api.json, mark_cycles=True), one eager sync, hvd.stop_timeline()
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import tensorflow as tf

import tf_adasum
import tf_adasum.tensorflow as hvd
from tests.workers.dispatch import main

# 2M float32 (8 MB): above the TF engine's all-gather threshold, so both engines run VHDD's levels.
SIZES = (2**21, 1031)


def tensors(rank: int) -> list[tf.Tensor]:
    rng = np.random.default_rng(rank)
    return [
        tf.constant(rng.standard_normal(SIZES[0]).astype(np.float32)),
        tf.constant(rng.standard_normal(SIZES[1])),  # float64: a second fused buffer
    ]


def sync(out: Path) -> None:
    assert os.environ.get("HOROVOD_TIMELINE"), "the test names the timeline through the environment"
    tf_adasum.init()
    mine = tensors(tf_adasum.rank())
    tf_adasum.allreduce(mine, op=tf_adasum.Adasum)
    compiled = tf.function(lambda *t: tf_adasum.allreduce(list(t), op=tf_adasum.Adasum))
    compiled(*mine)
    hvd.stop_timeline()
    graph = compiled.get_concrete_function(*mine).graph
    names = [op.name for op in graph.get_operations()]
    (out / f"ops{tf_adasum.rank()}.json").write_text(json.dumps(names))


def api(out: Path) -> None:
    hvd.init()
    hvd.start_timeline(str(out / "api.json"), mark_cycles=True)
    tf_adasum.allreduce(tensors(hvd.rank()), op=tf_adasum.Adasum)
    hvd.stop_timeline()


MODES = {"sync": sync, "api": api}

if __name__ == "__main__":
    main(MODES)
