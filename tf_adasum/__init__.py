"""tf_adasum: Adasum (adaptive summation) for TensorFlow 2 and Keras 3."""

import importlib.metadata
import os
import sys

# `python -m tf_adasum.demo` shows its own output, not TensorFlow's C++ start-up log, unless the user set
# TF_CPP_MIN_LOG_LEVEL. The imports below import TensorFlow, so this comes first.
if sys.argv[0] == "-m" and "tf_adasum.demo" in sys.orig_argv and "TF_CPP_MIN_LOG_LEVEL" not in os.environ:

    def _import_tensorflow_quietly() -> None:
        # Level 2 hides most of the start-up log, but TensorFlow logs its oneDNN notice through absl while
        # its libraries load, before it reads the level (tensorflow/tensorflow#102212). So stderr goes to
        # a file during that import, and comes back without absl's INFO and WARNING lines.
        import re
        import tempfile

        os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
        absl_line = re.compile(r"WARNING: All log messages before absl::|[IW]\d{4} [\d:.]+ +\d+ \S+:\d+\] ")
        stderr = os.dup(2)
        with tempfile.TemporaryFile("w+") as log:
            os.dup2(log.fileno(), 2)
            try:
                import tensorflow  # noqa: F401
            finally:
                sys.stderr.flush()
                os.dup2(stderr, 2)
                os.close(stderr)
                log.seek(0)
                sys.stderr.writelines(line for line in log if not absl_line.match(line))

    _import_tensorflow_quietly()

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
