"""tf_adasum's errors, the peer timeout, and how an error from a compiled step is told as one of them.

Everything a user may catch is defined here: PeerError, NonFiniteUpdateError, UnevenDataError and
HookError. Inside a tf.function the first three reach the caller as tf.errors.OpError (UnknownError
for an error raised in a host call, UnavailableError or DeadlineExceededError for a peer the
collective runtime lost); translate_errors turns them back into themselves, and the agreement's
RuntimeError for ranks at different kinds of check into a RuntimeError.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

import tensorflow as tf

from tf_adasum.common.settings import peer_timeout_seconds as timeout_seconds


class PeerError(RuntimeError):
    """A peer died, never arrived, or did not answer within the timeout."""


class NonFiniteUpdateError(ValueError):
    """Some rank's update holds NaN or Inf; every rank raises the same error at the same step."""


class UnevenDataError(ValueError):
    """The ranks ran different numbers of batches; every rank raises the same error."""


class HookError(RuntimeError):
    """A private Keras or TensorFlow name tf_adasum relies on is missing or no longer behaves as assumed."""


# The errors a host call or the agreement raises inside a compiled step, by the name its message carries.
ERRORS: dict[str, type[Exception]] = {
    cls.__name__: cls for cls in (PeerError, NonFiniteUpdateError, UnevenDataError)
}

# What the collective runtime raises for a peer it lost.
LOST_PEER = (tf.errors.UnavailableError, tf.errors.DeadlineExceededError, tf.errors.CancelledError)

_RAISED_IN_GRAPH = re.compile(rf"^(?:[\w.]+\.)?({'|'.join(ERRORS)}): (.+)$", re.MULTILINE)
# The agreement's RuntimeError when the ranks are at different kinds of check (agreement.py).
_DIFFERENT_CHECKS = re.compile(r"^(?:[\w.]+\.)?RuntimeError: (the ranks are at different checks.+)$", re.M)


def translate(error: tf.errors.OpError, comm: Any) -> Exception | None:
    """The tf_adasum error that an OpError from a compiled step stands for, or None.

    Args:
        error: what the compiled step raised.
        comm: this process's communicator, or None before tf_adasum.init(); it names a lost peer.
    """
    raised = _RAISED_IN_GRAPH.search(error.message)
    if raised:
        return ERRORS[raised.group(1)](raised.group(2))
    different = _DIFFERENT_CHECKS.search(error.message)
    if different:
        return RuntimeError(different.group(1))
    if comm is not None and comm.size > 1 and isinstance(error, LOST_PEER):
        peer = comm.peer_of(error.message)
        who = f"rank {peer}" if peer is not None else "a peer"
        return PeerError(
            f"rank {comm.rank}: lost {who} during a compiled step ({how_lost(error)}): "
            f"{type(error).__name__}: {cause(error.message)}"
        )
    return None


def how_lost(error: tf.errors.OpError) -> str:
    """Which watcher noticed a lost peer, as the collective runtime's error tells it.

    The TF engine's collectives wait on TensorFlow's coordination service, whose heartbeats notice a peer
    that died, hangs or is cut off; a collective given TF_ADASUM_TIMEOUT_SECONDS ends with
    DeadlineExceededError; a peer whose process ended closes its connections.
    """
    if "stopped sending heartbeats" in error.message:
        return (
            "TensorFlow's coordination service stopped hearing its heartbeats: it died, hangs or is cut off"
        )
    if "CoordinationService/Heartbeat" in error.message:  # told on the tasks that the service is not on
        return (
            "TensorFlow's coordination service did not answer this process's heartbeats: its host died, "
            "hangs or is cut off"
        )
    if isinstance(error, tf.errors.DeadlineExceededError):
        return f"it did not answer within TF_ADASUM_TIMEOUT_SECONDS={timeout_seconds():.0f} s"
    return "the connection to it failed: it died or is cut off"


def translate_errors(fn: Callable[..., Any], current_comm: Callable[[], Any]) -> Callable[..., Any]:
    """Wraps a function that runs compiled steps so that tf_adasum's errors reach the caller as themselves.

    Args:
        fn: the function (a Keras train function, a user's tf.function, ...).
        current_comm: returns this process's communicator, or None before tf_adasum.init().

    Returns:
        fn, wrapped: a PeerError, NonFiniteUpdateError or UnevenDataError raised inside it is re-raised
        as that class, naming the rank; other errors pass through unchanged.
    """

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except tf.errors.OpError as error:
            translated = translate(error, current_comm())
            if translated is None:
                raise
            raise translated from error

    return wrapped


def cause(message: str) -> str:
    """The line of a TensorFlow error message that says what failed, not where it was defined."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    for line in lines:  # the runtime's own account, e.g. "Collective ops is aborted by: <reason>"
        if "aborted by" in line or "check alive failed" in line or "timed out" in line.lower():
            return line
    return next((line for line in lines if "task:" in line), lines[-1] if lines else "")
