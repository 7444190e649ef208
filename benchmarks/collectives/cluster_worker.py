"""One rank of bench_cluster.py's all-reduce jobs: times and the bytes each host's interface sent.

Usage (bench_cluster.py starts it; by hand, on a cluster that is up):
    mpirun ... python benchmarks/collectives/cluster_worker.py [--megabytes 16 64] [--repeats 3] \
        [--bytes-calls 2]
    python -m tf_adasum.run -np P -H ... --agent ... benchmarks/collectives/cluster_worker.py ...
    mpirun ... python benchmarks/collectives/cluster_worker.py --horovod ...  # Horovod's Adasum, own job

Rank 0 prints one JSON line per case (one tensor of each --megabytes, then the ResNet-50 list):
    adasum_ms, compiled_ms   tf_adasum.allreduce(op=Adasum) eagerly and inside a tf.function (median)
    sum_ms, ratio, compiled_ratio   the engine's own sum all-reduce of the same data (bench_allreduce's
                 engine_sum: MPI.Allreduce, or MultiWorkerMirroredStrategy's all-reduce), in this job
    adasum_host_mb, sum_host_mb   bytes sent by each host's eth0 per call (its tx counter, read from
                 /proc/net/dev inside the host's namespace after a barrier, before and after
                 --bytes-calls calls, divided by them); one entry per host, in host order. They include
                 TCP/IP headers and the ACKs the host sent for what it received.
    adasum_rank_mb           the same per rank: the host's bytes divided by its ranks (equal shares)
    adasum_busy_cores, compiled_busy_cores, sum_busy_cores   how many of the machine's cores were busy
                 during --bytes-calls calls of each (/proc/stat: every host's processes, the kernel's
                 network processing and the links' shaping; all the namespace hosts share the cores)
    adasum_job_cores, compiled_job_cores, sum_job_cores   how many of them the job's processes used
                 (their processor time summed over the ranks, per second of the calls' wall time)
    bound_mb                 2 (P - 1) / P times the data: what each rank must send in a
                 bandwidth-optimal all-reduce; host_bound_mb the same with P the number of hosts, what
                 each host must send when its ranks first combine locally
With --against MODULE.NAME=VALUE (TF engine), also the compiled call traced with that constant of
tf_adasum changed, their calls alternating: against_ms, compiled_alternating_ms (the compiled call's
median over the same rounds) and against_ratio, the second over the first. With --ops-profile DIR, one
call of each kind under TensorFlow's profiler (op_profile.py), each rank's ops in DIR.
With --horovod, hvd.allreduce(op=hvd.Adasum) instead: eagerly (horovod_ms; on the ResNet-50 list, one
call per tensor, only with --horovod-eager-list: 6.5 s a list at 1 Gbit/s, against 1.2 s fused) and all
in one tf.function (horovod_compiled_ms, where Horovod fuses them; horovod_host_mb is this call's).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Run as `python benchmarks/collectives/cluster_worker.py`: benchmarks/ (common.py) and this folder
# (bench_allreduce.py, op_profile.py) on the path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf
from common import median_ms, resnet50_shapes

WARMUP = 1


def tx_bytes(device: str = "eth0") -> int:
    """This network namespace's tx byte counter of `device` (0 where it has none, as on one host)."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, fields = line.partition(":")
            if name.strip() == device:
                return int(fields.split()[8])
    return 0


def host_index() -> int:
    """This host's index in the cluster, from its hostname (`<name>h<i>`; 0 elsewhere)."""
    name = socket.gethostname()
    digits = name[name.rfind("h") + 1 :] if "h" in name else ""
    return int(digits) if digits.isdigit() else 0


