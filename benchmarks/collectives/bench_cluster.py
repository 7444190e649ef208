"""Adasum across hosts: the all-reduce, the bytes on the wire and the fit step on a shaped cluster.

Usage (as root; makes its own cluster of network namespaces, "bench", with scripts/cluster.py):
    .venv/bin/python benchmarks/collectives/bench_cluster.py        # the default matrix, 19 minutes here
    .venv/bin/python benchmarks/collectives/bench_cluster.py --rates none 1gbit 10gbit \
        --layouts 2x1 4x1 2x2 --parts allreduce horovod \
        --out benchmarks/collectives/cluster_output/round2               # about 50 minutes
    .venv/bin/python benchmarks/collectives/bench_cluster.py --rates 1gbit --layouts 2x1 --parts allreduce \
        --megabytes 16
    .venv/bin/python benchmarks/collectives/bench_cluster.py --plot-only  # table and plot from saved results

For each link rate (--rates: tc rates, "none" for unshaped) and layout (--layouts HxS: H hosts, S
processes on each), on one cluster of max(H) hosts whose every link is reshaped per rate:
    goodput    one TCP stream from host 0 to host 1 for 2 s: the link's measured rate (Mbit/s); and
               every host's stream at once, in pairs (2i <-> 2i+1, a VHDD level) and in a ring, for 3 s
               (goodput_pairs_mbit, goodput_ring_mbit: whether the shared cores keep up)
    allreduce  collectives/cluster_worker.py under each engine (--engines mpi tf): Adasum eager and
               compiled against the engine's own sum all-reduce in the same job, for one tensor of
               each --megabytes (also --small-megabytes where P = 4) and the ResNet-50 list, and the
               bytes each host's eth0 sent per call against 2 N (P - 1) / P, and the machine's cores
               busy meanwhile, and those the job's processes used (whether the cores or the link bound
               a cell: the namespace hosts share this machine's cores)
    exchange   the same worker with --exchanges (TF engine, layouts of an even number of processes):
               one exchange between ranks r and r ^ 1 of half of each --megabytes, compiled, in 1, 2
               and 4 lanes: what TensorFlow's collective runtime makes of the wire
    horovod    the same worker with --horovod: Horovod's Adasum (MPI) in its own mpirun job, right
               after tf_adasum's (Horovod's background thread slows other MPI traffic in its process)
    fit        training/bench_fit.py --processes (TF engine): AdasumStrategy's fit step, and the same
               step as a custom loop, against MultiWorkerMirroredStrategy's custom loop (its fit is
               broken upstream), in alternating rounds (--fit-rounds) of the same job
    buckets    training/bench_fit.py --processes --buckets (TF engine): a tape loop's step with Adasum of
               the gradients (DistributedGradientTape(op=Adasum)) in one call against gradient buckets
               of each --bucket-megabytes, overlapping the backward pass
    fit-buckets the same for model.fit's step under AdasumStrategy (bench_fit.py --bucket-loop fit):
               Adasum of the optimizer's deltas in one call against buckets
    local      collectives/bench_allreduce.py --devices-per-process 2 (first layout with one process per
               host): the strategy's sync with local_reduction "adasum" and "mean" against the sum

Jobs get TF_ADASUM_LINK_GBITS, the measured goodput, as a user of such a cluster would set it (the TF
engine's choice of algorithm weighs it). MPI jobs also get every OMPI_MCA_* variable of this environment
(Open MPI's parameters, to compare its transport's settings). --timeline writes each all-reduce job's
Timeline and adds its profile (python -m tf_adasum.timeline profile) as "profile" rows: each rank's
phases per kind of sync. --ops-profile runs one call of each kind (Adasum eager and compiled, the sum)
of the TF engine's all-reduce jobs under TensorFlow's profiler, which sees inside a compiled call, and
adds "ops_profile" rows (collectives/op_profile.py): each rank's collectives in order, each one's time,
and the time between them. --against MODULE.NAME=VALUE times, in the same jobs, the compiled call
against the same call traced with one of tf_adasum's constants changed, their calls alternating: an A/B
of one setting that the noise between jobs cannot blur (several settings: a TF job each).

Every row goes to stdout and to OUT/results.jsonl as a JSON line with the rate, the layout and the
measured goodput; OUT/table.md holds the tables and OUT/time_vs_rate.png the plot of time against the
measured goodput. MPI runs as `mpirun --host a:S,b:S` inside host 0 with the cluster's launch agent
(no --oversubscribe: with it this Open MPI places every rank on the first host); the TF engine as
`tf_adasum.run -H a:S,b:S --agent ...` from this namespace. The kernel here has no sch_netem, so
links are shaped in rate only (tbf); no delay is applied.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import cluster  # noqa: E402
import op_profile  # noqa: E402

from tf_adasum import timeline  # noqa: E402

NAME = "bench"
PYTHON = str(ROOT / ".venv" / "bin" / "python")
MPIRUN = str(ROOT / ".venv" / "bin" / "mpirun")
AGENT = f"python3 {ROOT / 'scripts' / 'cluster.py'} agent"
ENV = {
    "TF_ADASUM_CLUSTER": NAME,
    "OMPI_ALLOW_RUN_AS_ROOT": "1",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    "TF_CPP_MIN_LOG_LEVEL": "3",
    "TF_CPU_ALLOCATOR_USE_BFC": "true",
}
PORT = 5299

GOODPUT_RECEIVER = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1)
c, _ = s.accept(); buf = bytearray(1 << 20); n = 0; start = None
while True:
    k = c.recv_into(buf)
    if not k:
        break
    start = start or time.perf_counter(); n += k
print(n * 8 / (time.perf_counter() - start) / 1e6)
"""
GOODPUT_SENDER = """
import socket, sys, time
for _ in range(100):
    try:
        s = socket.create_connection((sys.argv[1], int(sys.argv[2]))); break
    except OSError:
        time.sleep(0.05)
data = bytes(1 << 20); end = time.perf_counter() + float(sys.argv[3])
while time.perf_counter() < end:
    s.sendall(data)
s.close()
"""


