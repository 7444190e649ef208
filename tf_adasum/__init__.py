"""tf_adasum: Adasum (adaptive summation) for TensorFlow 2 and Keras 3."""

from tf_adasum import ops
from tf_adasum.comm.base import PeerError
from tf_adasum.distributed import (
    Adasum,
    Average,
    ReduceOp,
    Sum,
    allreduce,
    broadcast,
    init,
    local_rank,
    local_size,
    rank,
    size,
)
from tf_adasum.optimizer import AdasumOptimizer
from tf_adasum.strategy import AdasumStrategy
from tf_adasum.tree import adasum_tree

__all__ = [
    "Adasum",
    "AdasumOptimizer",
    "AdasumStrategy",
    "Average",
    "PeerError",
    "ReduceOp",
    "Sum",
    "adasum_tree",
    "allreduce",
    "broadcast",
    "init",
    "local_rank",
    "local_size",
    "ops",
    "rank",
    "size",
]
__version__ = "0.1.0"
