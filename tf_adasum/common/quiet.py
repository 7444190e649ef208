"""A quiet start for tf_adasum's own programs: the demo and the scripts in examples/ and benchmarks/.

TensorFlow prints its C++ start-up log (the oneDNN notice, absl's "All log messages before
absl::InitializeLog()") on import. TF_CPP_MIN_LOG_LEVEL=2 hides most of it, but the oneDNN notice is
logged through absl while TensorFlow's libraries load, before TensorFlow reads the level
(tensorflow/tensorflow#102212). So for these programs TensorFlow is imported with stderr going to a
file, which comes back without absl's INFO and WARNING lines. Errors, and everything else, still show.
A user's own program, or a TF_CPP_MIN_LOG_LEVEL the user set, keeps TensorFlow's log as it is.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from pathlib import Path

_ABSL_LINE = re.compile(r"WARNING: All log messages before absl::|[IW]\d{4} [\d:.]+ +\d+ \S+:\d+\] ")
_PROGRAMS = tuple(Path(__file__).resolve().parents[2] / folder for folder in ("examples", "benchmarks"))


def wanted() -> bool:
    """Whether this process is the demo, an example or a benchmark, and the user has chosen no level."""
    if "TF_CPP_MIN_LOG_LEVEL" in os.environ or "tensorflow" in sys.modules:
        return False
    if sys.argv and sys.argv[0] == "-m":  # while `python -m` imports the package of its module
        return "tf_adasum.demo" in getattr(sys, "orig_argv", [])
    if not (sys.argv and sys.argv[0]):
        return False
    script = Path(sys.argv[0]).resolve()
    return any(folder in script.parents for folder in _PROGRAMS)


def import_tensorflow_quietly() -> None:
    """Imports TensorFlow at log level 2, leaving out the absl INFO and WARNING lines it prints first."""
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
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
            sys.stderr.writelines(line for line in log if not _ABSL_LINE.match(line))
