"""Elastic training: Horovod's elastic API (`hvd.elastic`), on the restarts of `tf_adasum.run --elastic`.

Neither TensorFlow's collective runtime nor MPI can shrink or grow a running group, so a membership
change ends the group and the launcher starts a new one (torchrun's design):

- A process keeps its committed state in host memory: `state.commit()` copies the model's and the
  optimizer's variables (every replica's) and the state's Python attributes, and keeps the commit before
  it too.
- When a peer is lost (PeerError: it died, hangs past TF_ADASUM_TIMEOUT_SECONDS, or its link broke), or
  when the launcher reports more slots (checked in `commit()`, by rank 0, for every rank at once), every
  survivor writes its two commits to its own file and exits with RESTART_EXIT_CODE.
- The launcher starts the next group: the survivors first, in their old rank order, then new processes.
  Each runs the script from the top; `run` calls `state.sync()`, which resumes: the survivors agree on
  the newest commit they all hold (a peer lost during a commit can leave one survivor a commit ahead:
  it goes back one), each survivor loads its own copy of it, and a process with no state of its own
  (new, or every process at the job's start) takes rank 0's. Under Adasum that keeps each survivor's
  own optimizer state; the learning rate is not touched (a reset callback may; Horovod's guide rescales
  it there for the average).
- What is lost: the steps since the last commit.

Outside the elastic launcher the same API works in one group that does not change: `run` syncs and
calls the function, and a lost peer raises PeerError as anywhere else.

The modules: elastic_protocol.py (the launcher's protocol, TensorFlow-free), elastic_state.py (State,
ObjectState, run), elastic_keras.py (TensorFlow and Keras state, the callbacks); this module is their
public face, hvd.elastic.
"""

from __future__ import annotations

from tf_adasum.elastic.keras import (
    CommitStateCallback,
    KerasState,
    TensorFlowKerasState,
    TensorFlowState,
    UpdateBatchStateCallback,
    UpdateEpochStateCallback,
)
from tf_adasum.elastic.state import HostsUpdatedInterrupt, ObjectState, State, install_excepthook, run
from tf_adasum.launch.protocol import RESTART_EXIT_CODE, generation, launched

__all__ = [
    "RESTART_EXIT_CODE",
    "CommitStateCallback",
    "HostsUpdatedInterrupt",
    "KerasState",
    "ObjectState",
    "State",
    "TensorFlowKerasState",
    "TensorFlowState",
    "UpdateBatchStateCallback",
    "UpdateEpochStateCallback",
    "generation",
    "install_excepthook",
    "launched",
    "run",
]
