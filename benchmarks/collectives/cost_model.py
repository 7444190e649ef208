"""A latency-bandwidth (alpha-beta) cost model of Adasum and the sum, fitted to the cluster's measured rows,
checked on rows it was not fitted on, and run out to 1,024 hosts.

Usage:
    python benchmarks/collectives/cost_model.py [--rows FILE ...] [--held-out 10gbit]
        [--out benchmarks/collectives/cost_model_output]

The model, per engine (MPI, the TF engine) and per operation (Adasum by VHDD; the engine's own sum, a
ring), for N bytes over P ranks on links of goodput B:

    T = alpha * rounds(P) + wire(P, N, B) / efficiency + gamma * N

- wire = the bytes each host must send at the link's goodput: 2 N (H - 1) / H for both over H hosts
  (VHDD sends what a ring sends), whatever the ranks per host;
- rounds: the messages one after another. VHDD: the agreement (one gather, P - 1 steps on the TF
  engine's ring, log2 P on MPI's point-to-point), the fold (2 when P is not a power of two),
  log2 P halving and log2 P gathering levels, and at halving level k a block sum over 2^k ranks
  (k steps): 2 log2 P + log2 P (log2 P + 1) / 2 in all. The ring sum: 2 (P - 1);
- gamma * N: the arithmetic and the copies (Adasum: dot products, norms and the combine; the sum: the
  additions), on these CPUs. On the cluster every host shares one machine's CORES cores, so the rows'
  compute is taken as gamma * N * max(1, P / CORES); the predictions give each host its own cores.

alpha, efficiency and gamma are fitted (non-negative least squares, on the time divided by the
time the wire alone would take, so that every row weighs alike) to the rows of
benchmarks/collectives/bench_cluster.py (OUT/results.jsonl: rate, layout, engine, bytes, Adasum and sum
ms), leaving out --held-out (a rate, or "round2") to check the fit on. Rows where Open MPI's own
Allreduce stalls (2 processes per host, the 2x2 layout) are left out of the sum's fit, as
benchmarks/README.md says.

The predictions, for H = 8 ... 1,024 hosts at 10, 25 and 100 Gbit/s, for the ResNet-50 list (97.5 MB),
in three layouts: one device per host; 8 per host, each its own rank (flat: P = 8 H ranks in every
round); and 8 per host in one process that combines its devices first (hierarchical: the agreement
and the VHDD levels are the H processes'; the devices' own tree is not counted). Each engine's Adasum
is set against the TF engine's sum, a ring over all P ranks (MultiWorkerMirroredStrategy's; Open MPI's
Allreduce stalls on these hosts, so the MPI sum's fit is shown with its error and not run out). Every
figure is printed as a JSON line, with a table (OUT/predictions.md) and a plot (OUT/adasum_over_sum.png).
The alpha fitted here is software's: TensorFlow's collectives over gRPC on CPUs (no delay could be
applied to these links: benchmarks/README.md). It is the floor of a real network's per-message cost,
but far above NCCL's between GPUs, so the sum's ring at scale is pessimistic.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
from scipy.optimize import nnls

ROOT = Path(__file__).resolve().parent
ROWS = [
    ROOT / "cluster_output" / "results.jsonl",
    ROOT / "cluster_output" / "round2" / "results.jsonl",
    ROOT / "cluster_output" / "round3" / "results.jsonl",
]
RESNET50_MB = 97.49
RATES_GBIT = (10, 25, 100)
HOSTS = (8, 16, 32, 64, 128, 256, 512, 1024)
PER_HOST = 8
# (devices per host, hierarchical): one device per host; 8 per host, each its own rank (flat); 8 per
# host in one process that combines them first (hierarchical).
LAYOUTS = ((1, False), (PER_HOST, False), (PER_HOST, True))


def layout_name(per_host: int, hierarchical: bool) -> str:
    if per_host == 1:
        return "1 per host"
    return f"{per_host} per host, {'hierarchical' if hierarchical else 'flat'}"


CORES = 2  # the cluster's hosts are network namespaces of one machine: they share its cores


def log2(p: int) -> float:
    return math.log2(p) if p > 1 else 0.0


def vhdd_rounds(p: int, engine: str, local: int = 1) -> float:
    """The messages one after another in one VHDD Adasum over p ranks (see the module's doc). With
    `local` > 1, the hierarchical layout: one process per host holds its `local` devices and combines
    them itself, so the agreement and the VHDD levels are the p // local processes'."""
    ranks = max(1, p // local)
    levels = log2(1 << int(log2(ranks)))  # the power of two after the fold
    fold = 2 if ranks & (ranks - 1) else 0
    agreement = (ranks - 1) if engine == "tf" else log2(ranks)
    return agreement + fold + 2 * levels + levels * (levels + 1) / 2


def ring_rounds(p: int) -> float:
    """The sum's ring over all p ranks (MultiWorkerMirroredStrategy's, or NCCL's across every device)."""
    return 2 * (p - 1)


def wire_ms(megabytes: float, hosts: int, gbit: float) -> float:
    """What sending the bound's bytes per host, 2 N (H - 1) / H, takes at `gbit` Gbit/s: the same for
    one rank per host, for every device a rank (flat) and for one process per host (hierarchical)."""
    mb = 2 * megabytes * (hosts - 1) / hosts
    return mb * 8 * 1.048576 / gbit  # MiB, as the benchmark's megabytes are, at 1e9 bit/s


def load(paths: Iterable[Path]) -> list[dict[str, Any]]:
    rows = []
    for index, path in enumerate(paths):
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            row = json.loads(line)
            if row.get("part") == "allreduce" and row.get("goodput_mbit"):
                row["round"] = f"round{index + 1}"
                rows.append(row)
    return rows


def features(row: dict[str, Any], op: str) -> tuple[np.ndarray, float]:
    """(alpha's, the wire's and gamma's coefficients, each over the wire time; the time over it)."""
    p, engine, megabytes = row["ranks"], row["engine"], row["megabytes"]
    gbit = row["goodput_mbit"] / 1000
    wire = wire_ms(megabytes, row["hosts"] if "hosts" in row else p, gbit)
    rounds = vhdd_rounds(p, engine) if op == "adasum" else ring_rounds(p)
    measured = row["adasum_ms"] if op == "adasum" else row["sum_ms"]
    contention = max(1.0, p / CORES)
    return np.array([rounds / wire, 1.0, megabytes * contention / wire]), measured / wire


def usable(row: dict[str, Any], op: str) -> bool:
    stalled = op == "sum" and row["engine"] == "mpi" and row["layout"] == "2x2"
    return not stalled and row["megabytes"] >= 1


def fit(rows: list[dict[str, Any]], engine: str, op: str) -> dict[str, float]:
    chosen = [r for r in rows if r["engine"] == engine and usable(r, op)]
    if len(chosen) < 3:
        raise ValueError(f"{engine} {op}: {len(chosen)} rows, too few to fit 3 parameters")
    a, b = zip(*(features(r, op) for r in chosen), strict=True)
    (alpha, inverse_efficiency, gamma), _ = nnls(np.array(a), np.array(b))
    return {
        "alpha_ms": alpha,
        "efficiency": 1 / inverse_efficiency if inverse_efficiency else math.inf,
        "gamma_ms_per_mb": gamma,
    }


def predict(
    model: dict[str, float],
    op: str,
    engine: str,
    hosts: int,
    megabytes: float,
    gbit: float,
    per_host: int = 1,
    hierarchical: bool = False,
) -> float:
    p = hosts * per_host
    if op == "adasum":
        rounds = vhdd_rounds(p, engine, per_host if hierarchical else 1)
    else:
        rounds = ring_rounds(p)
    wire = wire_ms(megabytes, hosts, gbit)
    return model["alpha_ms"] * rounds + wire / model["efficiency"] + model["gamma_ms_per_mb"] * megabytes


def errors(
    rows: list[dict[str, Any]], models: dict[tuple[str, str], dict[str, float]]
) -> list[dict[str, Any]]:
    out = []
    for row in rows:
        for op in ("adasum", "sum"):
            key = (row["engine"], op)
            if key not in models or not usable(row, op):
                continue
            measured = row["adasum_ms"] if op == "adasum" else row["sum_ms"]
            predicted = predict(
                models[key], op, row["engine"], row["hosts"], row["megabytes"], row["goodput_mbit"] / 1000,
                row["ranks"] // row["hosts"],
            )  # fmt: skip
            out.append(
                {
                    "engine": row["engine"], "op": op, "rate": row["rate"], "layout": row["layout"],
                    "case": row["case"], "round": row["round"], "measured_ms": measured,
                    "predicted_ms": round(predicted, 2), "error": round(predicted / measured - 1, 3),
                }
            )  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", nargs="*", type=Path, default=ROWS)
    parser.add_argument("--held-out", default="10gbit", help="a rate (1gbit, 10gbit, none) or round1/round2")
    parser.add_argument("--out", type=Path, default=ROOT / "cost_model_output")
    args = parser.parse_args()
    rows = load(args.rows)
    held = [r for r in rows if args.held_out in (r["rate"], r["round"])]
    fitted_on = [r for r in rows if r not in held]
    models = {(e, op): fit(fitted_on, e, op) for e in ("mpi", "tf") for op in ("adasum", "sum")}
    for (engine, op), model in models.items():
        print(
            json.dumps(
                {
                    "fit": f"{engine} {op}",
                    "rows": len(fitted_on),
                    **{k: round(v, 4) for k, v in model.items()},
                }
            )
        )
    report = {"fitted": errors(fitted_on, models), "held_out": errors(held, models)}
    for name, found in report.items():
        for engine in ("mpi", "tf"):
            for op in ("adasum", "sum"):
                errs = [abs(e["error"]) for e in found if e["engine"] == engine and e["op"] == op]
                if errs:
                    print(json.dumps({"rows": name, "engine": engine, "op": op, "count": len(errs),
                                      "median_abs_error": round(float(np.median(errs)), 3),
                                      "max_abs_error": round(max(errs), 3)}))  # fmt: skip
    predictions = []
    for engine in ("mpi", "tf"):
        for gbit in RATES_GBIT:
            for hosts in HOSTS:
                for per_host, hierarchical in LAYOUTS:
                    adasum = predict(
                        models[(engine, "adasum")], "adasum", engine, hosts, RESNET50_MB, gbit, per_host,
                        hierarchical,
                    )  # fmt: skip
                    # Against the sum TensorFlow's users have, MultiWorkerMirroredStrategy's ring (the
                    # TF engine's fit): Open MPI's own Allreduce stalls on these hosts (a 96 ms floor at
                    # 1 MB on 4 hosts), so the MPI sum's fit is reported, not used at scale.
                    total = predict(models[("tf", "sum")], "sum", "tf", hosts, RESNET50_MB, gbit, per_host)
                    row = {
                        "engine": engine, "gbit": gbit, "hosts": hosts,
                        "layout": layout_name(per_host, hierarchical), "ranks": hosts * per_host,
                        "wire_ms": round(wire_ms(RESNET50_MB, hosts, gbit), 2),
                        "adasum_ms": round(adasum, 2), "sum_ms": round(total, 2),
                        "adasum_over_sum": round(adasum / total, 3),
                    }  # fmt: skip
                    predictions.append(row)
                    print(json.dumps(row))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "errors.json").write_text(json.dumps(report, indent=1))
    (args.out / "predictions.md").write_text(table(predictions, models, report))
    plot(predictions, args.out / "adasum_over_sum.png")


def table(
    predictions: list[dict[str, Any]], models: dict[tuple[str, str], dict[str, float]], report: dict[str, Any]
) -> str:
    lines = ["| engine | op | alpha ms | efficiency | gamma ms/MB |", "| --- | --- | --- | --- | --- |"]
    for (engine, op), m in models.items():
        lines.append(
            f"| {engine} | {op} | {m['alpha_ms']:.3f} | {m['efficiency']:.2f} | {m['gamma_ms_per_mb']:.2f} |"
        )
    lines += [
        "",
        "| engine | Gbit/s | hosts | layout | wire ms | Adasum ms | sum ms | Adasum / sum |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in predictions:
        if r["hosts"] in (8, 64, 256, 1024):
            lines.append(
                f"| {r['engine']} | {r['gbit']} | {r['hosts']} | {r['layout']} | {r['wire_ms']} | "
                f"{r['adasum_ms']} | {r['sum_ms']} | {r['adasum_over_sum']} |"
            )
    return "\n".join(lines) + "\n"


def plot(predictions: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, engine in zip(axes, ("mpi", "tf"), strict=True):
        for gbit in RATES_GBIT:
            for (per_host, hierarchical), style in zip(LAYOUTS, ("-", "--", ":"), strict=True):
                name = layout_name(per_host, hierarchical)
                chosen = [
                    r
                    for r in predictions
                    if r["engine"] == engine and r["gbit"] == gbit and r["layout"] == name
                ]
                ax.plot([r["hosts"] for r in chosen], [r["adasum_over_sum"] for r in chosen], style,
                        label=f"{gbit} Gbit/s, {name}")  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.axhline(1.0, color="grey", linewidth=0.5)
        ax.set_title(f"{engine.upper()} engine: Adasum / sum, ResNet-50 list")
        ax.set_xlabel("hosts")
    axes[0].set_ylabel("predicted time ratio")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
