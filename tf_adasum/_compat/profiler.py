"""Hooks into TensorFlow's profiler.

`profiler.trace.enabled`
    whether TensorFlow's profiler is recording (tf.profiler.experimental.start, TensorBoard's profile
    callback). tf_adasum's Timeline (tf_adasum/timeline.py) names its phases in the profiler's trace
    only then, so that a phase costs nothing beyond this check otherwise. TensorFlow 2.21 has it as a
    function, a 30 ns builtin; 2.16 to 2.20 as a module flag that the profiler's C++ sets when it starts
    and clears when it stops. Both are read here, one way each.
"""

from __future__ import annotations

from collections.abc import Callable

from tf_adasum._compat.registry import register


@register(
    "profiler.trace.enabled",
    "tf_adasum's phases do not appear as named events in TensorBoard's trace viewer",
    required=False,
)
def _check_trace_enabled() -> str | None:
    from tensorflow.python.profiler import trace

    enabled = getattr(trace, "enabled", None)
    if not callable(enabled) and not isinstance(enabled, bool):
        return (
            "tensorflow.python.profiler.trace has no enabled() (TensorFlow 2.21) and no enabled flag "
            "(2.16 to 2.20)"
        )
    return None


def _never() -> bool:
    return False


def _reader() -> Callable[[], bool]:
    try:
        from tensorflow.python.profiler import trace
    except ImportError:  # the hook's check names it at import
        return _never
    enabled = getattr(trace, "enabled", None)
    if callable(enabled):
        return enabled
    if isinstance(enabled, bool):
        return lambda: trace.enabled  # the flag, read at each call: the profiler sets it on start
    return _never


_recording = _reader()


def profiler_recording() -> bool:
    """Whether TensorFlow's profiler records trace events now (False where the hook is missing)."""
    return _recording()
