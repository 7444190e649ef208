"""Every TF_ADASUM_* setting a run reads from its environment, each read and checked in one place. No
TensorFlow and nothing else of tf_adasum here, so that every layer, the launcher's included, may read
them. (The build's own, TF_ADASUM_CUDA and TF_ADASUM_ARCH_FLAGS, are setup.py's; the elastic launcher's
protocol with its processes, TF_ADASUM_ELASTIC_*, is launch/protocol.py's.)

| setting | what it says | read by |
| --- | --- | --- |
| TF_ADASUM_TIMEOUT_SECONDS | how long any wait for a peer may last (300) | the engines, the launcher |
| TF_ADASUM_ENGINE | mpi, tf or single, over what the environment says | comm/engine.py |
| TF_ADASUM_LAUNCHER | "1": tf_adasum.run started this process | comm/engine.py |
| TF_ADASUM_ALGORITHM | vhdd or gather, over the choice by size | algorithm/vhdd.py, distributed.py |
| TF_ADASUM_LINK_GBITS | the link the choice of algorithm assumes (10) | algorithm/vhdd.py |
| TF_ADASUM_BUCKET_MB | gradient buckets of a traced step (0: one call) | distributed.py |
| TF_ADASUM_TIMELINE, HOROVOD_TIMELINE | where the Timeline is written | timeline.py |
| TF_ADASUM_LIBRARY | the compiled ops to load, over the package's own | common/loader.py |
| TF_ADASUM_CPU_PATH | the CPU path the ops run on, over the widest this CPU runs | common/loader.py |
"""

from __future__ import annotations

import os
from collections.abc import Mapping

DEFAULT_TIMEOUT_SECONDS = 300.0
ENGINES = ("mpi", "tf", "single")
ALGORITHMS = ("vhdd", "gather")
# The link the choice of algorithm assumes, in Gbit/s.
LINK_GBITS = 10.0
# Gradient buckets for a traced step when no groups are given, in MB (0: one call).
BUCKET_MB = 0.0
TIMELINE = ("HOROVOD_TIMELINE", "TF_ADASUM_TIMELINE")


def _number(name: str, default: float, expected: str, least: float, inclusive: bool) -> float:
    given = os.environ.get(name, "")
    try:
        value = float(given) if given else default
    except ValueError:
        value = float("nan")
    if not (value >= least if inclusive else value > least):
        raise ValueError(f"{name}={given!r}; expected {expected}")
    return value


def peer_timeout_seconds() -> float:
    """How long any wait for a peer may last: $TF_ADASUM_TIMEOUT_SECONDS, default 300 s."""
    return _number(
        "TF_ADASUM_TIMEOUT_SECONDS", DEFAULT_TIMEOUT_SECONDS, "seconds above 0, such as 300", 0, False
    )


def forced_engine(environ: Mapping[str, str]) -> str | None:
    """$TF_ADASUM_ENGINE in `environ`, if set.

    Raises:
        ValueError: it names no engine.
    """
    forced = environ.get("TF_ADASUM_ENGINE")
    if forced and forced not in ENGINES:
        raise ValueError(f"TF_ADASUM_ENGINE={forced!r}; expected one of {ENGINES}")
    return forced or None


def launched_by_tf_adasum(environ: Mapping[str, str]) -> bool:
    """Whether `python -m tf_adasum.run` started this process ($TF_ADASUM_LAUNCHER)."""
    return environ.get("TF_ADASUM_LAUNCHER") == "1"


def forced_algorithm() -> str:
    """$TF_ADASUM_ALGORITHM ("" when the size chooses).

    Raises:
        ValueError: it names no algorithm.
    """
    forced = os.environ.get("TF_ADASUM_ALGORITHM", "")
    if forced and forced not in ALGORITHMS:
        raise ValueError(f"TF_ADASUM_ALGORITHM={forced!r}; expected one of {ALGORITHMS}")
    return forced


def link_gbits() -> float:
    """The link speed the choice of algorithm assumes: $TF_ADASUM_LINK_GBITS, else LINK_GBITS."""
    return _number("TF_ADASUM_LINK_GBITS", LINK_GBITS, "the link's speed in Gbit/s, such as 10", 0, False)


def bucket_bytes() -> int:
    """The size of a gradient bucket in a traced step: $TF_ADASUM_BUCKET_MB megabytes, else BUCKET_MB."""
    megabytes = _number(
        "TF_ADASUM_BUCKET_MB", BUCKET_MB, "megabytes per bucket, 0 or more (0: one call)", 0, True
    )
    return int(megabytes * (1 << 20))


def timeline_path() -> str | None:
    """Where the Timeline is written from the start: $HOROVOD_TIMELINE, else $TF_ADASUM_TIMELINE."""
    return next((os.environ[name] for name in TIMELINE if os.environ.get(name)), None)


def library_override() -> str | None:
    """$TF_ADASUM_LIBRARY: compiled ops to load in place of the package's own."""
    return os.environ.get("TF_ADASUM_LIBRARY") or None


def forced_cpu_path() -> str | None:
    """$TF_ADASUM_CPU_PATH: the CPU path the ops run on, over the widest this CPU runs."""
    return os.environ.get("TF_ADASUM_CPU_PATH") or None
