"""Hooks into TensorFlow's profiler.

`profiler.trace.enabled`
    whether TensorFlow's profiler is recording (tf.profiler.experimental.start, TensorBoard's profile
    callback): a 30 ns builtin. tf_adasum's Timeline (tf_adasum/timeline.py) names its phases in the
    profiler's trace only then, so that a phase costs nothing beyond this check otherwise.
"""

from __future__ import annotations

from tf_adasum._compat.registry import register


@register(
    "profiler.trace.enabled",
    "tf_adasum's phases do not appear as named events in TensorBoard's trace viewer",
    required=False,
)
def _check_trace_enabled() -> str | None:
    from tensorflow.python.profiler import trace

    if not callable(getattr(trace, "enabled", None)):
        return "tensorflow.python.profiler.trace has no enabled()"
    return None


def _never() -> bool:
    return False


def profiler_recording() -> bool:
    """Whether TensorFlow's profiler records trace events now (False where the hook is missing)."""
    return _recording()


try:
    from tensorflow.python.profiler.trace import enabled as _recording
except ImportError:  # the hook's check names it at import
    _recording = _never
