"""One process of the several-hosts tests: each host a network namespace of scripts/cluster.py, the job
started by mpirun (through the cluster's launch agent) or `python -m tf_adasum.run -H`.

Usage:
    hosts_worker.py OUT_DIR strategy   # model.fit under AdasumStrategy(), its devices left to it
    hosts_worker.py OUT_DIR callback   # tests/script_worker.py's plain Keras scripts with AdasumCallback
    hosts_worker.py OUT_DIR horovod    # tests/script_worker.py's Horovod example on tf_adasum.keras
    hosts_worker.py OUT_DIR cut        # Adasum all-reduces until the test cuts a host's link

Modes may be joined by commas to run one after another in one launch.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import tensorflow as tf

import tf_adasum  # under tf_adasum.run this starts the TF engine

# How long the cut mode keeps calling before it gives up waiting for the cut.
CUT_WAIT_SECONDS = 120.0


def strategy(out: Path) -> None:
    """The crash this file was written for: AdasumStrategy() with its default devices, a process alone
    on its host (or one of two), under TF_CONFIG."""
    from tests.test_training import build_linear, make_inner, problem

    comm = tf_adasum.init()
    x, y, _, _ = problem()
    adasum = tf_adasum.AdasumStrategy(sync_every=2)
    model = build_linear(adasum, lambda: make_inner("adam"))
    model.set_weights([w + comm.rank for w in model.get_weights()])  # the strategy starts all from rank 0's
    history = model.fit(x[:32], y[:32], batch_size=8, epochs=1, shuffle=False, verbose=0)
    np.savez(out / f"strategy{comm.rank}.npz", *model.get_weights())
    info = {
        "loss": float(history.history["loss"][-1]),
        "host": socket.gethostname(),
        "engine": comm.engine,
        "local_rank": comm.local_rank,
        "local_size": comm.local_size,
        "devices": list(adasum.extended.worker_devices),
        "replicas": adasum.num_replicas_in_sync,
        "address": getattr(comm, "workers", [None] * comm.size)[comm.rank],
    }
    (out / f"strategy{comm.rank}.json").write_text(json.dumps(info))


def cut(out: Path) -> None:
    """Adasum all-reduces of 1 MB, marking when this rank is in the loop; the test then takes a host's
    link down. Each rank writes the error it got and when (time.time()), then leaves at once: the job has
    failed, and MPI_Finalize would wait for the rank beyond the cut."""
    comm = tf_adasum.init()
    data = [tf.fill([1 << 18], float(comm.rank + 1))]
    tf_adasum.allreduce(data, op=tf_adasum.Adasum)
    (out / f"ready{comm.rank}").write_text("")
    result = {"message": "no error", "type": None}
    deadline = time.monotonic() + CUT_WAIT_SECONDS
    try:
        while time.monotonic() < deadline:
            tf_adasum.allreduce(data, op=tf_adasum.Adasum)
    except Exception as error:  # the test asserts it is a PeerError that names the peer
        result = {"message": str(error), "type": type(error).__name__}
    result["at"] = time.time()
    (out / f"cut{comm.rank}.json").write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(3)


if __name__ == "__main__":
    out_dir = Path(sys.argv[1])
    for mode in sys.argv[2].split(","):
        if mode == "strategy":
            strategy(out_dir)
        elif mode == "callback":
            from tests import script_worker

            script_worker.callback(out_dir)
        elif mode == "horovod":
            from tests import script_worker

            sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))  # the example's module
            script_worker.horovod(out_dir)
        elif mode == "cut":
            cut(out_dir)
        else:
            raise SystemExit(f"hosts_worker.py: unknown mode {mode!r}")
