"""TensorFlow's collective runtime: processes configured by TF_CONFIG, or started by horovodrun in Gloo mode.

Under TF_CONFIG the cluster is the config's workers. Under horovodrun's Gloo mode (no MPI), each process
picks a free port, publishes `host:port` in horovodrun's own rendezvous key-value store
(HOROVOD_GLOO_RENDEZVOUS_ADDR / _PORT), and reads every other rank's address from it.

Exchanges are CollectiveGatherV2 in groups of two; sums are CollectiveReduceV2. Everything is in-graph,
so it works eagerly and inside tf.function. Two details matter:
- Ordering tokens: every collective of this process takes the same resource handle as its ordering
  token, so automatic control dependencies run them in program order. Without it several
  collectives in one tf.function can start in different orders on different workers and deadlock.
- Keys: a group key is derived from the group's members; the instance key counts the collectives
  created for that group. Members create the same collectives on a group in the same order, so the
  keys agree on every worker without any coordination.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import pickle
import re
import socket
import threading
import time
import urllib.error
import urllib.request
from collections import defaultdict
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from tf_adasum import _compat, timeline
from tf_adasum.algorithm import in_graph
from tf_adasum.comm.base import Communicator
from tf_adasum.common.errors import LOST_PEER, PeerError, timeout_seconds
from tf_adasum.launch.hosts import free_ports


def _group_key(members: Sequence[int | str]) -> int:
    # Far above the small keys MultiWorkerMirroredStrategy hands out for its own collectives.
    digest = hashlib.sha256(repr(tuple(members)).encode()).digest()
    return (1 << 30) + int.from_bytes(digest[:4], "little") % (1 << 30)


def cluster_from_tf_config(environ: Any = None) -> tuple[list[str], int]:
    """(worker addresses, this worker's index) from TF_CONFIG."""
    config = json.loads((os.environ if environ is None else environ)["TF_CONFIG"])
    task_type, task_id = config["task"]["type"], int(config["task"]["index"])
    return list(config["cluster"][task_type]), task_id


_RENDEZVOUS_SCOPE = "tf_adasum_workers"


def cluster_from_horovodrun(environ: Any = None) -> tuple[list[str], int]:
    """(worker addresses, this rank) through horovodrun's rendezvous store, in Gloo mode.

    Raises:
        PeerError: a rank did not publish its address within TF_ADASUM_TIMEOUT_SECONDS.
    """
    env = os.environ if environ is None else environ
    rank, size = int(env["HOROVOD_RANK"]), int(env["HOROVOD_SIZE"])
    store = f"http://{env['HOROVOD_GLOO_RENDEZVOUS_ADDR']}:{env['HOROVOD_GLOO_RENDEZVOUS_PORT']}"
    host = socket.gethostbyname(env.get("HOROVOD_HOSTNAME") or socket.gethostname())
    (port,) = free_ports(1, host)  # for this worker's gRPC server
    mine = urllib.request.Request(
        f"{store}/{_RENDEZVOUS_SCOPE}/{rank}", data=f"{host}:{port}".encode(), method="PUT"
    )
    urllib.request.urlopen(mine, timeout=30).close()
    addresses: dict[int, str] = {}
    deadline = time.monotonic() + timeout_seconds()
    while len(addresses) < size:
        for r in range(size):
            if r in addresses:
                continue
            try:
                with urllib.request.urlopen(f"{store}/{_RENDEZVOUS_SCOPE}/{r}", timeout=30) as reply:
                    addresses[r] = reply.read().decode()
            except urllib.error.HTTPError as error:
                if error.code != 404:  # 404: that rank has not published yet
                    raise
        if len(addresses) < size:
            if time.monotonic() > deadline:
                missing = sorted(set(range(size)) - set(addresses))
                raise PeerError(
                    f"rank {rank}: rank(s) {missing} did not publish their address in horovodrun's "
                    f"rendezvous store within {timeout_seconds():.0f} s (TF_ADASUM_TIMEOUT_SECONDS)"
                )
            time.sleep(0.05)
    return [addresses[r] for r in range(size)], rank


def _wait_for_the_leader(address: str, seconds: float) -> None:
    """Waits (at most `seconds`) until worker 0, where TensorFlow's coordination service runs, accepts
    connections. A worker that asks it before its server listens is told to wait by gRPC's reconnect
    backoff, about 1 s, and every worker waits for the last to connect: when a group's processes start
    at once (the elastic launcher's warm processes), worker 0 a few milliseconds late cost every start
    1 s. After `seconds`, the strategy's own connection reports what is wrong."""
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=1.0).close()
            return
        except OSError:
            time.sleep(0.01)