def host_mb(
    fn: Callable[[], Any], calls: int, barrier: Callable[[], None], gather: Callable[[np.ndarray], np.ndarray]
) -> list[float]:
    """MB each host's interface sent per call of fn, in host order."""
    barrier()
    before = tx_bytes()
    for _ in range(calls):
        fn()
    barrier()
    sent = tx_bytes() - before
    rank, size = gather.rank, gather.size  # type: ignore[attr-defined]
    row = np.zeros(2 * size)
    row[rank], row[size + rank] = sent, host_index()
    table = gather(row)
    per_host: dict[int, float] = {}
    for r in range(size):
        # Every rank of a host reads the same counter: take the largest reading.
        h = int(table[size + r])
        per_host[h] = max(per_host.get(h, 0.0), float(table[r]))
    return [round(per_host[h] / calls / 2**20, 2) for h in sorted(per_host)]


def machine_ticks() -> tuple[int, int, int]:
    """The machine's busy and total processor ticks over all its cores, and its count of cores, from
    /proc/stat (no namespace separates it: every host of the cluster shares these cores)."""
    with open("/proc/stat") as f:
        lines = f.read().splitlines()
    ticks = [int(x) for x in lines[0].split()[1:9]]  # user nice system idle iowait irq softirq steal
    cores = sum(1 for line in lines[1:] if line.startswith("cpu"))
    return sum(ticks) - ticks[3] - ticks[4], sum(ticks), cores


