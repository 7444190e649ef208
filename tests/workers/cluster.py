"""The worker of tests/test_cluster.py: each host a network namespace of scripts/cluster.py, the job
started by mpirun (through the cluster's launch agent) or `python -m tf_adasum.run -H`:
`python -m tests.workers.cluster OUT MODE[,MODE...]` (tests/workers/dispatch.py).

Modes:
    strategy   model.fit under AdasumStrategy(), its devices left to it
    cut        Adasum all-reduces until the test cuts a host's link
and tests/workers/existing_scripts.py's plain Keras and Horovod modes, the same functions under the same
names (SCRIPT_MODES), for test_existing_scripts' checks to run across hosts.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np
import tensorflow as tf

import tf_adasum  # under tf_adasum.run this starts the TF engine
from tests.workers import existing_scripts
from tests.workers.dispatch import main

# How long the cut mode keeps calling before it gives up waiting for the cut.
CUT_WAIT_SECONDS = 120.0
# The plain Keras scripts under AdasumCallback and the Horovod scripts on tf_adasum.keras.
SCRIPT_MODES = (
    "callback", "mixed_precision", "orthogonality",
    "example", "average", "accumulate", "lazy", "local_variables", "sparse", "resume_on_rank_0",
)  # fmt: skip


def strategy(out: Path) -> None:
    """The crash this file was written for: AdasumStrategy() with its default devices, a process alone
    on its host (or one of two), under TF_CONFIG."""
    from tests.support.training import build_linear, make_inner, problem

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


MODES = {
    "strategy": strategy,
    "cut": cut,
    **{name: existing_scripts.MODES[name] for name in SCRIPT_MODES},
}

if __name__ == "__main__":
    main(MODES)
