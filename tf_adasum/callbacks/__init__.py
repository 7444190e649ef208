"""Keras callbacks for scripts that run one process per worker (mpirun, horovodrun, tf_adasum.run), one
per file:

- AdasumCallback (adasum.py): the one line that turns a plain Keras script into Adasum data parallelism.
- OrthogonalityMonitor (orthogonality.py): how orthogonal the replicas' updates were, per layer (the
  paper's Figure 1).
- Horovod's callbacks (horovod/_keras/callbacks.py, horovod/tensorflow/keras/callbacks.py), for Keras 3:
  BroadcastGlobalVariablesCallback (broadcast.py), MetricAverageCallback (metric_average.py),
  LearningRateScheduleCallback (learning_rate_schedule.py), LearningRateWarmupCallback
  (learning_rate_warmup.py) and BestModelCheckpoint (best_model_checkpoint.py).

The sync they install is sync.py's; the broadcasts, log averaging and batch-count checks are
shared_state.py's, which AdasumOptimizer and AdasumStrategy call too; batches.py holds what two of
them share.
"""

from tf_adasum.callbacks.adasum import AdasumCallback
from tf_adasum.callbacks.best_model_checkpoint import BestModelCheckpoint
from tf_adasum.callbacks.broadcast import BroadcastGlobalVariablesCallback
from tf_adasum.callbacks.learning_rate_schedule import LearningRateScheduleCallback
from tf_adasum.callbacks.learning_rate_warmup import LearningRateWarmupCallback
from tf_adasum.callbacks.metric_average import MetricAverageCallback
from tf_adasum.callbacks.orthogonality import OrthogonalityMonitor

__all__ = [
    "AdasumCallback",
    "BestModelCheckpoint",
    "BroadcastGlobalVariablesCallback",
    "LearningRateScheduleCallback",
    "LearningRateWarmupCallback",
    "MetricAverageCallback",
    "OrthogonalityMonitor",
]
