"""The one communicator interface that the distributed algorithm (vhdd.py) is written on."""

from __future__ import annotations

import abc
import os
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

DEFAULT_TIMEOUT_SECONDS = 300.0


def timeout_seconds() -> float:
    """How long any wait for a peer may last: $TF_ADASUM_TIMEOUT_SECONDS, default 300 s."""
    return float(os.environ.get("TF_ADASUM_TIMEOUT_SECONDS", DEFAULT_TIMEOUT_SECONDS))


class PeerError(RuntimeError):
    """A peer died, never arrived, or did not answer within the timeout."""


class NonFiniteUpdateError(ValueError):
    """Some rank's update holds NaN or Inf; every rank raises the same error at the same step."""


class UnevenDataError(ValueError):
    """The ranks ran different numbers of batches; every rank raises the same error."""


# Errors raised inside a tf.function reach the caller as tf.errors.UnknownError (or, from the collective
# runtime, as Unavailable / DeadlineExceeded); errors.translate() turns them back into these.
ERRORS: dict[str, type[Exception]] = {
    cls.__name__: cls for cls in (PeerError, NonFiniteUpdateError, UnevenDataError)
}


class Communicator(abc.ABC):
    """Ranks of one job and the few collectives Adasum needs.

    Every method is collective over the ranks it names and must be called by them in the same
    order. Tensors are TensorFlow tensors; methods work eagerly and inside tf.function.
    """

    engine: str = "abstract"

    def __init__(
        self,
        rank: int,
        size: int,
        local_rank: int,
        local_size: int,
        cross_rank: int = 0,
        cross_size: int = 1,
    ) -> None:
        self.rank, self.size, self.local_rank, self.local_size = rank, size, local_rank, local_size
        # As Horovod defines them: cross_rank is this host's index among the hosts that run a process
        # with this local_rank, and cross_size is how many such hosts there are.
        self.cross_rank, self.cross_size = cross_rank, cross_size

    def peer_of(self, message: str) -> int | None:
        """The rank that an engine's error message names, if it names one."""
        return None

    @abc.abstractmethod
    def exchange(self, peer: int, send: tf.Tensor, recv_size: int, what: str) -> tf.Tensor:
        """Sends a 1-D tensor to `peer` and returns the 1-D tensor of recv_size elements it sent."""

    @abc.abstractmethod
    def group_sum(self, values: tf.Tensor, group: Sequence[int], what: str) -> tf.Tensor:
        """Sum all-reduce of a small float64 vector over the ranks in `group` (sorted, contains rank)."""

    @abc.abstractmethod
    def broadcast(self, tensor: tf.Tensor, root: int) -> tf.Tensor:
        """Root's tensor, on every rank."""

    @abc.abstractmethod
    def allgather(self, tensor: tf.Tensor) -> tf.Tensor:
        """Every rank's tensor (same shape everywhere) stacked along a new first axis, in rank order."""

    @abc.abstractmethod
    def allreduce_sum(self, tensor: tf.Tensor) -> tf.Tensor:
        """The plain elementwise sum over all ranks."""

    @abc.abstractmethod
    def agree(self, codes: tf.Tensor, what: str) -> tf.Tensor:
        """Every rank's int64 [3] control codes, as [size, 3] in rank order.

        The one collective that every rank calls at a model sync and at the end of an epoch, so that a
        rank in one and a rank in the other meet, see the difference, and raise instead of waiting for
        each other. It matches across eager calls and tf.function executions alike.
        """

    @abc.abstractmethod
    def allgather_object(self, obj: Any, what: str) -> list[Any]:
        """Every rank's picklable object, in rank order; run eagerly (also at tf.function trace time)."""


class SingleProcessCommunicator(Communicator):
    """A world of one: what a process started without mpirun, horovodrun or TF_CONFIG gets."""

    engine = "single"

    def __init__(self) -> None:
        super().__init__(rank=0, size=1, local_rank=0, local_size=1)

    def exchange(self, peer: int, send: tf.Tensor, recv_size: int, what: str) -> tf.Tensor:
        raise PeerError(f"{what}: a world of one process has no peer {peer}")

    def group_sum(self, values: tf.Tensor, group: Sequence[int], what: str) -> tf.Tensor:
        return values

    def broadcast(self, tensor: tf.Tensor, root: int) -> tf.Tensor:
        return tensor

    def allgather(self, tensor: tf.Tensor) -> tf.Tensor:
        return tf.expand_dims(tensor, 0)

    def allreduce_sum(self, tensor: tf.Tensor) -> tf.Tensor:
        return tensor

    def agree(self, codes: tf.Tensor, what: str) -> tf.Tensor:
        return tf.expand_dims(codes, 0)

    def allgather_object(self, obj: Any, what: str) -> list[Any]:
        return [obj]