def cores_used(
    fn: Callable[[], Any], calls: int, barrier: Callable[[], None], gather: Callable[[np.ndarray], np.ndarray]
) -> tuple[float, float]:
    """While `calls` calls of fn run: how many of the machine's cores were busy on average (every host's
    processes, the kernel's network processing, the links' shaping), and how many the job's processes
    used (their processor time, summed over the ranks, per second of wall time)."""
    barrier()
    busy, total, cores = machine_ticks()
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(calls):
        fn()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    barrier()
    busy_after, total_after, _ = machine_ticks()
    row = np.zeros(gather.size)  # type: ignore[attr-defined]
    row[gather.rank] = cpu  # type: ignore[attr-defined]
    job_cpu = float(gather(row).sum())
    return round(cores * (busy_after - busy) / max(total_after - total, 1), 2), round(job_cpu / wall, 2)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--megabytes", type=int, nargs="*", default=[16, 64])
    parser.add_argument("--no-resnet", action="store_true", help="leave the ResNet-50 list out")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bytes-calls", type=int, default=2)
    parser.add_argument("--horovod", action="store_true", help="time Horovod's Adasum (MPI) instead")
    parser.add_argument(
        "--horovod-eager-list",
        action="store_true",
        help="also Horovod's eager per-tensor calls on the ResNet-50 list (161 rounds: ~6.5 s at 1 Gbit/s)",
    )
    parser.add_argument(
        "--exchanges",
        action="store_true",
        help="instead: the TF engine's exchange alone, between ranks r and r ^ 1, of half of each "
        "--megabytes (VHDD's first level), compiled, in 1, 2 and 4 lanes",
    )
    parser.add_argument(
        "--ops-profile",
        type=Path,
        help="TF engine: also run one call of each kind (eager, compiled, sum) under TensorFlow's profiler "
        "and write its ops to DIR/CASE-KIND-rankR.json (benchmarks/collectives/op_profile.py)",
    )
    parser.add_argument(
        "--against",
        metavar="MODULE.NAME=VALUE",
        help="TF engine: also the compiled call traced with a constant of tf_adasum.MODULE set to VALUE "
        "(e.g. algorithm.vhdd.PIPELINE_BYTES=0, or a class's: "
        "comm.tf_collective.TFCollectiveCommunicator.LANES=1), "
        "its calls alternating with the compiled call's in the same job: "
        "against_ms, compiled_alternating_ms and against_ratio (the compiled call's ÷ against_ms)",
    )
    args = parser.parse_args()
    if args.exchanges:
        exchanges(args)
        return
    cases: list[tuple[str, list[tuple[int, ...]]]] = [
        (f"single_{mb}MB", [(mb * 2**18,)]) for mb in args.megabytes
    ]
    if not args.no_resnet:
        cases.append(("resnet50_161_tensors", resnet50_shapes()))

    if args.horovod:
        import horovod.tensorflow as hvd
        from mpi4py import MPI

        hvd.init()
        rank, size, engine = hvd.rank(), hvd.size(), "horovod"
        barrier: Callable[[], None] = MPI.COMM_WORLD.Barrier

        def gather_fn(row: np.ndarray) -> np.ndarray:
            out = np.empty_like(row)
            MPI.COMM_WORLD.Allreduce(row, out, op=MPI.SUM)
            return out

    else:
        import bench_allreduce

        import tf_adasum

        bench_allreduce.tf_adasum = tf_adasum
        comm = tf_adasum.init()
        rank, size, engine = comm.rank, comm.size, comm.engine

        def gather_fn(row: np.ndarray) -> np.ndarray:
            return np.asarray(tf_adasum.allreduce(tf.constant(row, tf.float64), op=tf_adasum.Sum))

    gather: Any = gather_fn
    gather.rank, gather.size = rank, size
    hosts = len({int(h) for h in gather(_host_row(rank, size))[size:]})
    rng = np.random.default_rng(rank)
    for name, shapes in cases:
        tensors = [tf.constant(rng.standard_normal(s).astype(np.float32)) for s in shapes]
        nbytes = 4 * sum(int(np.prod(s)) for s in shapes)
        row: dict[str, Any] = {"case": name, "engine": engine, "ranks": size, "hosts": hosts}
        row |= {"tensors": len(shapes), "megabytes": round(nbytes / 2**20, 1)}
        if args.horovod:
            eager = lambda ts=tensors: [np.asarray(hvd.allreduce(t, op=hvd.Adasum)) for t in ts]  # noqa: E731
            compiled_fn = tf.function(lambda ts: [hvd.allreduce(t, op=hvd.Adasum) for t in ts])
            compiled = lambda ts=tensors, f=compiled_fn: [np.asarray(x) for x in f(ts)]  # noqa: E731
            if len(shapes) == 1 or args.horovod_eager_list:
                eager_ms = median_ms(eager, args.repeats, before=barrier, warmup=WARMUP)
                row["horovod_ms"] = round(eager_ms, 2)
            row["horovod_compiled_ms"] = round(
                median_ms(compiled, args.repeats, before=barrier, warmup=WARMUP), 2
            )
            if args.bytes_calls:
                row["horovod_host_mb"] = host_mb(compiled, args.bytes_calls, barrier, gather)
        else:
            sum_fn, barrier = bench_allreduce.engine_sum(comm, tensors)
            eager = lambda ts=tensors: [np.asarray(x) for x in tf_adasum.allreduce(ts)]  # noqa: E731
            compiled_fn = tf.function(lambda ts: tf_adasum.allreduce(ts))
            compiled = lambda ts=tensors, f=compiled_fn: [np.asarray(x) for x in f(ts)]  # noqa: E731
            adasum = median_ms(eager, args.repeats, before=barrier, warmup=WARMUP)
            inside = median_ms(compiled, args.repeats, before=barrier, warmup=WARMUP)
            summed = median_ms(sum_fn, args.repeats, before=barrier, warmup=WARMUP)
            row |= {
                "adasum_ms": round(adasum, 2),
                "compiled_ms": round(inside, 2),
                "sum_ms": round(summed, 2),
            }
            row |= {"ratio": round(adasum / summed, 2), "compiled_ratio": round(inside / summed, 2)}
            if args.against:
                row |= against(args.against, tensors, compiled, args.repeats, barrier)
            if args.ops_profile:
                import op_profile

                for key, fn in (("eager", eager), ("compiled", compiled), ("sum", sum_fn)):
                    op_profile.record(fn, args.ops_profile / f"{name}-{key}-rank{rank}.json", before=barrier)
            if args.bytes_calls:
                row["adasum_host_mb"] = host_mb(eager, args.bytes_calls, barrier, gather)
                row["sum_host_mb"] = host_mb(sum_fn, args.bytes_calls, barrier, gather)
                per_host = size // hosts
                row["adasum_rank_mb"] = [round(b / per_host, 2) for b in row["adasum_host_mb"]]
                for key, fn in (("adasum", eager), ("compiled", compiled), ("sum", sum_fn)):
                    row[f"{key}_busy_cores"], row[f"{key}_job_cores"] = cores_used(
                        fn, args.bytes_calls, barrier, gather
                    )
        row["bound_mb"] = round(2 * (size - 1) / size * nbytes / 2**20, 2)
        row["host_bound_mb"] = round(2 * (hosts - 1) / hosts * nbytes / 2**20, 2)
        if rank == 0:
            print(json.dumps(row), flush=True)
    # Every rank leaves together: rank 0, where TensorFlow's coordination service runs, prints last, and
    # with --ops-profile it parses the largest trace after the others are done. (One 2x2 job of ten with
    # --ops-profile exited 1 after its last case without saying why; not reproduced in two more.)
    if cases:
        barrier()


