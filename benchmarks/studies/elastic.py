"""Elastic training (issue 31): does Adasum at the one-worker learning rate ride out 8 -> 6 -> 8, and what
do a membership change and a commit cost?

Each run is a real elastic job: `python -m tf_adasum.run --elastic -np N --min-np N-2 --max-np N
--host-discovery-script "cat FILE"` on benchmarks/studies/elastic_worker.py (Horovod's elastic Keras recipe:
`import tf_adasum.keras as hvd`, hvd.DistributedOptimizer, elastic.KerasState, @elastic.run, the three
elastic callbacks, a plain model.fit per process on its own share). The model and data are
convergence.py's (the LeNet-like CNN, the augmented 16x16 digits, 32 examples per worker per step,
momentum SGD 0.9); the learning rate is constant, the one-worker rate 0.01 (convergence.py's PEAK).
Same seed for every run. While 6 workers run, the global batch is 6 * 32. --model transformer: the LAMB
study's Transformer encoder on its pointer task instead (convergence.py --model transformer), with
Keras's LAMB at its one-replica rate 0.004.

Runs, at N = 8:
    adasum_failures    op=Adasum; group 0's ranks 6 and 7 SIGKILL themselves at --kill-step (they write
                       `127.0.0.1:6` into the discovery file first); at --grow-step rank 0 writes
                       `127.0.0.1:8` back, the launcher posts a notice, every rank leaves at the next
                       commit, and the next group has 8 again
    adasum_steady      op=Adasum, no failures
    average_failures   op=Average (the gradient mean), the same fixed learning rate, the same failures
    average_scaled     op=Average with Horovod's rule: lr = 0.01 * hvd.size(), set at the start and in a
                       reset callback (state.register_reset_callbacks), the same failures
    average_steady     op=Average, fixed rate, no failures
and commit_cost: one run without failures (op=Adasum, N = 8), one fit in phases of --phase-steps steps:
no commits (the baseline), then a commit every 1, 10 and 100 batches (state.commit() after the batch, as
CommitStateCallback(batches_per_commit=k) makes them), then no commits again (the baseline's second
half); every commit is timed on its own with time.perf_counter, and so is the ranks' meeting inside it
(check_host_updates).

Recovery: from the kill (the dying worker's time.time()) or the discovery file's change (rank 0's) to
the first completed step of the next group (the slowest rank's), in parts: the survivors' detection
(their "leaves for the next group" line), their exit, the launcher's start of the next group, Python +
TensorFlow's import, the collective engine's start, data + model, the state's sync, the first step
(tracing included), and the first step's processor time, per process and summed over the machine's
cores (where the latter is near the first step's wall time, the cores bound it). Times are stamped by
the workers (@ev lines) and, for the launcher's and tf_adasum.elastic's lines, on arrival here. Every
wait is bounded: --timeout goes to the launcher, and this script kills the job's process group 60 s
after that.

Usage:
    python benchmarks/studies/elastic.py          # the five runs and the commit cost, ~12 min here
    python benchmarks/studies/elastic.py --smoke  # N = 3 -> 2 -> 3: adasum_failures, the commit cost, ~2 min
    python benchmarks/studies/elastic.py --runs average_failures --skip-commit-cost   # one run again
    python benchmarks/studies/elastic.py --model transformer --runs adasum_failures --skip-commit-cost \
        --steps 1000
    python benchmarks/studies/elastic.py --report # run nothing: the tables and plot from OUT's event files

Writes OUT/<run>_events.jsonl (the workers' @ev lines, the launcher's lines the recovery times need,
the job's exit code, wall time and parameters), and from those files (the runs of --runs, the commit
cost): OUT/<run>.csv (the validation curve: step, accuracy, loss, workers, group, ...),
OUT/summary.csv, OUT/recovery.csv, OUT/commit_cost.csv, OUT/summary.txt (the printed tables) and
OUT/accuracy_vs_step.png. A run left out or made with other parameters is named under the tables.
The jobs' full output is in a temporary folder, kept when something failed.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "benchmarks" / "studies" / "elastic_worker.py"
ONE_WORKER_LR = 0.01  # convergence.py's PEAK["sgd"], tuned for one worker
LAMB_LR = 0.004  # convergence.py's PEAK["lamb"], for --model transformer

RUNS: dict[str, dict[str, Any]] = {
    "adasum_failures": {"op": "adasum", "lr_rule": "fixed", "failures": True},
    "adasum_steady": {"op": "adasum", "lr_rule": "fixed", "failures": False},
    "average_failures": {"op": "average", "lr_rule": "fixed", "failures": True},
    "average_scaled": {"op": "average", "lr_rule": "size", "failures": True},
    "average_steady": {"op": "average", "lr_rule": "fixed", "failures": False},
}
BASELINE = "adasum_steady"

LEAVE = re.compile(r"^\[(\d+)\] tf_adasum\.elastic: rank (\d+) of group (\d+) leaves for the next group")
GROUP_START = re.compile(r"^tf_adasum\.run: group (\d+): (\d+) process")
GROUP_END = re.compile(r"^tf_adasum\.run: group (\d+) ended")
NOTICE = re.compile(r"^tf_adasum\.run: group (\d+): more slots reported")


def launch(
    args: argparse.Namespace, name: str, worker_args: list[str], work: Path, slots: int
) -> tuple[int, list[dict[str, Any]], list[tuple[float, str, str]], float]:
    """Runs one elastic job; returns its exit code, its @ev events, every line stamped on arrival
    (time, "out"/"err", line), and its wall time."""
    discovery = work / f"{name}.discovery"
    discovery.write_text(f"127.0.0.1:{slots}\n")
    state_dir = work / f"{name}.state"
    command = [
        sys.executable, "-m", "tf_adasum.run", "--elastic",
        "-np", str(args.np), "--min-np", str(args.np - args.kill), "--max-np", str(args.np),
        "--host-discovery-script", f"cat {discovery}",
        "--host-discovery-interval", str(args.discovery_interval),
        "--reset-limit", "4", "--state-dir", str(state_dir), "--timeout", str(args.job_timeout),
        str(WORKER), *worker_args, "--discovery-file", str(discovery),
    ]  # fmt: skip
    env = dict(os.environ, TF_ADASUM_TIMEOUT_SECONDS=str(args.peer_timeout), TF_CPP_MIN_LOG_LEVEL="3")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    lines: list[tuple[float, str, str]] = []
    lock = threading.Lock()
    log = open(work / f"{name}.log", "w")

    def read(stream: Any, kind: str) -> None:
        for raw in iter(stream.readline, b""):
            stamp, line = time.time(), raw.decode(errors="replace").rstrip("\n")
            with lock:
                lines.append((stamp, kind, line))
                log.write(f"{stamp:.3f} {kind} {line}\n")

    started = time.time()
    proc = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )
    readers = [
        threading.Thread(target=read, args=(proc.stdout, "out"), daemon=True),
        threading.Thread(target=read, args=(proc.stderr, "err"), daemon=True),
    ]
    for reader in readers:
        reader.start()
    try:
        code = proc.wait(timeout=args.job_timeout + 60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        code = proc.wait(timeout=30)
        print(f"  {name}: killed after {args.job_timeout + 60:.0f} s", flush=True)
    for reader in readers:
        reader.join(timeout=10)
    wall = time.time() - started
    log.close()
    events = []
    for _, kind, line in lines:
        if kind == "out" and "] @ev " in line:
            events.append(json.loads(line.split("] @ev ", 1)[1]))
    if code != 0:
        tail = "\n".join(f"    {line}" for _, _, line in lines[-25:])
        print(f"  {name}: the job exited with {code}; its last lines:\n{tail}", flush=True)
    return code, events, lines, wall


def train_args(args: argparse.Namespace, spec: dict[str, Any]) -> list[str]:
    out = [
        "train", "--data", str(args.data), "--train-examples", str(args.train_examples),
        "--op", spec["op"], "--lr", str(args.lr), "--lr-rule", spec["lr_rule"],
        "--steps", str(args.steps), "--eval-every", str(args.eval_every),
        "--batches-per-commit", str(args.batches_per_commit), "--seed", str(args.seed), "--np", str(args.np),
        "--model", args.model,
    ]  # fmt: skip
    if spec["failures"]:
        ranks = [str(r) for r in range(args.np - args.kill, args.np)]
        out += [
            "--kill-step",
            str(args.kill_step),
            "--kill-ranks",
            *ranks,
            "--grow-step",
            str(args.grow_step),
        ]
    return out


def groups_of(events: list[dict[str, Any]], lines: list[tuple[float, str, str]]) -> dict[int, dict[str, Any]]:
    """Per group: its size, the step it resumed at, and the times of its milestones."""
    groups: dict[int, dict[str, Any]] = {}

    def group(g: int) -> dict[str, Any]:
        return groups.setdefault(g, {"group": g, "ready": [], "synced": [], "first_step": [], "leave": []})

    for e in events:
        g = group(e["group"])
        if e["ev"] == "ready":
            g["size"] = e["size"]
            g["ready"].append(e)
        elif e["ev"] == "synced":
            g["synced"].append(e["t"])
            g["resumed_at"] = e["step"]
            g.setdefault("cpu_synced", {})[e["rank"]] = e.get("cpu")
        elif e["ev"] == "first_step":
            g["first_step"].append(e["t"])
            g.setdefault("cpu_first_step", {})[e["rank"]] = e.get("cpu")
    for stamp, kind, line in lines:
        if kind == "out" and (m := LEAVE.match(line)):
            group(int(m.group(3)))["leave"].append(stamp)
        elif kind == "err" and (m := GROUP_START.match(line)):
            group(int(m.group(1)))["launched"] = stamp
        elif kind == "err" and (m := GROUP_END.match(line)):
            group(int(m.group(1)))["ended"] = stamp
        elif kind == "err" and (m := NOTICE.match(line)):
            group(int(m.group(1)))["notice"] = stamp
    return groups


def start_parts(g: dict[str, Any]) -> dict[str, float]:
    """A group's start, from the launcher's line to its first step, by the slowest rank at each stage."""
    ready = g["ready"]
    tensorflow = max(e["tensorflow"] for e in ready)
    engine = max(e["engine"] for e in ready)
    made = max(e["t"] for e in ready)
    synced = max(g["synced"])
    first = max(g["first_step"])
    return {
        "python_and_tensorflow_import": tensorflow - g["launched"],
        "engine_start": engine - tensorflow,
        "data_model_state": made - engine,
        "sync": synced - made,
        "first_step": first - synced,
    }


def cores() -> int:
    """The cores this benchmark's processes may run on (its affinity, which a container or taskset may
    set below the machine's count)."""
    return len(os.sched_getaffinity(0))