class TFCollectiveCommunicator(Communicator):
    """The workers of one cluster (TF_CONFIG's, or horovodrun's), one CPU device each.

    Args:
        workers: every worker's "host:port", in rank order.
        rank: this process's index in `workers`.
    """

    engine = "tf"
    codes_in_gathers = True
    compiles_eager_syncs = True
    gathers_small_buffers = True
    # Keys of one signature's function: a range of this many per group, above the counted keys. A
    # pipelined VHDD (vhdd.pipelined_tensors) takes up to 3 a chunk for one pair of ranks, 8 chunks a
    # buffer, a buffer per dtype; a buffer of one chunk up to 10 (its gather in 8 parts).
    KEYS_PER_SIGNATURE = 256
    # One collective leaves the link idle while the runtime serializes the whole tensor into one message
    # before sending any of it, and while the peer parses it after the last byte. An exchange of at least
    # 2 * LANE_BYTES goes as up to LANES collectives instead, each of one part in its own lane (its own
    # ordering token and group key), which run at once: one part's bytes are on the wire while another's
    # are copied. A 32 MiB exchange at 1 Gbit/s took 1.5x the wire time as one collective, 1.1-1.2x in
    # 4 lanes (benchmarks/README.md, bench_cluster).
    LANES = 4
    LANE_BYTES = 1 << 20

    def __init__(self, workers: Sequence[str], rank: int) -> None:
        hosts = [address.rsplit(":", 1)[0] for address in workers]
        same_host = [i for i, h in enumerate(hosts) if h == hosts[rank]]
        local_rank = same_host.index(rank)
        # Hosts in order of first appearance; the cross group is every host with a local_rank-th process.
        host_order = list(dict.fromkeys(hosts))
        cross = [h for h in host_order if sum(1 for x in hosts if x == h) > local_rank]
        super().__init__(rank, len(workers), local_rank, len(same_host), cross.index(hosts[rank]), len(cross))
        self.workers = list(workers)
        self.homogeneous = len({hosts.count(h) for h in host_order}) == 1
        task_type = "worker"
        resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec({task_type: self.workers}),
            task_type=task_type,
            task_id=rank,
            rpc_layer="grpc",
        )
        if rank != 0:
            _wait_for_the_leader(self.workers[0], timeout_seconds())
        # The strategy starts this worker's gRPC server and turns on the collective runtime.
        options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=timeout_seconds())
        try:
            self.strategy = tf.distribute.MultiWorkerMirroredStrategy(
                cluster_resolver=resolver, communication_options=options
            )
        except RuntimeError as error:
            if "at program startup" not in str(error):
                raise
            raise RuntimeError(
                "the TF engine must start before TensorFlow runs its first op: call tf_adasum.init() (or "
                "create the AdasumStrategy) at the top of the script, before listing devices or building "
                "tensors"
            ) from error
        # How a lost peer is noticed. TensorFlow's timeout of a collective parks a thread of its own for
        # the whole timeout, however soon the collective ends: at 300 s, a loop of short fits held 5,600
        # threads a process after 40 s and aborted ("Resource temporarily unavailable"). The strategy
        # runs TensorFlow's coordination service, whose heartbeats abort every collective of a process
        # whose peer died, hangs or is cut off (within about 10 s), so the collectives wait without a
        # timeout (but one at start-up). Where it does not run, each has the timeout, as before.
        self._op_timeout = 0.0 if _compat.coordination_service_on() else timeout_seconds()
        self.device = f"/job:{task_type}/replica:0/task:{rank}/device:CPU:0"
        self._instances: dict[int, int] = defaultdict(int)
        # While a signature's function is traced (instance_keys_of): its key range and counts, per
        # thread, since another thread may trace collectives of its own meanwhile.
        self._keyed = threading.local()
        self._slots: dict[int, int] = {}  # key range slot -> the signature that holds it
        # A pipeline's steps (vhdd.pipelined_tensors): VHDD's fold, halving levels, gather levels and
        # the result to a folded rank, each with an ordering of its own, lanes included.
        p2 = 1 << (self.size.bit_length() - 1)
        self.pipeline_stages = 2 * (p2.bit_length() - 1) + (2 if p2 < self.size else 0)
        self._staged = threading.local()
        with tf.init_scope(), tf.device(self.device):
            self._token = tf.Variable(0.0, trainable=False, name="tf_adasum_ordering_token")
            self._lane_tokens = [
                tf.Variable(0.0, trainable=False, name=f"tf_adasum_lane{lane}_ordering_token")
                for lane in range(self.LANES)
            ]
            self._stage_tokens = [
                [
                    tf.Variable(0.0, trainable=False, name=f"tf_adasum_stage{step}_lane{lane}_ordering_token")
                    for lane in range(self.LANES + 1)  # the last: the step's collectives out of lanes
                ]
                for step in range(self.pipeline_stages)
            ]
        # Where each rank lands in a gather's output: the runtime sorts members by device name. The
        # same comparator orders every subgroup, so one gather over everybody calibrates them all.
        with tf.init_scope():
            order = self._collective(
                "gather", tf.constant([self.rank], tf.int64), range(self.size), "start-up", timed=True
            )
        self._position = {int(r): i for i, r in enumerate(order.numpy())}

    def _collective(
        self,
        kind: str,
        x: tf.Tensor,
        members: Sequence[int],
        what: str,
        instance_key: int | None = None,
        fixed_group: str = "control",
        merge_op: str = "Add",
        lane: int | None = None,
        timed: bool = False,
    ) -> tf.Tensor:
        """One collective. `timed`: it has the timeout even where the coordination service watches (once
        a process, at start-up: one thread for the timeout, not one per collective)."""
        members = sorted(members)
        # A lane's collectives are a group of their own, ordered by their own token (LANES).
        key = _group_key(members if lane is None else [f"lane{lane}", *members])
        step = getattr(self._staged, "step", None)
        if step is not None:  # one step of a pipeline: ordered only among that step's collectives
            token = self._stage_tokens[step][self.LANES if lane is None else lane]
        else:
            token = self._token if lane is None else self._lane_tokens[lane]
        keyed = getattr(self._keyed, "range", None)
        if instance_key is None and keyed is not None:  # in a signature's function
            base, counts = keyed
            counts[key] += 1
            if counts[key] > self.KEYS_PER_SIGNATURE:
                raise RuntimeError(
                    f"{what}: a compiled eager sync needs more than {self.KEYS_PER_SIGNATURE} collectives "
                    "with one group of ranks; tf_adasum reserves no more keys per signature"
                )
            instance_key = base + counts[key]
        elif instance_key is None:
            self._instances[key] += 1
            instance_key = self._instances[key]
        else:  # a fixed key of its own group, matched by every call whether eager or traced
            key = _group_key([fixed_group, *members])
        args: dict[str, Any] = {
            "group_size": len(members),
            "group_key": key,
            "instance_key": instance_key,
            "ordering_token": [token.handle],
            "communication_hint": "auto",
            "timeout_seconds": timeout_seconds() if timed else self._op_timeout,
        }
        try:
            with tf.device(self.device):
                if kind == "gather":
                    return tf.raw_ops.CollectiveGatherV2(input=x, **args)
                return tf.raw_ops.CollectiveReduceV2(input=x, merge_op=merge_op, final_op="Id", **args)
        except LOST_PEER as error:
            raise self.peer_error(error, what, members) from error

    @contextlib.contextmanager
    def instance_keys_of(self, signature: int) -> Iterator[None]:
        """While the compiled function of one eager signature is traced: its collectives take keys from
        a range fixed by the signature alone (above every counted key), not from the counters. So every
        rank's trace of it has the same keys whatever each traced before, and a rank whose shapes differ
        (the agreement stops it before any data moves) leaves the counters as the others have them.
        Its calls reuse the keys, as a compiled train step's do."""
        slots = 1 << 21  # below 2**29 + 2**21 * 256 = 2**30: int32 keys, far from the counters
        slot = signature % slots
        while self._slots.setdefault(slot, signature) != signature:  # taken: the next free one, which
            slot = (slot + 1) % slots  # every rank finds alike, having traced the same signatures
        self._keyed.range = ((1 << 29) + slot * self.KEYS_PER_SIGNATURE, defaultdict(int))
        try:
            yield
        finally:
            self._keyed.range = None

    @contextlib.contextmanager
    def stage(self, step: int) -> Iterator[None]:
        """While one step of a pipeline is built (vhdd.pipelined_tensors): its collectives take that
        step's ordering tokens, so the executor chains them with the same step of the chunks before and
        after, in program order, and runs them beside the other steps' collectives. Each rank builds the
        same steps in the same order, so every token's chain is the same everywhere."""
        if not 0 <= step < self.pipeline_stages:
            raise ValueError(
                f"pipeline step {step}: this communicator has steps 0..{self.pipeline_stages - 1}"
            )
        outer = getattr(self._staged, "step", None)
        self._staged.step = step
        try:
            yield
        finally:
            self._staged.step = outer

    def peer_of(self, message: str) -> int | None:
        # The runtime names a peer by task ("/job:worker/replica:0/task:1") or by address.
        for match in re.finditer(r"/job:\w+/replica:\d+/task:(\d+)", message):
            if int(match.group(1)) != self.rank:
                return int(match.group(1))
        for r, address in enumerate(self.workers):
            if r != self.rank and address in message:
                return r
        return None

    def _lane_bounds(self, n: int, itemsize: int) -> list[int]:
        """Where a row of n elements of itemsize bytes is cut into lanes: one per LANE_BYTES, at most
        LANES, one (no cut) below 2 * LANE_BYTES."""
        lanes = max(1, min(self.LANES, n * itemsize // self.LANE_BYTES))
        return [n * lane // lanes for lane in range(lanes + 1)]

    def _gather(self, x: tf.Tensor, members: Sequence[int], what: str, lane: int | None = None) -> tf.Tensor:
        # The runtime gathers only float16/32/64 and int32/64. A gather moves bits without arithmetic,
        # so bfloat16 travels as float16 bits and narrow integers are widened.
        if x.dtype == tf.bfloat16:
            return tf.bitcast(
                self._collective("gather", tf.bitcast(x, tf.float16), members, what, lane=lane), tf.bfloat16
            )
        if x.dtype in (tf.float16, tf.float32, tf.float64, tf.int32, tf.int64):
            return self._collective("gather", x, members, what, lane=lane)
        wide = tf.int64 if x.dtype in (tf.uint32, tf.uint64) else tf.int32
        return tf.cast(self._collective("gather", tf.cast(x, wide), members, what, lane=lane), x.dtype)

    def exchange(self, peer: int, send: tf.Tensor, recv_size: int, what: str) -> tf.Tensor:
        sent = int(send.shape[0])
        n = max(sent, recv_size)  # the peer computes the same n: its sizes are ours swapped
        if n == 0:
            return send[:0]
        padded = tf.pad(send, [[0, n - sent]]) if n > sent else send
        size = send.dtype.size
        bounds = self._lane_bounds(n, size)
        lanes = len(bounds) - 1
        theirs_second = self._position[peer] > self._position[self.rank]
        with timeline.ops_phase(
            "exchange", what=what, peer=peer, bytes_sent=n * size, bytes_received=n * size, lanes=lanes
        ):
            parts = []
            for lane, (lo, hi) in enumerate(itertools.pairwise(bounds)):
                both = self._gather(padded[lo:hi], [self.rank, peer], what, None if lanes == 1 else lane)
                parts.append(both[hi - lo :] if theirs_second else both[: hi - lo])
            received = (parts[0] if lanes == 1 else tf.concat(parts, 0))[:recv_size]
        received.set_shape([recv_size])  # the gather's output shape is unknown inside a graph
        return received

    def group_sum(self, values: tf.Tensor, group: Sequence[int], what: str) -> tf.Tensor:
        with timeline.ops_phase("block sum", what=what, ranks=list(group)):
            total = self._collective("reduce", values, group, what)
        total.set_shape(values.shape)
        return total

    def _in_rank_order(self, gathered: tf.Tensor) -> tf.Tensor:
        by_rank = [self._position[r] for r in range(self.size)]
        return tf.gather(gathered, by_rank)

    def allgather(self, tensor: tf.Tensor) -> tf.Tensor:
        """Every rank's `tensor`, stacked in rank order. A tensor of 2 * LANE_BYTES or more goes in lanes,
        as an exchange does."""
        n = tensor.shape.num_elements() or 0  # unknown: one collective
        bounds = self._lane_bounds(n, tensor.dtype.size)
        lanes = len(bounds) - 1
        with timeline.ops_phase("allgather", ranks=self.size, lanes=lanes):
            if lanes == 1:
                gathered = self._gather(tf.expand_dims(tensor, 0), range(self.size), "allgather")
            else:
                row = tf.reshape(tensor, [1, n])
                parts = [
                    self._gather(row[:, lo:hi], range(self.size), "allgather", lane)
                    for lane, (lo, hi) in enumerate(itertools.pairwise(bounds))
                ]
                gathered = tf.reshape(tf.concat(parts, 1), [-1, *tensor.shape])
        stacked = self._in_rank_order(gathered)
        stacked.set_shape([self.size, *tensor.shape])
        return stacked

    def broadcast(self, tensor: tf.Tensor, root: int) -> tf.Tensor:
        return self.allgather(tensor)[root]

    def allreduce(self, tensor: tf.Tensor, reduction: str = "sum") -> tf.Tensor:
        merge = {"sum": "Add", "min": "Min", "max": "Max", "product": "Mul"}[reduction]
        what = "allreduce" if reduction == "sum" else f"allreduce({reduction})"
        if tensor.dtype == tf.uint64 and reduction in ("min", "max"):
            # As int64 (below) the order of values from 2**63 up would be wrong: gathered, then reduced.
            reduce = tf.reduce_min if reduction == "min" else tf.reduce_max
            return reduce(self.allgather(tensor), axis=0)
        if tensor.dtype in (tf.float16, tf.float32, tf.float64, tf.int32, tf.int64):
            total = self._collective("reduce", tensor, range(self.size), what, merge_op=merge)
        else:  # the runtime reduces only these dtypes; sums and products of integers wrap the same way
            wide = tf.float32 if tensor.dtype.is_floating else tf.int64
            total = tf.cast(
                self._collective("reduce", tf.cast(tensor, wide), range(self.size), what, merge_op=merge),
                tensor.dtype,
            )
        total.set_shape(tensor.shape)
        return total

    def agree(self, codes: tf.Tensor, what: str) -> tf.Tensor:
        # Instance key 1 of the control group, every time: a rank's eager call and another's call from a
        # traced train step must meet, and traced collectives keep the keys they were traced with.
        with timeline.ops_phase("agreement", what=what, ranks=self.size):
            gathered = self._collective(
                "gather", tf.expand_dims(codes, 0), range(self.size), what, instance_key=1
            )
        stacked = self._in_rank_order(gathered)
        stacked.set_shape([self.size, *codes.shape])
        return stacked

    def agree_and_gather(self, codes: tf.Tensor, buffer: tf.Tensor, what: str) -> tuple[tf.Tensor, tf.Tensor]:
        """agree(codes) and allgather(buffer) in one collective: each rank's codes travel as the bits of
        the first elements of its row. Returns ([size, 3] codes, [size, len(buffer)] rows), in rank order.

        Like agree it has a fixed key, one per dtype and length, so a rank's eager call (an epoch end
        with a zero buffer of the same layout) meets another's call from a traced train step. A row of
        2 * LANE_BYTES or more goes in lanes, as an exchange does, each with a fixed key of its own; the
        codes come out only once every lane has arrived, so an error they raise (an epoch end, a NaN)
        leaves no collective of this call pending on any rank.
        """
        words = tf.reshape(tf.bitcast(codes, buffer.dtype), [-1])  # int64 [3] -> [3 * 8 / itemsize]
        layout = f"{buffer.dtype.name}:{int(buffer.shape[0])}".encode()
        instance = 1 + int.from_bytes(hashlib.sha256(layout).digest()[:4], "little") % (1 << 30)
        payload = tf.concat([words, buffer], 0)
        if buffer.dtype == tf.bfloat16:  # the runtime gathers no bfloat16: its bits travel as float16
            payload = tf.bitcast(payload, tf.float16)
        bounds = self._lane_bounds(int(payload.shape[0]), buffer.dtype.size)
        lanes = len(bounds) - 1
        with timeline.ops_phase("agreement and allgather", what=what, ranks=self.size, lanes=lanes):
            parts = [
                self._collective(
                    "gather",
                    tf.expand_dims(payload[lo:hi], 0),
                    range(self.size),
                    what,
                    instance,
                    "sync" if lanes == 1 else f"sync lane {lane}",
                    lane=None if lanes == 1 else lane,
                )
                for lane, (lo, hi) in enumerate(itertools.pairwise(bounds))
            ]
            gathered = parts[0] if lanes == 1 else tf.concat(parts, 1)
        if buffer.dtype == tf.bfloat16:
            gathered = tf.bitcast(gathered, tf.bfloat16)
        stacked = self._in_rank_order(gathered)
        width = int(words.shape[0])
        stacked.set_shape([self.size, width + int(buffer.shape[0])])
        table = tf.bitcast(tf.reshape(stacked[:, :width], [self.size, 3, width // 3]), tf.int64)
        if width == 3:  # float64: one element per code, and bitcast keeps the shape
            table = tf.reshape(table, [self.size, 3])
        return table, stacked[:, width:]

    def adasum_groups(
        self,
        tensors: Sequence[tf.Tensor],
        indices: list[list[int]],
        names: Sequence[str] | None,
        metadata: int,
        first: bool,
    ) -> list[tf.Tensor]:
        return in_graph.adasum_groups(self, tensors, indices, names, metadata, first)

    def allgather_object(self, obj: Any, what: str) -> list[Any]:
        with tf.init_scope():  # eager even while a tf.function is being traced
            data = np.frombuffer(pickle.dumps(obj), np.uint8).astype(np.int32)
            sizes = self.allgather(tf.constant(data.size, tf.int64)).numpy()
            padded = np.zeros(int(sizes.max()), np.int32)
            padded[: data.size] = data
            rows = self.allgather(tf.constant(padded)).numpy()
        return [
            pickle.loads(row[:size].astype(np.uint8).tobytes()) for row, size in zip(rows, sizes, strict=True)
        ]