def against(
    setting: str,
    tensors: list[tf.Tensor],
    compiled: Callable[[], Any],
    repeats: int,
    barrier: Callable[[], None],
) -> dict[str, Any]:
    """The compiled call against the same call traced with one constant of tf_adasum changed: their
    calls alternate (each after a barrier), so both see the same link and the same load."""
    import tf_adasum

    name, _, value = setting.partition("=")
    path, _, constant = name.rpartition(".")
    # The longest prefix of the path that is a module; the rest are attributes (a class's constant).
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            module = importlib.import_module("tf_adasum." + ".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[cut:]:
            module = getattr(module, attribute)
        break
    else:
        raise ValueError(f"--against {setting}: no module of tf_adasum in {path!r}")
    before = getattr(module, constant)
    setattr(module, constant, type(before)(value))
    try:  # the constant is read while the call is traced
        other_fn = tf.function(lambda ts: tf_adasum.allreduce(ts))
        other = lambda ts=tensors, f=other_fn: [np.asarray(x) for x in f(ts)]  # noqa: E731
        barrier()
        other()
    finally:
        setattr(module, constant, before)
    times: dict[str, list[float]] = {"compiled": [], "against": []}
    for i in range(WARMUP + repeats):
        for key, fn in (("compiled", compiled), ("against", other)):
            barrier()
            start = time.perf_counter()
            fn()
            if i >= WARMUP:
                times[key].append(1e3 * (time.perf_counter() - start))
    mine, theirs = statistics.median(times["compiled"]), statistics.median(times["against"])
    return {
        "against": setting,
        "against_ms": round(theirs, 2),
        "compiled_alternating_ms": round(mine, 2),
        "against_ratio": round(mine / theirs, 3),
    }


def exchanges(args: argparse.Namespace) -> None:
    """Rows "exchange_<MB>MB": exchange_ms[lanes] of one pair exchange of MB / 2 each way, compiled."""
    import bench_allreduce

    import tf_adasum

    bench_allreduce.tf_adasum = tf_adasum
    comm = tf_adasum.init()
    if comm.engine != "tf":
        raise SystemExit("--exchanges times the TF engine's exchange; run it under tf_adasum.run")
    _, barrier = bench_allreduce.engine_sum(comm, [tf.zeros([1])])
    peer = comm.rank ^ 1
    for mb in args.megabytes:
        half = tf.constant(np.random.default_rng(comm.rank).standard_normal(mb * 2**17).astype(np.float32))
        row: dict[str, Any] = {"case": f"exchange_{mb}MB", "engine": "tf", "ranks": comm.size}
        row["megabytes_each_way"] = mb / 2
        for lanes in (1, 2, 4):
            comm.LANES = lanes  # this instance's lanes; its class's tokens cover up to 4
            fn = tf.function(lambda x: comm.exchange(peer, x, int(x.shape[0]), "exchange benchmark"))
            ms = median_ms(lambda f=fn, x=half: np.asarray(f(x)), args.repeats, before=barrier, warmup=WARMUP)
            row[f"lanes{lanes}_ms"] = round(ms, 2)
        if comm.rank == 0:
            print(json.dumps(row), flush=True)


def _host_row(rank: int, size: int) -> np.ndarray:
    row = np.zeros(2 * size)
    row[size + rank] = host_index()
    return row


if __name__ == "__main__":
    main()
