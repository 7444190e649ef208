"""tf_adasum: Adasum (adaptive summation) for TensorFlow 2 and Keras 3."""

import importlib.metadata

from tf_adasum import _quiet

# The demo and the examples start without TensorFlow's C++ start-up log (see _quiet). The imports below
# import TensorFlow, so this comes first.
if _quiet.wanted():
    _quiet.import_tensorflow_quietly()

from tf_adasum import _compat, callbacks, ops
from tf_adasum._compat import HookError
from tf_adasum.callbacks import AdasumCallback
from tf_adasum.comm.base import NonFiniteUpdateError, PeerError, UnevenDataError
from tf_adasum.distributed import (
    Adasum,
    Average,
    ReduceOp,
    Sum,
    allreduce,
    broadcast,
    cross_rank,
    cross_size,
    init,
    is_initialized,
    launched_for_the_tf_engine,
    local_rank,
    local_size,
    rank,
    shutdown,
    size,
)
from tf_adasum.optimizer import AdasumOptimizer, AllreduceOptimizer
from tf_adasum.strategy import AdasumStrategy
from tf_adasum.tree import adasum_tree

__all__ = [
    "Adasum",
    "AdasumCallback",
    "AdasumOptimizer",
    "AdasumStrategy",
    "AllreduceOptimizer",
    "Average",
    "HookError",
    "NonFiniteUpdateError",
    "PeerError",
    "ReduceOp",
    "Sum",
    "UnevenDataError",
    "adasum_tree",
    "allreduce",
    "broadcast",
    "callbacks",
    "cross_rank",
    "cross_size",
    "init",
    "is_initialized",
    "local_rank",
    "local_size",
    "ops",
    "rank",
    "shutdown",
    "size",
]
__version__ = importlib.metadata.version("tf_adasum")  # the one place is pyproject.toml

_compat.warn_at_import()
_compat.install_step_hooks()
# TensorFlow's collective runtime must be configured before TensorFlow runs its first op, and a script
# imports tf_adasum before it builds its model: a process that horovodrun (Gloo mode) or
# `python -m tf_adasum.run` started for the TF engine starts it here.
if launched_for_the_tf_engine():
    init()