def first_step_cpu(g: dict[str, Any]) -> dict[str, float]:
    """The processor time of the first step, each process's (mean), and all of theirs over the cores they
    may use: how long the first step would take if nothing but the cores bound it."""
    before, after = g.get("cpu_synced", {}), g.get("cpu_first_step", {})
    spent = [after[r] - before[r] for r in after if r in before and None not in (after[r], before[r])]
    if not spent:  # events from before the worker reported processor time
        return {}
    return {
        "first_step_cpu_per_process": sum(spent) / len(spent),
        "first_step_cpu_over_cores": sum(spent) / cores(),
    }


def recovery(events: list[dict[str, Any]], groups: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """The membership changes: the shrink (from the kill) and the growth (from the discovery file)."""
    rows = []
    cold = groups[0]
    cold_total = max(cold["first_step"]) - cold["launched"]
    kills = [e for e in events if e["ev"] == "kill"]
    grows = [e for e in events if e["ev"] == "grow"]
    for trigger, g in ((kills, 1), (grows, 2)):
        if not trigger or g not in groups or (g - 1) not in groups or not groups[g]["first_step"]:
            continue
        before, after = groups[g - 1], groups[g]
        t0 = min(e["t"] for e in trigger)
        parts: dict[str, float] = {}
        if trigger is kills:
            parts["detection_by_survivors"] = min(before["leave"]) - t0
        else:
            parts["launcher_notice"] = before["notice"] - t0
            parts["leave_at_next_commit"] = min(before["leave"]) - before["notice"]
        parts["survivors_exit"] = before["ended"] - min(before["leave"])
        parts["launcher_starts_group"] = after["launched"] - before["ended"]
        parts.update(start_parts(after))
        total = max(after["first_step"]) - t0
        rows.append(
            {
                "change": f"{before['size']} -> {after['size']}",
                "trigger_step": trigger[0]["step"],
                "resumed_at": after["resumed_at"],
                "steps_redone": max(0, trigger[0]["step"] - after["resumed_at"]) if trigger is kills else 0,
                "total_s": total,
                # The time no step ran: from the kill, or from the first rank's leaving at the commit
                # after a growth notice (the group trains while the launcher readies warm processes).
                "stall_s": total if trigger is kills else max(after["first_step"]) - min(before["leave"]),
                "cold_start_s": cold_total,
                "ratio_to_cold_start": total / cold_total,
                **{f"{k}_s": v for k, v in parts.items()},
                **{f"{k}_s": v for k, v in first_step_cpu(after).items()},
            }
        )
    return rows


def curve(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The validation curve: the last evaluation at each step (steps redone after a loss evaluate again)."""
    by_step: dict[int, dict[str, Any]] = {}
    for e in events:
        if e["ev"] == "eval":
            by_step[e["step"]] = {
                "step": e["step"],
                "accuracy": round(e["accuracy"], 4),
                "loss": round(e["loss"], 4),
                "workers": e["size"],
                "group": e["group"],
                "lr": e["lr"],
                "examples_seen": e["seen"],
                "step_ms": round(e["step_ms"], 1) if e["step_ms"] is not None else "",
            }
    return [by_step[s] for s in sorted(by_step)]


def membership(groups: dict[int, dict[str, Any]], steps: int) -> str:
    spans = []
    ordered = [groups[g] for g in sorted(groups) if "size" in groups[g]]
    for i, g in enumerate(ordered):
        end = ordered[i + 1]["resumed_at"] if i + 1 < len(ordered) else steps
        if g.get("resumed_at", 0) < end or i == 0:
            spans.append(f"{g['size']} ({g.get('resumed_at', 0)}-{end})")
    return " -> ".join(spans)


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    with open(path, "w", newline="") as f:
        fields: list[str] = []
        for row in rows:
            fields += [k for k in row if k not in fields]
        writer = csv.DictWriter(f, fields)
        writer.writeheader()
        writer.writerows(rows)


def fmt(value: Any, digits: int = 3) -> str:
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def results_table(summary: list[dict[str, Any]]) -> str:
    base = next((r for r in summary if r["run"] == BASELINE), None)
    head = (
        f"{'run':<17} {'op':<8} {'lr':<12} {'membership (steps)':<41} {'acc':>6} {'last3':>6} "
        f"{'vs base':>8} {'loss':>6} {'examples':>9} {'wall s':>7}"
    )
    lines = [head]
    for r in summary:
        versus = f"{100 * (r['final_accuracy'] - base['final_accuracy']):+.1f} pt" if base else "-"
        lines.append(
            f"{r['run']:<17} {r['op']:<8} {r['lr']:<12} {r['membership']:<41} {r['final_accuracy']:>6.3f} "
            f"{r['last3_accuracy']:>6.3f} {versus:>8} {r['final_loss']:>6.3f} {r['examples_seen']:>9} "
            f"{r['wall_s']:>7.0f}"
        )
    if base:
        lines.append(f"(vs base: final accuracy minus {BASELINE}'s, measured in this benchmark)")
    return "\n".join(lines)


def recovery_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "(no membership change measured)"
    cpu = ("first_step_cpu_per_process_s", "first_step_cpu_over_cores_s")
    skip = ("total_s", "stall_s", "cold_start_s", *cpu)
    lines = [
        f"{'run':<17} {'change':<7} {'at':>5} {'resumed':>7} {'redone':>6} {'total s':>7} {'stall s':>7} "
        f"{'x cold':>6}  parts (s)"
    ]
    for r in rows:
        detail = ", ".join(f"{k[:-2]} {v:.1f}" for k, v in r.items() if k.endswith("_s") and k not in skip)
        if cpu[0] in r:
            detail += (
                f"; the first step's processor time: {r[cpu[0]]:.2f} per process, "
                f"{r[cpu[1]]:.1f} over the {cores()} cores"
            )
        lines.append(
            f"{r['run']:<17} {r['change']:<7} {r['trigger_step']:>5} {r['resumed_at']:>7} "
            f"{r['steps_redone']:>6} "
            f"{r['total_s']:>7.1f} {r['stall_s']:>7.1f} {r['ratio_to_cold_start']:>6.2f}  {detail}"
        )
    lines.append(
        "(x cold: the total against the job's own first start, launcher line to first step, same run; "
        "stall: the time no step ran, from the kill or from the leave at the commit after a growth notice)"
    )
    return "\n".join(lines)


def commit_table(rows: list[dict[str, Any]], n: int) -> str:
    lines = [
        f"commit cost at N = {n} (op=Adasum), rank 0; baseline: the two phases without commits (first and "
        "last) of the same fit",
        f"{'batches_per_commit':>18} {'step ms':>8} {'commit ms':>10} {'(meeting)':>9} {'commits':>7} "
        f"{'overhead %/step':>15} {'ms/step wall':>12} {'x baseline':>10}",
    ]
    plain = [r for r in rows if r["batches_per_commit"] == 0]
    base = {key: statistics.mean(r[key] for r in plain) for key in ("step_ms", "per_step_ms")}
    for r in rows:
        k = r["batches_per_commit"]
        overhead = 100 * r["commit_ms"] / (k * base["step_ms"]) if k else 0.0
        lines.append(
            f"{k or 'none':>18} {r['step_ms']:>8.1f} {r['commit_ms']:>10.1f} {r['meeting_ms']:>9.1f} "
            f"{r['commits']:>7} "
            f"{overhead:>15.1f} {r['per_step_ms']:>12.1f} {r['per_step_ms'] / base['per_step_ms']:>10.2f}"
        )
    lines.append(
        "(overhead %/step: commit ms / (batches_per_commit * the baseline's step ms), the baseline's being "
        "the mean of the two phases without commits; meeting: the part of "
        "the commit in check_host_updates, where the ranks meet on rank 0's notice (one collective), the "
        "rest is the copy to host memory; ms/step wall: the phase's wall time / its steps, commits included)"
    )
    return "\n".join(lines)


def plot(runs: dict[str, dict[str, Any]], args: argparse.Namespace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {
        "adasum_failures": "tab:blue",
        "adasum_steady": "tab:cyan",
        "average_failures": "tab:red",
        "average_scaled": "tab:orange",
        "average_steady": "tab:pink",
    }
    figure, (acc, loss, size) = plt.subplots(
        3, 1, figsize=(8.5, 9), sharex=True, gridspec_kw={"height_ratios": [3, 2, 1.2]}
    )
    for name, run in runs.items():
        style = "-" if RUNS[name]["failures"] else "--"
        steps = [r["step"] for r in run["curve"]]
        acc.plot(
            steps, [r["accuracy"] for r in run["curve"]], style, color=colors[name], label=name, marker="."
        )
        loss.plot(steps, [r["loss"] for r in run["curve"]], style, color=colors[name], marker=".")
        ordered = [run["groups"][g] for g in sorted(run["groups"]) if "size" in run["groups"][g]]
        xs, ys = [], []
        for i, g in enumerate(ordered):
            end = ordered[i + 1]["resumed_at"] if i + 1 < len(ordered) else args.steps
            xs += [g.get("resumed_at", 0), end]
            ys += [g["size"], g["size"]]
        offset = 0.06 * (list(RUNS).index(name) - 2)  # the runs' lines side by side, not on top
        size.plot(xs, [v + offset for v in ys], style, color=colors[name], label=name)
    marked = next(
        (runs[n] for n in ("adasum_failures", "average_failures", "average_scaled") if n in runs), None
    )
    if marked is not None:
        ordered = [marked["groups"][g] for g in sorted(marked["groups"]) if "size" in marked["groups"][g]]
        small = [(g, ordered[i + 1]["resumed_at"] if i + 1 < len(ordered) else args.steps)
                 for i, g in enumerate(ordered) if g["size"] < args.np]  # fmt: skip
        for panel in (acc, loss, size):
            panel.axvline(args.kill_step, color="grey", linestyle=":", linewidth=1)
            panel.axvline(args.grow_step, color="grey", linestyle="--", linewidth=1)
            for g, end in small:
                panel.axvspan(g["resumed_at"], end, color="grey", alpha=0.12)
        acc.text(
            args.kill_step, 0.02, f" {args.kill} killed (step {args.kill_step})", fontsize=8, color="dimgrey"
        )
        acc.text(args.grow_step, 0.02, f" slots back (step {args.grow_step})", fontsize=8, color="dimgrey")
    acc.set_ylabel("validation accuracy")
    acc.set_ylim(0, 1)
    acc.legend(fontsize=8, loc="lower right")
    optimizer = "LAMB" if args.model == "transformer" else "SGD"
    acc.set_title(
        f"Elastic training, N = {args.np} -> {args.np - args.kill} -> {args.np}, "
        "32 examples per worker per step, "
        f"{optimizer} lr {args.lr:g}\n"
        f"(shaded: {args.np - args.kill} workers in the first run with failures; "
        "solid: with failures, dashed: without; workers' lines offset a little)",
        fontsize=9,
    )
    loss.set_ylabel("validation loss")
    size.set_ylabel("workers")
    size.set_ylim(args.np - args.kill - 1, args.np + 1)
    size.set_xlabel("global step")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


PARAMETERS = [
    "np", "kill", "steps", "kill_step", "grow_step", "eval_every", "batches_per_commit",
    "train_examples", "lr", "seed", "peer_timeout", "phase_steps", "discovery_interval",
]  # fmt: skip
# The launcher's and tf_adasum.elastic's lines that the recovery times need, kept with the events.
KEPT_LINES = (LEAVE, GROUP_START, GROUP_END, NOTICE)


def code_version() -> str:
    """The commit the jobs run, and whether tf_adasum/ differs from it (others may be editing it)."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=30
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "tf_adasum"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return f"{head}{' + uncommitted changes in tf_adasum/' if dirty else ''}"


def save_run(
    out: Path,
    name: str,
    args: argparse.Namespace,
    result: tuple[int, list[Any], list[Any], float],
    code_at_start: str = "unknown",
) -> None:
    """OUT/<name>_events.jsonl: the workers' @ev events, the launcher's lines that the recovery times
    need (stamped on arrival), and the job's exit code, wall time, parameters and tf_adasum's commit at
    its start and end."""
    code, events, lines, wall = result
    kept = [
        {"ev": "line", "t": stamp, "kind": kind, "line": line}
        for stamp, kind, line in lines
        if any(pattern.match(line) for pattern in KEPT_LINES)
    ]
    job = {
        "ev": "job",
        "code": code,
        "wall": wall,
        "parameters": {k: getattr(args, k) for k in PARAMETERS},
        "tf_adasum": {"start": code_at_start, "end": code_version()},
    }
    with open(out / f"{name}_events.jsonl", "w") as f:
        f.writelines(json.dumps(e) + "\n" for e in [*events, *kept, job])


def load_run(
    out: Path, name: str
) -> tuple[int, list[Any], list[Any], float, dict[str, Any], dict[str, str]] | None:
    path = out / f"{name}_events.jsonl"
    if not path.exists():
        return None
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    job = next((r for r in records if r["ev"] == "job"), {"code": None, "wall": 0.0, "parameters": {}})
    lines = [(r["t"], r["kind"], r["line"]) for r in records if r["ev"] == "line"]
    events = [r for r in records if r["ev"] not in ("line", "job")]
    job.setdefault("tf_adasum", {"start": "unknown", "end": "unknown"})
    if job["parameters"]:
        job["parameters"].setdefault("discovery_interval", 1.0)  # runs before the option: every second
    return job["code"], events, lines, job["wall"], job["parameters"], job["tf_adasum"]


def run_summary(
    name: str, events: list[Any], lines: list[Any], wall: float, args: argparse.Namespace
) -> tuple[dict[str, Any], list[Any], dict[int, Any], list[dict[str, Any]], list[str]]:
    """One run's row of the results table, its curve, its groups, its recoveries and notes."""
    spec = RUNS[name]
    points = curve(events)
    groups = groups_of(events, lines)
    notes = []
    overwritten = [e for e in events if e["ev"] == "lr_overwritten_by_sync"]
    # Rows written before the worker's tolerance was relative count float32's rounding too: recount.
    overwritten = [e for e in overwritten if abs(e["lr"] - e["set_to"]) > 1e-6 * e["set_to"]]
    row = {
        "run": name,
        "op": spec["op"],
        "lr": f"{args.lr:g} x size" if spec["lr_rule"] == "size" else f"{args.lr:g}",
        "failures": spec["failures"],
        "membership": membership(groups, args.steps),
        "groups": len([g for g in groups.values() if "size" in g]),
        "steps": points[-1]["step"],
        "final_accuracy": points[-1]["accuracy"],
        "last3_accuracy": round(statistics.mean(p["accuracy"] for p in points[-3:]), 4),
        "final_loss": points[-1]["loss"],
        "examples_seen": points[-1]["examples_seen"],
        "wall_s": round(wall, 1),
        "lr_overwritten_by_sync": len(overwritten),
    }
    recoveries = [
        {"run": name, **{k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}}
        for r in recovery(events, groups)
    ]
    if spec["failures"] and len(recoveries) < 2:
        notes.append(f"{name}: the job did not shrink and grow back before its end: see its log")
    if overwritten:
        wrong = sorted({(e["size"], round(e["lr"], 4), round(e["set_to"], 4)) for e in overwritten})
        notes.append(
            f"{name}: after the sync, {len(overwritten)} process(es) held the committed learning rate, not "
            "the reset callback's (workers, after the sync, wanted: "
            + "; ".join(f"{n}, {a:g}, {b:g}" for n, a, b in wrong)
            + "); the worker set it again"
        )
    return row, points, groups, recoveries, notes


def commit_rows(events: list[Any]) -> list[dict[str, Any]]:
    phases = [e for e in events if e["ev"] == "commit_phase"]
    rows = []
    for e in phases:
        if e["rank"] != 0:
            continue
        rows.append(
            {
                "phase": e["phase"],
                "batches_per_commit": e["batches_per_commit"],
                "steps": e["steps"],
                "step_ms": round(e["step_ms"], 2),
                "commit_ms": round(e["commit_ms"], 2),
                "commit_max_ms": round(e["commit_max_ms"], 2),
                "meeting_ms": round(e["meeting_ms"], 2),
                "commits": e["commits"],
                "per_step_ms": round(e["per_step_ms"], 2),
                "commit_ms_mean_over_ranks": round(
                    statistics.mean(p["commit_ms"] for p in phases if p["phase"] == e["phase"]), 2
                ),
            }
        )
    return rows


def report(args: argparse.Namespace, elapsed: float | None) -> bool:
    """Builds the tables, the CSVs, summary.txt and the plot from OUT's event files (the runs of
    --runs, and the commit cost unless --skip-commit-cost); returns whether everything asked for is
    there."""
    wanted = {k: getattr(args, k) for k in PARAMETERS}
    runs: dict[str, dict[str, Any]] = {}
    summary, recoveries, notes = [], [], []
    complete = True
    walls = 0.0
    codes: list[dict[str, str]] = []
    for name in args.runs:
        loaded = load_run(args.out, name)
        if loaded is None:
            notes.append(f"{name}: not run")
            complete = False
            continue
        code, events, lines, wall, parameters, version = loaded
        walls += wall
        codes.append(version)
        if parameters != wanted:
            notes.append(f"{name}: left out, made with other parameters ({parameters})")
            complete = False
            continue
        if code != 0 or not curve(events):
            notes.append(f"{name}: no result (exit code {code}); see its log")
            complete = False
            continue
        row, points, groups, rows, more = run_summary(name, events, lines, wall, args)
        write_csv(args.out / f"{name}.csv", points)
        runs[name] = {"curve": points, "groups": groups}
        summary.append(row)
        recoveries += rows
        notes += more
    commits: list[dict[str, Any]] = []
    if not args.skip_commit_cost:
        loaded = load_run(args.out, "commit_cost")
        if loaded is not None:
            walls += loaded[3]
            codes.append(loaded[5])
        if loaded is None or loaded[0] != 0 or loaded[4] != wanted or len(commit_rows(loaded[1])) != 5:
            notes.append(
                "commit_cost: no result" if loaded is None else f"commit_cost: no result (exit {loaded[0]})"
            )
            complete = False
        else:
            commits = commit_rows(loaded[1])
    text = [
        results_table(summary) if summary else "(no run finished)" if args.runs else "(no runs asked for)",
        "",
        recovery_table(recoveries),
    ]
    if commits:
        text += ["", commit_table(commits, args.np)]
    text += ["", f"the jobs' wall time, summed: {walls / 60:.1f} min"]
    versions = sorted(
        {f"{v['start']} -> {v['end']}" if v["start"] != v["end"] else v["start"] for v in codes}
    )
    text.append(f"tf_adasum: {'; '.join(versions) or 'unknown'}")
    if elapsed is not None:
        text.append(f"this invocation: {elapsed / 60:.1f} min")
    if notes:
        text += ["", *notes]
    joined = "\n".join(text)
    print("\n" + joined, flush=True)
    for name, rows in (("summary", summary), ("recovery", recoveries), ("commit_cost", commits)):
        if rows:
            write_csv(args.out / f"{name}.csv", rows)
    (args.out / "summary.txt").write_text(
        f"python benchmarks/studies/elastic.py{' --smoke' if args.smoke else ''}: N = {args.np} -> "
        f"{args.np - args.kill} -> {args.np}, model {args.model}, {args.steps} steps, lr {args.lr:g}, "
        f"batches_per_commit {args.batches_per_commit}, seed {args.seed}, "
        f"discovery every {args.discovery_interval:g} s\n\n{joined}\n"
    )
    if runs:
        plot(runs, args, args.out / "accuracy_vs_step.png")
    return complete


def ensure_data(args: argparse.Namespace) -> None:
    if args.data.exists():
        return
    copies = "copies=2, validation_copies=1" if args.smoke else ""
    code = (
        "from pathlib import Path; from tf_adasum.demo import augmented_digits; "
        f"augmented_digits(Path({str(args.data)!r}){', ' + copies if copies else ''})"
    )
    subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, check=True, timeout=600,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"),
    )  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--runs", nargs="*", default=list(RUNS), choices=list(RUNS), help="none: the commit cost only"
    )
    parser.add_argument("--skip-commit-cost", action="store_true")
    parser.add_argument(
        "--report", action="store_true", help="run nothing: the tables and the plot from OUT's event files"
    )
    parser.add_argument("--np", type=int, default=8)
    parser.add_argument("--kill", type=int, default=2, help="workers killed (the last ranks of group 0)")
    parser.add_argument("--steps", type=int, default=400, help="global steps in all")
    parser.add_argument("--kill-step", type=int, default=125)
    parser.add_argument("--grow-step", type=int, default=250, help="the discovery file says N again here")
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument(
        "--discovery-interval", type=float, default=1.0,
        help="the launcher's --host-discovery-interval: seconds between two reads of the discovery file (1)",
    )  # fmt: skip
    parser.add_argument("--batches-per-commit", type=int, default=10)
    parser.add_argument("--train-examples", type=int, default=0, help="0: all ~20k")
    parser.add_argument(
        "--lr",
        type=float,
        default=None,
        help=f"default: {ONE_WORKER_LR} (SGD), LAMB's 0.004 for the transformer",
    )
    parser.add_argument(
        "--model", choices=["cnn", "transformer"], default="cnn",
        help="transformer: the LAMB study's pointer task with LAMB (convergence.py --model transformer)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--phase-steps", type=int, default=200, help="commit cost: steps per phase")
    parser.add_argument("--peer-timeout", type=float, default=30, help="TF_ADASUM_TIMEOUT_SECONDS")
    parser.add_argument("--job-timeout", type=float, default=600, help="the launcher's --timeout per job")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "studies" / "elastic_output")
    parser.add_argument("--data", type=Path, default=ROOT / "demo_output" / "digits16_held_out.npz")
    parser.add_argument("--smoke", action="store_true", help="N = 3 -> 2 -> 3, one short run, ~2 min")
    args = parser.parse_args()
    if args.lr is None:
        args.lr = LAMB_LR if args.model == "transformer" else ONE_WORKER_LR
    if args.smoke:
        # 5,000 steps of about 5 ms: the group of 2 trains long enough after the growth notice for the
        # pool to refill (REFILL_DELAY_SECONDS) and warm processes to import TensorFlow on busy cores.
        # At 2,000 a loaded CI machine ended the job before the launcher posted the growth.
        args.np, args.kill, args.steps, args.kill_step, args.grow_step = 3, 1, 5000, 25, 60
        args.eval_every, args.train_examples, args.phase_steps, args.job_timeout = 100, 4000, 100, 240
        if args.runs == list(RUNS):
            args.runs = ["adasum_failures"]
        args.out = args.out.with_name(args.out.name + "_smoke")
        if args.data == parser.get_default("data") and not args.data.exists():
            args.data = args.out / "digits16_smoke.npz"
    args.out.mkdir(parents=True, exist_ok=True)
    if args.report:
        return 0 if report(args, None) else 1
    began = time.time()
    ensure_data(args)
    work = Path(tempfile.mkdtemp(prefix="tf_adasum_elastic_bench_"))
    print(
        f"N = {args.np} -> {args.np - args.kill} (step {args.kill_step}) -> {args.np} "
        f"(from step {args.grow_step}); "
        f"{args.steps} steps, lr {args.lr:g}, commit every {args.batches_per_commit} batches; logs in {work}",
        flush=True,
    )
    for name in args.runs:
        version = code_version()
        result = launch(args, name, train_args(args, RUNS[name]), work, args.np)
        save_run(args.out, name, args, result, version)
        code, events, _, wall = result
        points = curve(events)
        done = (
            f"accuracy {points[-1]['accuracy']:.3f} at step {points[-1]['step']}" if points else "no result"
        )
        print(f"  {name}: exit code {code}, {done}, {wall:.0f} s", flush=True)
    if not args.skip_commit_cost:
        worker_args = [
            "commit_cost", "--data", str(args.data), "--train-examples", str(args.train_examples),
            "--op", "adasum", "--lr", str(args.lr), "--seed", str(args.seed), "--np", str(args.np),
            "--phase-steps", str(args.phase_steps),
        ]  # fmt: skip
        version = code_version()
        result = launch(args, "commit_cost", worker_args, work, args.np)
        save_run(args.out, "commit_cost", args, result, version)
        print(f"  commit_cost: exit code {result[0]}, {result[3]:.0f} s", flush=True)
    complete = report(args, time.time() - began)
    if complete:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"logs kept in {work}", flush=True)
    return 0 if complete else 1


if __name__ == "__main__":
    sys.exit(main())