def parse_layout(layout: str) -> tuple[int, int]:
    hosts, _, slots = layout.partition("x")
    return int(hosts), int(slots or 1)


def host_list(c: cluster.Cluster, layout: str) -> str:
    hosts, slots = parse_layout(layout)
    return ",".join(f"{a}:{slots}" for a in c.addresses[:hosts])


def reap(c: cluster.Cluster) -> None:
    """Kills whatever a job left in the cluster's host namespaces (only this driver's processes)."""
    for ns in c.namespaces:
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, check=False)
        for pid in pids.stdout.split():
            try:
                os.kill(int(pid), 9)
            except (ProcessLookupError, ValueError):
                pass


def goodput(c: cluster.Cluster, seconds: float = 2.0) -> float:
    """Mbit/s of one TCP stream from host 0 to host 1."""
    receiver = c.popen(
        1, ["python3", "-c", GOODPUT_RECEIVER, c.addresses[1], str(PORT)], stdout=subprocess.PIPE, text=True
    )
    c.run(
        0, ["python3", "-c", GOODPUT_SENDER, c.addresses[1], str(PORT), str(seconds)], timeout=60, check=True
    )
    out, _ = receiver.communicate(timeout=30)
    return round(float(out.strip()), 0)


def goodput_together(c: cluster.Cluster, hosts: int, pattern: str, seconds: float = 3.0) -> list[float]:
    """Mbit/s of each TCP stream when `hosts` hosts send at once: "pairs", host 2i and 2i+1 to each
    other (a VHDD level's exchanges); "ring", host i to host i+1 (a ring's step). On one machine every
    veth and the bridge share its cores, so several streams at once may each get less than one alone.
    """
    flows = (
        [(i, i ^ 1) for i in range(hosts - hosts % 2)]
        if pattern == "pairs"
        else [(i, (i + 1) % hosts) for i in range(hosts)]
    )
    receivers = [
        c.popen(
            b,
            ["python3", "-c", GOODPUT_RECEIVER, c.addresses[b], str(PORT + a)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for a, b in flows
    ]
    senders = [
        c.popen(a, ["python3", "-c", GOODPUT_SENDER, c.addresses[b], str(PORT + a), str(seconds)])
        for a, b in flows
    ]
    for sender in senders:
        sender.wait(timeout=60)
    return [round(float(r.communicate(timeout=30)[0].strip()), 0) for r in receivers]


def run_job(
    c: cluster.Cluster,
    layout: str,
    engine: str,
    script: str,
    args: list[str],
    timeout: int,
    extra: dict[str, str] | None = None,
) -> dict[str, Any]:
    """One job on `layout` under `engine` (with `extra` in its environment); its rank 0's JSON rows,
    its wall time and bytes per host."""
    # Open MPI's own parameters set in this environment (OMPI_MCA_*) go to MPI jobs as well.
    env = ENV | {k: v for k, v in os.environ.items() if k.startswith("OMPI_MCA_")} | (extra or {})
    hosts, slots = parse_layout(layout)
    np_ = hosts * slots
    path = str(ROOT / "benchmarks" / script)
    if engine == "mpi":
        forwarded = [k for k in env if k.startswith(("TF_", "OMPI_MCA_"))]
        exports = [x for k in forwarded for x in ("-x", f"{k}={env[k]}")]
        line = [MPIRUN, "--prtemca", "plm_ssh_agent", AGENT, "--host", host_list(c, layout), "-np", str(np_)]
        line = c.command(0, [*line, "--mca", "btl", "tcp,self,sm", *exports, PYTHON, path, *args])
    else:
        line = [PYTHON, "-m", "tf_adasum.run", "-np", str(np_), "-H", host_list(c, layout), "--agent", AGENT]
        line += ["--timeout", str(timeout), path, *args]
    before = c.bytes_sent()
    start = time.perf_counter()
    try:
        done = subprocess.run(
            line,
            cwd=ROOT,
            env=os.environ | env,
            capture_output=True,
            text=True,
            timeout=timeout + 30,
            check=False,
        )
        stdout, stderr, rc = done.stdout, done.stderr, done.returncode
    except subprocess.TimeoutExpired as e:
        stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        stderr, rc = "timed out", 124
    finally:
        reap(c)
    seconds = time.perf_counter() - start
    after = c.bytes_sent()
    rows, other = [], []
    for text in stdout.splitlines():
        text = text.removeprefix("[0] ").strip()
        if text.startswith("{"):
            try:
                rows.append(json.loads(text))
                continue
            except json.JSONDecodeError:
                pass
        other.append(text)
    job_mb = [round((a - b) / 2**20, 1) for a, b in zip(after[:hosts], before[:hosts], strict=True)]
    return {
        "rows": rows,
        "rc": rc,
        "seconds": round(seconds, 1),
        "job_host_mb": job_mb,
        "stderr": stderr[-3000:],
        "stdout_tail": "\n".join(other[-30:]),  # the ranks' own output, for a job that failed
    }


def emit(out: Path, row: dict[str, Any]) -> None:
    print(json.dumps(row), flush=True)
    with (out / "results.jsonl").open("a") as f:
        f.write(json.dumps(row) + "\n")


def run_matrix(args: argparse.Namespace, out: Path) -> None:
    layouts = args.layouts
    size = max(parse_layout(layout)[0] for layout in layouts)
    started = time.perf_counter()
    with cluster.Cluster(hosts=max(size, 2), name=NAME, rate=None) as c:
        for rate in args.rates:
            shaped = None if rate == "none" else rate
            c.shape(shaped, delay=args.delay)
            link = {"rate": rate, "applied": dict(c.applied), "goodput_mbit": goodput(c)}
            for pattern in ("pairs", "ring"):
                link[f"goodput_{pattern}_mbit"] = goodput_together(c, size, pattern)
            emit(out, {"part": "link", **link})
            for layout in layouts:
                hosts, slots = parse_layout(layout)
                p = hosts * slots
                cell = {"rate": rate, "goodput_mbit": link["goodput_mbit"], "layout": layout}
                megabytes = [*(args.small_megabytes if p >= 4 else []), *args.megabytes]
                common = ["--megabytes", *map(str, megabytes), "--repeats", str(args.repeats)]
                common += ["--bytes-calls", str(args.bytes_calls)]
                common += ["--no-resnet"] if args.no_resnet else []
                jobs: list[tuple[str, str, str, list[str]]] = []
                if "allreduce" in args.parts:
                    jobs += [("allreduce", e, "collectives/cluster_worker.py", common) for e in args.engines]
                    # Each --against setting: a TF job of its own (its first's rides on the job above).
                    for setting in (args.against or [])[1:] if "tf" in args.engines else []:
                        against_args = [*common, "--against", setting]
                        jobs.append(("allreduce", "tf", "collectives/cluster_worker.py", against_args))
                if "exchange" in args.parts and "tf" in args.engines and p % 2 == 0:
                    exchange = ["--exchanges", "--megabytes", *map(str, args.megabytes)]
                    jobs.append(
                        (
                            "exchange",
                            "tf",
                            "collectives/cluster_worker.py",
                            [*exchange, "--repeats", str(args.repeats)],
                        )
                    )
                if "horovod" in args.parts and p & (p - 1) == 0:
                    jobs.append(("horovod", "mpi", "collectives/cluster_worker.py", [*common, "--horovod"]))
                if "fit" in args.parts:
                    fit = ["--processes", "--models", *args.fit_models, "--steps", str(args.fit_steps)]
                    fit += ["--rounds", str(args.fit_rounds)]
                    jobs.append(("fit", "tf", "training/bench_fit.py", fit))
                for part, loop in (("buckets", "tape"), ("fit-buckets", "fit")):
                    if part in args.parts:
                        bucketed = [
                            "--processes",
                            "--models",
                            *args.fit_models,
                            "--steps",
                            str(args.fit_steps),
                        ]
                        bucketed += [
                            "--buckets",
                            "0",
                            *map(str, args.bucket_megabytes),
                            "--bucket-loop",
                            loop,
                        ]
                        jobs.append((part, "tf", "training/bench_fit.py", bucketed))
                if (
                    "local" in args.parts
                    and slots == 1
                    and layout == next((lo for lo in layouts if parse_layout(lo)[1] == 1), None)
                ):
                    local = ["--devices-per-process", "2", "--megabytes", *map(str, args.megabytes)]
                    local += ["--repeats", str(args.repeats)]
                    for engine in args.engines:
                        jobs.append(
                            (
                                "local",
                                engine,
                                "collectives/bench_allreduce.py",
                                [*local, *(["--no-horovod"] if engine == "mpi" else [])],
                            )
                        )
                for part, engine, script, job_args in jobs:
                    # The link the TF engine's choice of algorithm weighs (vhdd.gather_is_faster), as a
                    # user of such a cluster would give it: the measured goodput.
                    extra = {"TF_ADASUM_LINK_GBITS": f"{link['goodput_mbit'] / 1000:.2f}"}
                    trace = None
                    if args.timeline and part == "allreduce":
                        trace = out / "timeline" / f"{rate}-{layout}-{engine}" / "trace.json"
                        shutil.rmtree(trace.parent, ignore_errors=True)
                        extra["TF_ADASUM_TIMELINE"] = str(trace)
                    ops_dir = None
                    first_tf = part == "allreduce" and engine == "tf" and "--against" not in job_args
                    if args.against and first_tf:
                        job_args = [*job_args, "--against", args.against[0]]
                    if args.ops_profile and first_tf:
                        ops_dir = out / "ops_profile" / f"{rate}-{layout}"
                        shutil.rmtree(ops_dir, ignore_errors=True)
                        job_args = [*job_args, "--ops-profile", str(ops_dir)]
                    result = run_job(c, layout, engine, script, job_args, args.timeout, extra)
                    if ops_dir is not None:
                        for profiled in op_profile.summary(sorted(ops_dir.glob("*.json"))):
                            case, kind, rank = Path(profiled.pop("path")).stem.rsplit("-", 2)
                            which = {"case": case, "kind": kind, "rank": int(rank.removeprefix("rank"))}
                            emit(out, {"part": "ops_profile", **cell, **which, **profiled})
                    if trace is not None:
                        events = [e for path in trace.parent.glob("*.json") for e in timeline.read(path)]
                        for profiled in timeline.profile(events):
                            emit(out, {"part": "profile", **cell, "job_engine": engine, **profiled})
                    meta = {"part": part, **cell, "job_engine": engine, "job_seconds": result["seconds"]}
                    meta["job_host_mb"] = result["job_host_mb"]
                    if result["rc"] != 0 or not result["rows"]:
                        failed = {"failed": result["rc"], "stderr": result["stderr"]}
                        emit(out, {**meta, **failed, "stdout_tail": result["stdout_tail"]})
                    for row in result["rows"]:
                        emit(out, {**meta, **row})
                    print(
                        f"# {part} {engine} {layout} {rate}: {result['seconds']} s, "
                        f"{time.perf_counter() - started:.0f} s in all",
                        file=sys.stderr,
                        flush=True,
                    )


def load(out: Path) -> list[dict[str, Any]]:
    path = out / "results.jsonl"
    return (
        [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    )


CASE_LABEL = {"resnet50_161_tensors": "ResNet-50 list"}


def case_label(case: str) -> str:
    return CASE_LABEL.get(case, case.removeprefix("single_").replace("MB", " MB"))


def _ratio(a: float, b: float | None) -> str:
    return f"{a / b:.2f}" if b else "-"


def tables(rows: list[dict[str, Any]]) -> str:
    """Markdown tables of the saved rows: all-reduce ms (ratios), bytes, fit and local sync."""
    lines: list[str] = []
    reduce = [r for r in rows if r.get("part") == "allreduce" and "adasum_ms" in r]
    hvd = {
        (r["rate"], r["layout"], r["case"]): r
        for r in rows
        if r.get("part") == "horovod" and "horovod_compiled_ms" in r
    }
    lines += [
        "| rate (goodput) | layout | case | MPI Adasum / sum ms (ratio) | MPI compiled (ratio) "
        "| Horovod eager / compiled ms | tf_adasum / Horovod: eager, compiled "
        "| TF Adasum / sum ms (ratio) | TF compiled (ratio) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    keys = sorted(
        {(r["rate"], r["layout"], r["case"]) for r in reduce},
        key=lambda k: ([r["rate"] for r in rows].index(k[0]), k[1], [r["case"] for r in reduce].index(k[2])),
    )
    for rate, layout, case in keys:
        mpi = next(
            (
                r
                for r in reduce
                if (r["rate"], r["layout"], r["case"], r["engine"]) == (rate, layout, case, "mpi")
            ),
            None,
        )
        tf = next(
            (
                r
                for r in reduce
                if (r["rate"], r["layout"], r["case"], r["engine"]) == (rate, layout, case, "tf")
            ),
            None,
        )
        h = hvd.get((rate, layout, case))
        goodput = (mpi or tf or {}).get("goodput_mbit")
        cells = [f"{rate} ({goodput:.0f} Mbit/s)" if goodput else rate, layout, case_label(case)]
        cells.append(f"{mpi['adasum_ms']} / {mpi['sum_ms']} ({mpi['ratio']})" if mpi else "")
        cells.append(f"{mpi['compiled_ms']} ({mpi['compiled_ratio']})" if mpi else "")
        cells.append(f"{h.get('horovod_ms', '-')} / {h['horovod_compiled_ms']}" if h else "")
        vs_horovod = ""
        if mpi and h:
            vs_horovod = f"{_ratio(mpi['adasum_ms'], h.get('horovod_ms'))}, "
            vs_horovod += _ratio(mpi["compiled_ms"], h["horovod_compiled_ms"])
        cells.append(vs_horovod)
        cells.append(f"{tf['adasum_ms']} / {tf['sum_ms']} ({tf['ratio']})" if tf else "")
        cells.append(f"{tf['compiled_ms']} ({tf['compiled_ratio']})" if tf else "")
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "| rate | layout | case | engine | Adasum MB per host per call | sum MB per host "
        "| Horovod MB per host | bound per rank | bound per host |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for rate, layout, case in keys:
        for r in reduce:
            if (r["rate"], r["layout"], r["case"]) == (rate, layout, case) and "adasum_host_mb" in r:
                h = hvd.get((rate, layout, case)) if r["engine"] == "mpi" else None
                hmb = ", ".join(map(str, h["horovod_host_mb"])) if h and "horovod_host_mb" in h else ""
                adasum_mb, sum_mb = (", ".join(map(str, r[k])) for k in ("adasum_host_mb", "sum_host_mb"))
                lines.append(
                    f"| {rate} | {layout} | {case_label(case)} | {r['engine']} | {adasum_mb} "
                    f"| {sum_mb} | {hmb} | {r['bound_mb']} | {r['host_bound_mb']} |"
                )
    used = [r for r in reduce if "adasum_busy_cores" in r]
    if used:
        lines += [
            "",
            "| rate | layout | case | engine | cores busy: Adasum eager, compiled, sum "
            "| the job's processes: Adasum eager, compiled, sum |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for r in used:
            busy = ", ".join(str(r[f"{k}_busy_cores"]) for k in ("adasum", "compiled", "sum"))
            job = ", ".join(str(r[f"{k}_job_cores"]) for k in ("adasum", "compiled", "sum"))
            lines.append(
                f"| {r['rate']} | {r['layout']} | {case_label(r['case'])} | {r['engine']} | {busy} | {job} |"
            )
    fit = [r for r in rows if r.get("part") == "fit" and "adasum_ms" in r]
    if fit:
        lines += [
            "",
            "| rate | layout | model | AdasumStrategy fit ms | AdasumStrategy loop ms "
            "| MultiWorkerMirroredStrategy loop ms | fit ratio | loop ratio |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in fit:
            lines.append(
                f"| {r['rate']} | {r['layout']} | {r['model']} | {r['adasum_ms']} "
                f"| {r.get('adasum_loop_ms', '')} | {r.get('baseline_ms', '')} | {r.get('ratio', '')} "
                f"| {r.get('loop_ratio', '')} |"
            )
    bucketed = [r for r in rows if r.get("part") in ("buckets", "fit-buckets") and "step_ms" in r]
    if bucketed:
        lines += [
            "",
            "| rate | layout | model | step | bucket MB (0: one call) | step ms | rounds ms | vs one call |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in bucketed:
            rounds = ", ".join(map(str, r["rounds_ms"]))
            step = "fit, deltas" if r["part"] == "fit-buckets" else "tape, gradients"
            lines.append(
                f"| {r['rate']} | {r['layout']} | {r['model']} | {step} | {r['bucket_mb']:g} "
                f"| {r['step_ms']} | {rounds} | {r['vs_first']} |"
            )
    local = [r for r in rows if r.get("part") == "local" and "mean_ms" in r]
    if local:
        lines += [
            "",
            "| rate | layout | case | engine | adasum ms | mean ms | sum ms | adasum / sum | mean / sum |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in local:
            lines.append(
                f"| {r['rate']} | {r['layout']}x2 devices | {case_label(r['case'])} | {r['engine']} "
                f"| {r['adasum_ms']} "
                f"| {r['mean_ms']} | {r['sum_ms']} | {r['ratio']} | {r['mean_ratio']} |"
            )
    failed = [r for r in rows if "failed" in r]
    for r in failed:
        lines.append(f"\nFAILED: {r['part']} {r['job_engine']} {r['layout']} {r['rate']} rc={r['failed']}")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Time against measured goodput, one panel per layout and case."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reduce = [r for r in rows if r.get("part") in ("allreduce", "horovod") and "case" in r]
    panels = sorted(
        {(r["layout"], r["case"]) for r in reduce if r["case"] != "single_1MB"},
        key=lambda k: (k[0], [r["case"] for r in reduce].index(k[1])),
    )
    if not panels:
        return
    layouts = sorted({p[0] for p in panels})
    cases = [c for c in dict.fromkeys(r["case"] for r in reduce) if c != "single_1MB"]
    fig, axes = plt.subplots(
        len(layouts), len(cases), figsize=(4.2 * len(cases), 3.4 * len(layouts)), squeeze=False
    )
    series = [
        ("mpi", "adasum_ms", "MPI Adasum", "C0", "-"),
        ("mpi", "sum_ms", "MPI sum", "C0", ":"),
        ("horovod", "horovod_ms", "Horovod Adasum (eager)", "C3", "-"),
        ("horovod", "horovod_compiled_ms", "Horovod Adasum (tf.function)", "C3", "--"),
        ("tf", "adasum_ms", "TF Adasum", "C2", "-"),
        ("tf", "compiled_ms", "TF Adasum (compiled)", "C2", "--"),
        ("tf", "sum_ms", "TF engine sum (MWMS)", "C2", ":"),
    ]
    for i, layout in enumerate(layouts):
        for j, case in enumerate(cases):
            ax = axes[i][j]
            for engine, key, label, color, style in series:
                points = sorted(
                    (r["goodput_mbit"] / 1000, r[key])
                    for r in reduce
                    if (r["layout"], r["case"], r.get("engine")) == (layout, case, engine) and key in r
                )
                if points:
                    ax.plot(*zip(*points, strict=True), style, color=color, marker="o", label=label)
            floor = sorted(
                (r["goodput_mbit"] / 1000, r["host_bound_mb"] * 2**20 * 8 / (r["goodput_mbit"] * 1e3))
                for r in reduce
                if (r["layout"], r["case"], r.get("engine")) == (layout, case, "mpi") and "host_bound_mb" in r
            )
            if floor:
                ax.plot(*zip(*floor, strict=True), "-", color="0.5", lw=0.8, label="the bound at the goodput")
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_title(f"{layout} (hosts x processes), {case_label(case)}", fontsize=9)
            ax.set_xlabel("measured link goodput, Gbit/s")
            ax.set_ylabel("ms per all-reduce")
            ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle("Adasum across namespace hosts, tbf-shaped links (no delay: no netem)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=72)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rates", nargs="+", default=["1gbit", "10gbit"], help='tc rates; "none": unshaped')
    parser.add_argument(
        "--layouts", nargs="+", default=["2x1", "4x1"], help="HOSTSxPROCESSES, e.g. 2x1 4x1 2x2"
    )
    parser.add_argument(
        "--parts", nargs="+", default=["allreduce", "horovod", "fit", "local"],
        choices=["allreduce", "exchange", "horovod", "fit", "buckets", "fit-buckets", "local"],
    )  # fmt: skip
    parser.add_argument("--engines", nargs="+", default=["mpi", "tf"], choices=["mpi", "tf"])
    parser.add_argument("--megabytes", type=int, nargs="*", default=[16, 64])
    parser.add_argument("--small-megabytes", type=int, nargs="*", default=[1], help="also, where P >= 4")
    parser.add_argument(
        "--no-resnet", action="store_true", help="all-reduce jobs: leave the ResNet-50 list out (slow links)"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bytes-calls", type=int, default=2)
    parser.add_argument("--fit-models", nargs="+", default=["mlp", "cnn"])
    parser.add_argument("--fit-steps", type=int, default=20)
    parser.add_argument("--fit-rounds", type=int, default=3, help="alternating rounds of the fit part")
    parser.add_argument(
        "--bucket-megabytes", type=float, nargs="+", default=[4, 16], help="buckets: against one call"
    )
    parser.add_argument(
        "--delay", default="100us", help="asked of tc; applied only where the kernel has netem"
    )
    parser.add_argument("--timeout", type=int, default=420, help="seconds per job")
    parser.add_argument(
        "--timeline",
        action="store_true",
        help="write each all-reduce job's Timeline (OUT/timeline/RATE-LAYOUT-ENGINE/) and add its profile "
        "(python -m tf_adasum.timeline profile) to the rows: where each rank's syncs spent their time. "
        "Timing with it on adds the writing; time without it",
    )
    parser.add_argument(
        "--ops-profile",
        action="store_true",
        help="TF engine's all-reduce jobs: also one call of each kind under TensorFlow's profiler, each "
        'rank\'s ops in OUT/ops_profile/RATE-LAYOUT/, and their summary as "ops_profile" rows: each '
        "collective in order, and the time between them (benchmarks/collectives/op_profile.py)",
    )
    parser.add_argument(
        "--against",
        nargs="+",
        metavar="MODULE.NAME=VALUE",
        help="TF engine's all-reduce jobs: also the compiled call traced with tf_adasum.MODULE.NAME set to "
        "VALUE, alternating with the compiled call in the same job (cluster_worker.py --against); each "
        "further setting in a TF job of its own",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "collectives" / "cluster_output")
    parser.add_argument(
        "--append", action="store_true", help="add to OUT/results.jsonl instead of starting it anew"
    )
    parser.add_argument(
        "--plot-only", action="store_true", help="only the table and plot from OUT/results.jsonl"
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.plot_only:
        reason = cluster.available()
        if reason:
            raise SystemExit(f"bench_cluster.py: no cluster here: {reason}")
        if not args.append:
            (args.out / "results.jsonl").unlink(missing_ok=True)
        run_matrix(args, args.out)
    rows = load(args.out)
    (args.out / "table.md").write_text(tables(rows))
    plot(rows, args.out / "time_vs_rate.png")
    print(f"# {args.out / 'table.md'}, {args.out / 'time_vs_rate.png'}", file=sys.stderr)


if __name__ == "__main__":
    main()
