"""The communicator interface the distributed algorithms are written on, and a world of one.

Communicator is what every engine provides: ranks, and the few collectives Adasum and training need,
on TensorFlow tensors, eagerly and inside tf.function. HostCommunicator adds the same exchanges on
numpy buffers, for an engine whose transport is host code (MPI): the algorithms are written once per
memory kind (vhdd.py), on tensors for every engine and on host buffers for these.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from tf_adasum.common.errors import PeerError, cause, how_lost


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
        # Whether every host runs the same number of processes (Horovod's is_homogeneous).
        self.homogeneous = True
        # As Horovod defines them: cross_rank is this host's index among the hosts that run a process
        # with this local_rank, and cross_size is how many such hosts there are.
        self.cross_rank, self.cross_size = cross_rank, cross_size

    def peer_of(self, message: str) -> int | None:
        """The rank that an engine's error message names, if it names one."""
        return None

    def peer_error(self, error: tf.errors.OpError, what: str, members: Sequence[int] = ()) -> PeerError:
        """What a collective's lost peer (the runtime's timeout, unavailable or cancelled error) is told
        as: the rank the runtime names, or else every other member (every other rank by default)."""
        named = self.peer_of(error.message)
        among = members or range(self.size)
        others = [named] if named is not None else [m for m in among if m != self.rank]
        return PeerError(
            f"rank {self.rank}: {what} with rank(s) {others} failed ({how_lost(error)}): "
            f"{cause(error.message)}"
        )

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
    def allreduce(self, tensor: tf.Tensor, reduction: str = "sum") -> tf.Tensor:
        """The elementwise reduction over all ranks: "sum", "min", "max" or "product"."""

    @abc.abstractmethod
    def agree(self, codes: tf.Tensor, what: str) -> tf.Tensor:
        """Every rank's int64 [3] control codes, as [size, 3] in rank order.

        The one collective that every rank calls at a model sync and at the end of an epoch, so that a
        rank in one and a rank in the other meet, see the difference, and raise instead of waiting for
        each other. It matches across eager calls and tf.function executions alike.
        """

    # Whether agree_and_gather is one collective (the TF engine), so that a compiled sync sends its
    # agreement's codes with its data.
    codes_in_gathers = False

    # Whether one all-gather may beat VHDD on a small buffer (vhdd.algorithm): where every collective
    # costs the runtime a launch of its own (the TF engine). On host memory VHDD is as fast at 1 MB.
    gathers_small_buffers = False

    # Whether the runtime matches collectives by key and checks their type and shape itself, so that
    # agreement.check_same_on_all_ranks has nothing to add (a host transport matches by order alone).
    matches_collectives_by_key = True

    # Whether the survivors of a lost peer live on to start the next group of an elastic job (not under
    # MPI, where mpirun kills them with the lost rank).
    survives_lost_peers = True

    @abc.abstractmethod
    def adasum_groups(
        self,
        tensors: Sequence[tf.Tensor],
        indices: list[list[int]],
        names: Sequence[str] | None,
        metadata: int,
        first: bool,
    ) -> list[tf.Tensor]:
        """Adasum of every rank's `tensors` by the contract tree, the tensors of each dtype (`indices`)
        fused into one buffer, on this engine's own path: the agreement first, then the algorithm
        (algorithm/fused_adasum.py says what every path must do, and gives the same bits).
        `metadata`: the tensors' fingerprint, or 0; `first`: this is the sync's first collective."""

    def allgather_buffer(self, buffer: tf.Tensor) -> tf.Tensor:
        """Every rank's 1-D buffer, [size, len], in rank order: the tree over replicas' gather."""
        return self.allgather(buffer)

    # Whether eager Adasum runs as a compiled function per signature (distributed.allreduce): for an
    # engine whose every collective is a TensorFlow op, so that eagerly each would be dispatched alone.
    compiles_eager_syncs = False

    def instance_keys_of(self, signature: int) -> contextlib.AbstractContextManager[None]:
        """While a compiled function for eager calls is traced: the keys its collectives take. Only an
        engine that matches collectives by key needs them fixed by the signature."""
        return contextlib.nullcontext()

    # How many steps of a pipeline (vhdd.pipelined_tensors) can run at once, each on its own ordering:
    # 0 where the engine orders every collective by one chain (MPI's host calls), so nothing would overlap.
    pipeline_stages = 0

    def stage(self, step: int) -> contextlib.AbstractContextManager[None]:
        """While one step of a pipeline is built: its collectives are ordered among that step's of every
        chunk, not behind every collective before them. Only for step < pipeline_stages."""
        return contextlib.nullcontext()

    def agree_and_gather(self, codes: tf.Tensor, buffer: tf.Tensor, what: str) -> tuple[tf.Tensor, tf.Tensor]:
        """agree(codes) and allgather(buffer): ([size, 3] codes, [size, len(buffer)] rows), in rank
        order. Two collectives here; one where codes_in_gathers."""
        return self.agree(codes, what), self.allgather(buffer)

    @abc.abstractmethod
    def allgather_object(self, obj: Any, what: str) -> list[Any]:
        """Every rank's picklable object, in rank order; run eagerly (also at tf.function trace time)."""


class HostCommunicator(Communicator):
    """A communicator whose transport is host code, with the exchanges also on numpy buffers.

    The distributed algorithms run on one numpy buffer per dtype through these (vhdd.vhdd_host,
    vhdd.gather_host), and a compiled sync is then one host call (across_processes). Each method is
    collective over the ranks it names, like Communicator's.

    Such a transport matches collectives by their order alone: inside a graph, host_call keeps this
    process's host calls in program order, and agreement.announce checks before each collective that
    every rank is at the same one.
    """

    matches_collectives_by_key = False

    @abc.abstractmethod
    def host_call(
        self,
        fn: Callable[..., Sequence[np.ndarray]],
        inputs: Sequence[tf.Tensor],
        dtypes: Sequence[tf.DType],
        shapes: Sequence[Any],
    ) -> list[tf.Tensor]:
        """fn(*inputs as numpy arrays) -> its outputs as tensors, eagerly or as one host call in a
        graph, after this process's previous host call and before its next (program order)."""

    @abc.abstractmethod
    def sendrecv_host(self, peer: int, send: np.ndarray, recv: np.ndarray, what: str) -> None:
        """Sends `send` to `peer` and receives its message into `recv` (contiguous, written in place)."""

    @abc.abstractmethod
    def allgather_host(self, send: np.ndarray, recv: np.ndarray, what: str) -> None:
        """Every rank's `send` into the rows of `recv` ([size, *send.shape]), in rank order."""

    @abc.abstractmethod
    def group_sum_host(self, values: np.ndarray, group: Sequence[int], what: str) -> np.ndarray:
        """group_sum on a numpy float64 vector."""

    @abc.abstractmethod
    def agree_host(self, codes: np.ndarray, what: str) -> np.ndarray:
        """agree on a numpy int64 vector, from host code."""


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

    def allreduce(self, tensor: tf.Tensor, reduction: str = "sum") -> tf.Tensor:
        return tensor

    def agree(self, codes: tf.Tensor, what: str) -> tf.Tensor:
        return tf.expand_dims(codes, 0)

    def allgather_object(self, obj: Any, what: str) -> list[Any]:
        return [obj]

    def adasum_groups(
        self,
        tensors: Sequence[tf.Tensor],
        indices: list[list[int]],
        names: Sequence[str] | None,
        metadata: int,
        first: bool,
    ) -> list[tf.Tensor]:
        return list(tensors)  # the tree over one leaf
