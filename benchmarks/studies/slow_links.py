"""Local steps with an outer optimizer across slow links: wall time and bytes to the one-worker accuracy.

4 workers, each with its own batches of 32, train with Adam at the one-worker learning rate and sync
every H steps (H = 1, 4, 16, 64), compared with MultiWorkerMirroredStrategy's gradient mean every step
at its own tuned rate. Methods:
    mwms          the gradient mean every step (MirroredStrategy's numbers, MultiWorkerMirroredStrategy's
                  cost), the inner rate tuned on --mwms-multipliers
    adasum        AdasumStrategy / AdasumCallback(sync_every=H): Adasum of the H-step deltas, no outer
                  optimizer (H = 1: Adasum every step)
    adasum_outer  the same with outer_optimizer=SGD(lr, momentum, nesterov), tuned on --adasum-outer-grid
    mean_outer    combine="mean" with the outer optimizer: DiLoCo as published, tuned on --outer-grid

A run's numbers do not depend on the link; its time does. So the study has these parts:

accuracy  In one process with 4 logical CPUs, the product itself: AdasumStrategy(sync_every=H,
          combine=, outer_optimizer=) or MirroredStrategy under model.fit, and a callback that reads the
          held-out accuracy at every sync (every 8 steps for H < 8). The replica tree is the numeric
          contract: 4 replicas in one process step exactly as 4 processes do. The target is the
          one-worker accuracy: one worker's mean held-out accuracy after --budget steps of 32 (over the
          seeds, floored to 0.01). Every 4-worker run takes --budget steps on each worker (a fixed budget
          of 4 x 32 x budget samples, the same for every method) and gives its steps to the target and
          its final accuracy. Each setting of the grids runs on seed 0; the best (fewest steps to the
          target, then final accuracy) runs on every seed.
orthogonality  Seed 0 of the best Adasum + outer setting at each H again, with OrthogonalityMonitor:
          how orthogonal the workers' deltas were at each sync, per variable.
cost      On 4 namespace hosts (scripts/cluster.py), one process each, every link shaped to each
          --rates: each method's real step under tf_adasum.run -H, same model and batch: MWMS's custom
          strategy.run loop (Keras 3's fit under MWMS is broken upstream, keras-team/keras#20585), and
          model.fit with AdasumCallback(sync_every=H, combine=, outer_optimizer=) for each H, in
          alternating rounds. Gives ms per step over whole windows (the syncs' share included) and the
          bytes each host's eth0 sent per step; and "local", fit with no sync, the slowest process's
          step. --cost-methods: only those named. --cost-compressions bf16: also Adasum every H with its
          deltas in bfloat16 on the wire (method "adasum_bf16").
workers   How the best outer step over Adasum moves with the number of workers: the accuracy part's
          Adasum runs, with and without the outer grid, on --workers-counts replicas at --workers-hs.
inner     The lever left for the local-step methods: their inner Adam rate, which the accuracy part
          holds at the one-worker rate. Each local method's best setting at each --inner-hs, at the
          one-worker rate times each --inner-multipliers, seed 0; the best multiplier on every seed.
          Writes OUT/inner.csv; the report gives a table like the main one of these runs.
validate  The composition checked once: seed 0 of the best Adasum + outer setting at --validate-h
          trained end to end on the cluster at the first --rates (AdasumCallback, each process on its
          replica's slices of the same batches), its time and step to the target against the composed.
compression  Compressed deltas over whole runs: every seed of the best Adasum + outer setting at each
          --compression-hs trained end to end the same way, with AdasumCallback(compression=) "none",
          "bf16" and "fp16": steps, seconds and bytes to the target and the final accuracy, measured.
cores     What the cluster's shared cores cost a local step: each workload's fit step (the one-worker
          Adam, no sync: what every local method does between syncs) in one process alone on this
          machine, and in 4 processes at once, as the 4 namespace hosts share its cores, in alternating
          --rounds. Writes OUT/cores.jsonl; the report composes the 100 Mbit/s times with a host's cores
          to itself (each measured step less the slowest shared process's excess over the lone one).
report    time to target = steps to target x ms per step on that link, bytes likewise; tables and plots.

Usage (the cost part as root; benchmarks/README.md gives the commands of the published run):
    .venv/bin/python benchmarks/studies/slow_links.py                     # every part, resumable
    .venv/bin/python benchmarks/studies/slow_links.py --parts accuracy --workloads cnn
    .venv/bin/python benchmarks/studies/slow_links.py --parts cost --rates 100mbit 1gbit
    .venv/bin/python benchmarks/studies/slow_links.py --parts report
    .venv/bin/python benchmarks/studies/slow_links.py --smoke             # every part, tiny, minutes

Writes OUT/accuracy.csv (a row per run, its curve in OUT/curves.jsonl), OUT/orthogonality.csv,
OUT/workers.csv, OUT/inner.csv, OUT/cost.jsonl, OUT/cores.jsonl, OUT/validation.jsonl,
OUT/compression.jsonl, OUT/table.md, OUT/time_to_target.png and OUT/curves.png (the published run's, the
default --out, also into docs/training/ for the docs site).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "benchmarks" / "studies" / "slow_links_output"  # the published run's; plots go to the docs too
WORKERS = 4
LOCAL_BATCH = 32
HS = [1, 4, 16, 64]
# The one-worker Adam rate of each workload, tuned once (the README tells how).
INNER_LR = {"cnn": 1e-3, "transformer": 1e-3}
# Outer SGD (learning rate, Nesterov momentum): DiLoCo's published (0.7, 0.9) and a small grid about 1.
# Outer SGD (learning rate, Nesterov momentum) for the mean: DiLoCo's published (0.7, 0.9), plain
# averaging (1, 0) and smaller steps. For Adasum the same, but DiLoCo's scaled to a sum: Adasum of
# orthogonal deltas is their sum, N = 4 times their mean, so (0.7 / 4, 0.9) ~ (0.2, 0.9); (1, 0) is
# "adasum" itself.
OUTER_GRID = [(0.25, 0.0), (0.5, 0.0), (0.5, 0.5), (0.7, 0.9), (1.0, 0.0)]
ADASUM_OUTER_GRID = [(0.2, 0.9), (0.25, 0.0), (0.5, 0.0), (0.5, 0.5), (0.7, 0.9)]
# Steps per worker: one worker's accuracy after them is the target, and every run goes this far.
BUDGET = {"cnn": 384, "transformer": 512}
FIELDS = [
    "workload",
    "method",
    "H",
    "inner_lr",
    "outer_lr",
    "outer_momentum",
    "seed",
    "budget",
    "target",
    "steps_to_target",
    "final_accuracy",
    "seconds",
]


# ----------------------------------------------------------------------------------------------- models


def _convergence() -> Any:
    """The convergence study's module (it imports TensorFlow, so only where a part needs it): its
    workloads and its results CSV's helpers."""
    sys.path.insert(0, str(ROOT / "benchmarks" / "studies"))
    import convergence

    return convergence


def workload_data(workload: str, smoke: bool, out: Path) -> tuple[np.ndarray, ...]:
    if workload == "transformer":
        return _convergence().pointer_data(2_000 if smoke else 20_000)
    from tf_adasum.demo import augmented_digits

    if smoke:
        return augmented_digits(out / "digits16_smoke.npz", copies=2, validation_copies=1)
    return augmented_digits(ROOT / "demo_output" / "digits16_held_out.npz")


def make_model(workload: str) -> Any:
    """The convergence study's networks, widened to the size where a 100 Mbit/s link matters: the
    digits CNN with a 1024-1024 head (1.13 M parameters, 4.5 MB); the pointer task's Transformer at
    width 128 (0.40 M parameters, 1.6 MB)."""
    import keras

    if workload == "cnn":
        return keras.Sequential(
            [
                keras.Input((16, 16, 1)),
                keras.layers.Conv2D(6, 5, activation="relu"),
                keras.layers.MaxPooling2D(),
                keras.layers.Conv2D(16, 3, activation="relu"),
                keras.layers.MaxPooling2D(),
                keras.layers.Flatten(),
                keras.layers.Dense(1024, activation="relu"),
                keras.layers.Dense(1024, activation="relu"),
                keras.layers.Dense(10),
            ]
        )
    convergence = _convergence()
    width = 128
    tokens = keras.Input((convergence.POINTER_LENGTH,), dtype="int32")
    h = keras.layers.Embedding(max(convergence.POINTER_VOCAB, convergence.POINTER_LENGTH), width)(tokens)
    h = convergence.PositionEmbedding()(h)
    for _ in range(2):
        h = keras.layers.LayerNormalization()(h + keras.layers.MultiHeadAttention(4, width // 4)(h, h))
        hidden = keras.layers.Dense(4 * width, activation="relu")(h)
        h = keras.layers.LayerNormalization()(h + keras.layers.Dense(width)(hidden))
    pooled = keras.layers.GlobalAveragePooling1D()(h)
    return keras.Model(tokens, keras.layers.Dense(convergence.POINTER_VOCAB)(pooled))


def outer(lr: float, momentum: float) -> Any:
    import keras

    return keras.optimizers.SGD(lr, momentum=momentum, nesterov=momentum > 0)


def compile_model(model: Any, lr: float) -> None:
    import keras

    model.compile(
        optimizer=keras.optimizers.Adam(lr),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )


# --------------------------------------------------------------------------------------------- accuracy


def accuracy_run(
    data: tuple[np.ndarray, ...], setting: dict[str, Any], target: float | None, monitor: bool = False
) -> dict[str, Any]:
    """One run of `setting` over the whole budget: its CSV row, and its curve [(step, accuracy)]; with
    `monitor`, also tf_adasum's OrthogonalityMonitor's history, per variable at every sync."""
    import keras
    import tensorflow as tf

    import tf_adasum

    x, y, x_val, y_val = data
    method, h, seed, budget = setting["method"], setting["H"], setting["seed"], setting["budget"]
    workers = 1 if method == "one" else int(setting.get("workers", WORKERS))
    devices = [d.name for d in tf.config.list_logical_devices("CPU")[:workers]]
    if method in ("one", "mwms"):
        strategy: Any = tf.distribute.MirroredStrategy(devices)
    else:
        strategy = tf_adasum.AdasumStrategy(
            devices,
            sync_every=h,
            combine="mean" if method == "mean_outer" else "adasum",
            outer_optimizer=None
            if method == "adasum"
            else outer(setting["outer_lr"], setting["outer_momentum"]),
        )
    keras.utils.set_random_seed(seed)
    with strategy.scope():
        model = make_model(setting["workload"])
        compile_model(model, setting["inner_lr"])
    probe = make_model(setting["workload"])  # the held-out accuracy, read from replica 0's weights
    predict = tf.function(
        lambda inputs: tf.argmax(probe(inputs, training=False), axis=1, output_type=tf.int32)
    )
    every = max(h, 8)
    curve: list[tuple[int, float]] = []

    class Probe(keras.callbacks.Callback):
        def __init__(self) -> None:
            super().__init__()
            self.step = 0

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            self.step += 1
            if self.step % every == 0:  # a sync: every replica holds the same weights
                probe.set_weights(model.get_weights())
                correct = sum(
                    int(tf.reduce_sum(tf.cast(predict(x_val[i : i + 1024]) == y_val[i : i + 1024], tf.int32)))
                    for i in range(0, len(y_val), 1024)
                )
                curve.append((self.step, correct / len(y_val)))

    steps = budget  # every worker's steps: 4 workers see 4 times one worker's samples
    global_batch = LOCAL_BATCH * workers
    rng = np.random.default_rng(seed)
    order = np.concatenate([rng.permutation(len(y)) for _ in range(steps * global_batch // len(y) + 1)])
    order = order[: steps * global_batch]
    start = time.perf_counter()
    orthogonality = tf_adasum.callbacks.OrthogonalityMonitor(every=h)
    callbacks = [Probe(), *([orthogonality] if monitor else [])]
    model.fit(
        x[order], y[order], batch_size=global_batch, epochs=1, shuffle=False, verbose=0, callbacks=callbacks
    )
    reached = next((s for s, a in curve if target is not None and a >= target), None)
    row = {
        **{
            k: setting[k]
            for k in ("workload", "method", "H", "inner_lr", "outer_lr", "outer_momentum", "seed")
        },
        "budget": budget,
        "target": target,
        "steps_to_target": reached,
        "final_accuracy": round(curve[-1][1], 4),
        "seconds": round(time.perf_counter() - start, 1),
    }
    return {"row": row, "curve": curve, "orthogonality": orthogonality.history}


def setting_key(s: dict[str, Any]) -> tuple[Any, ...]:
    return (
        s["workload"],
        s["method"],
        int(s["H"]),
        float(s["inner_lr"]),
        float(s["outer_lr"]),
        float(s["outer_momentum"]),
        int(s["seed"]),
        int(s["budget"]),
    )


def steps_or_inf(row: dict[str, Any]) -> float:
    return float(row["steps_to_target"]) if row["steps_to_target"] not in ("", None) else math.inf


def best_settings(rows: list[dict[str, Any]]) -> dict[tuple[str, str, int], dict[str, Any]]:
    """Per workload, method and H: the seed-0 setting with the fewest steps to target, then the best
    final accuracy."""
    best: dict[tuple[str, str, int], dict[str, Any]] = {}
    for row in rows:
        if int(row["seed"]) != 0:
            continue
        k = (row["workload"], row["method"], int(row["H"]))
        score = (steps_or_inf(row), -float(row["final_accuracy"]))
        if k not in best or score < (steps_or_inf(best[k]), -float(best[k]["final_accuracy"])):
            best[k] = row
    return best


def logical_cpus(args: argparse.Namespace) -> None:
    """This process's CPU as one logical device per replica, for every part that runs in it: the same
    configuration each time (TensorFlow refuses a different one once it has started)."""
    import tensorflow as tf

    counts = [WORKERS, *(args.workers_counts if "workers" in args.parts else [])]
    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * max(counts)
    )


def accuracy_part(args: argparse.Namespace) -> None:
    logical_cpus(args)
    path = args.out / "accuracy.csv"
    for workload in args.workloads:
        data = workload_data(workload, args.smoke, args.out)
        lr = INNER_LR[workload]
        base = {"workload": workload, "inner_lr": lr, "outer_lr": 1.0, "outer_momentum": 0.0}
        budget = args.budget or BUDGET[workload]
        base["budget"] = budget

        curves = args.out / "curves.jsonl"
        ones = [{**base, "method": "one", "H": 1, "seed": s} for s in range(args.seeds)]
        ones = run_settings(path, data, ones, None, curves=curves)
        target = math.floor(100 * float(np.mean([float(r["final_accuracy"]) for r in ones]))) / 100
        grid = [
            {**base, "method": "mwms", "H": 1, "seed": 0, "inner_lr": lr * m} for m in args.mwms_multipliers
        ]
        for h in args.hs:
            grid.append({**base, "method": "adasum", "H": h, "seed": 0})
            for method, outer_grid in (
                ("adasum_outer", args.adasum_outer_grid),
                ("mean_outer", args.outer_grid),
            ):
                grid += [
                    {**base, "method": method, "H": h, "seed": 0, "outer_lr": o, "outer_momentum": m}
                    for o, m in outer_grid
                    if not (method == "adasum_outer" and (o, m) == (1.0, 0.0))  # that is "adasum"
                ]
        rows = run_settings(path, data, grid, target, curves=curves)
        best = best_settings([r for r in rows if r["workload"] == workload])
        seeds = []
        for row in best.values():
            setting = {
                k: row[k] for k in ("workload", "method", "H", "inner_lr", "outer_lr", "outer_momentum")
            }
            setting |= {"H": int(row["H"]), "budget": budget}
            setting |= {k: float(setting[k]) for k in ("inner_lr", "outer_lr", "outer_momentum")}
            seeds += [{**setting, "seed": s} for s in range(1, args.seeds)]
        run_settings(path, data, seeds, target, curves=curves)


def workers_part(args: argparse.Namespace) -> None:
    """How the best outer step over Adasum moves with the number of workers: for each
    --workers-counts N, the accuracy part's Adasum runs (no outer optimizer, and the outer grid) at each
    --workers-hs on N replicas, each taking the budget's steps (N x 32 x budget samples), to the same
    one-worker target; seed 0 of every setting, then the best on every seed. Writes OUT/workers.csv."""
    logical_cpus(args)
    path = args.out / "workers.csv"
    for workload in args.workloads:
        budget = args.budget or BUDGET[workload]
        target = study_target(args.out, workload, budget, "workers")
        data = workload_data(workload, args.smoke, args.out)
        lr = INNER_LR[workload]
        for n in args.workers_counts:
            base = {"workload": workload, "inner_lr": lr, "budget": budget, "workers": n}

            grid = []
            for h in args.workers_hs:
                grid.append(
                    {**base, "method": "adasum", "H": h, "seed": 0, "outer_lr": 1.0, "outer_momentum": 0.0}
                )
                grid += [
                    {**base, "method": "adasum_outer", "H": h, "seed": 0, "outer_lr": o, "outer_momentum": m}
                    for o, m in args.adasum_outer_grid
                    if (o, m) != (1.0, 0.0)
                ]
            best = best_settings(run_settings(path, data, grid, target, ("workers",)))
            seeds = []
            for row in best.values():
                setting = {**base, "method": row["method"], "H": int(row["H"])}
                setting |= {k: float(row[k]) for k in ("outer_lr", "outer_momentum")}
                seeds += [{**setting, "seed": s} for s in range(1, args.seeds)]
            run_settings(path, data, seeds, target, ("workers",))


def study_target(out: Path, workload: str, budget: int, part: str) -> float:
    """The accuracy part's target of `workload` at `budget`, which the later parts train to."""
    rows = [r for r in _convergence().read_rows(out / "accuracy.csv") if r["workload"] == workload]
    targets = {r["target"] for r in rows if int(r["budget"]) == budget and r["target"] not in ("", None)}
    if len(targets) != 1:
        raise RuntimeError(f"{part}: run the accuracy part of {workload} first (its target: {targets})")
    return float(targets.pop())


def inner_part(args: argparse.Namespace) -> None:
    """The local methods' inner rate tuned: each one's best setting (its outer step) at each --inner-hs,
    as the accuracy part found it at the one-worker rate, again at that rate times each
    --inner-multipliers on seed 0, then the best multiplier on every seed. Writes OUT/inner.csv."""
    logical_cpus(args)
    path = args.out / "inner.csv"
    for workload in args.workloads:
        budget = args.budget or BUDGET[workload]
        target = study_target(args.out, workload, budget, "inner")
        rows = [r for r in _convergence().read_rows(args.out / "accuracy.csv") if r["workload"] == workload]
        best = best_settings([r for r in rows if int(r["budget"]) == budget])
        data = workload_data(workload, args.smoke, args.out)
        grid = []
        for (_, method, h), row in sorted(best.items()):
            if method not in ("adasum", "adasum_outer", "mean_outer") or h not in args.inner_hs:
                continue
            setting = {"workload": workload, "method": method, "H": h, "budget": budget}
            setting |= {k: float(row[k]) for k in ("outer_lr", "outer_momentum")}
            grid += [
                {**setting, "seed": 0, "inner_lr": INNER_LR[workload] * m} for m in args.inner_multipliers
            ]
        seeds = []
        for row in best_settings(run_settings(path, data, grid, target)).values():
            setting = {k: row[k] for k in ("workload", "method")} | {"H": int(row["H"]), "budget": budget}
            setting |= {k: float(row[k]) for k in ("inner_lr", "outer_lr", "outer_momentum")}
            seeds += [{**setting, "seed": s} for s in range(1, args.seeds)]
        run_settings(path, data, seeds, target)


def run_settings(
    path: Path,
    data: tuple[np.ndarray, ...],
    settings: list[dict[str, Any]],
    target: float | None,
    extra_fields: tuple[str, ...] = (),
    curves: Path | None = None,
) -> list[dict[str, Any]]:
    """Every setting's row in the CSV `path`, in order: those already there read back (a run resumes),
    the others run (accuracy_run) and appended, with their curves to `curves`. A row is keyed by
    setting_key and the integer `extra_fields` (the workers part's "workers"), which it also holds."""
    fields = [*FIELDS, *extra_fields]

    def key(s: dict[str, Any]) -> tuple[Any, ...]:
        return (*setting_key(s), *(int(s[f]) for f in extra_fields))

    done = {key(r): r for r in _convergence().read_rows(path)}
    rows = []
    for s in settings:
        if key(s) not in done:
            result = accuracy_run(data, s, target)
            row = {**result["row"], **{f: s[f] for f in extra_fields}}
            _convergence().append_row(path, fields, row)
            if curves is not None:
                with open(curves, "a") as f:
                    f.write(json.dumps({**row, "curve": result["curve"]}) + "\n")
            print(json.dumps(row), flush=True)
            done[key(s)] = row
        rows.append(done[key(s)])
    return rows


def workers_table(out: Path, workload: str, budget: int) -> list[str]:
    """Per number of workers and H: the best outer setting over Adasum (none: Adasum alone), its steps to
    the target and final accuracy over the seeds; 4 workers from the accuracy part."""
    rows = [
        {**r, "workers": "4"}
        for r in _convergence().read_rows(out / "accuracy.csv")
        if r["method"] in ("adasum", "adasum_outer")
    ]
    rows += _convergence().read_rows(out / "workers.csv")
    rows = [r for r in rows if r["workload"] == workload and int(r["budget"]) == budget]
    counts = sorted({int(r["workers"]) for r in rows})
    hs = sorted({int(r["H"]) for r in rows if r["workers"] != "4"})
    if len(counts) < 2:
        return []
    lines = [
        f"The best outer step over Adasum against the number of workers, {workload} (each worker "
        f"{budget} steps of {LOCAL_BATCH}; seed 0 picks, mean (min-max) over the seeds):",
        "",
        "| workers | H | Adasum alone: steps (final) | best outer (lr, momentum) | its steps to target "
        "| its final accuracy |",
        "| --- | --- | --- | --- | --- | --- |",
    ]

    def over_seeds(best: dict[str, Any], mine: list[dict[str, Any]]) -> list[dict[str, Any]]:
        same = ("method", "outer_lr", "outer_momentum")
        return [r for r in mine if int(r["H"]) == int(best["H"]) and all(r[k] == best[k] for k in same)]

    def text(runs: list[dict[str, Any]]) -> tuple[str, str]:
        steps = [steps_or_inf(r) for r in runs]
        finals = [float(r["final_accuracy"]) for r in runs]
        reached = sum(map(math.isfinite, steps))
        steps_text = (
            f"{np.mean(steps):.0f} ({min(steps):.0f}-{max(steps):.0f})"
            if reached == len(steps)
            else f"{reached} of {len(steps)} seeds"
        )
        return steps_text, f"{np.mean(finals):.3f} ({min(finals):.3f}-{max(finals):.3f})"

    for n in counts:
        mine = [r for r in rows if int(r["workers"]) == n]
        best = best_settings(mine)
        for h in hs:
            alone, outer_best = best.get((workload, "adasum", h)), best.get((workload, "adasum_outer", h))
            if alone is None or outer_best is None:
                continue
            alone_steps, alone_final = text(over_seeds(alone, mine))
            steps_text, final_text = text(over_seeds(outer_best, mine))
            setting = f"{float(outer_best['outer_lr']):g}, {float(outer_best['outer_momentum']):g}"
            lines.append(
                f"| {n} | {h} | {alone_steps} ({alone_final}) | {setting} | {steps_text} | {final_text} |"
            )
    return [*lines, ""]


def layer_names(names: list[str]) -> dict[str, str]:
    """The monitor's names ("orthogonality/sequential_4/conv2d_9/kernel") as the same in every run: the
    model's name dropped, each kind of layer numbered in order ("conv2d2/kernel"); "orthogonality",
    the mean over variables, as it is."""
    numbered: dict[str, dict[int, int]] = {}
    parsed = {}
    for name in names:
        parts = name.removeprefix("orthogonality/").split("/")
        if len(parts) < 3:
            parsed[name] = None
            continue
        kind, _, suffix = parts[1].rpartition("_")
        if not kind or not suffix.isdigit():
            kind, suffix = parts[1], "0"
        numbered.setdefault(kind, {})[int(suffix)] = 0
        parsed[name] = (kind, int(suffix), "/".join(parts[2:]))
    for suffixes in numbered.values():
        for i, suffix in enumerate(sorted(suffixes)):
            suffixes[suffix] = i + 1
    return {name: name if p is None else f"{p[0]}{numbered[p[0]][p[1]]}/{p[2]}" for name, p in parsed.items()}


def orthogonality_part(args: argparse.Namespace) -> None:
    """Seed 0 of the best Adasum + outer setting at each H again, with tf_adasum's OrthogonalityMonitor:
    per variable, |adasum(d_1..d_4)|^2 / sum |d_i|^2 at each sync (1: the deltas were orthogonal and
    Adasum added them; 1/4: they were equal). Writes OUT/orthogonality.csv."""
    logical_cpus(args)
    path = args.out / "orthogonality.csv"
    done = {(r["workload"], int(r["H"])) for r in _convergence().read_rows(path)}
    rows = _convergence().read_rows(args.out / "accuracy.csv")
    for workload in args.workloads:
        budget = args.budget or BUDGET[workload]
        best = best_settings([r for r in rows if r["workload"] == workload and int(r["budget"]) == budget])
        data = workload_data(workload, args.smoke, args.out)
        for (_, method, h), row in sorted(best.items()):
            if method != "adasum_outer" or (workload, h) in done:
                continue
            setting = {k: row[k] for k in ("workload", "method", "outer_lr", "outer_momentum")}
            setting |= {"H": h, "seed": 0, "budget": budget, "inner_lr": float(row["inner_lr"])}
            setting |= {k: float(setting[k]) for k in ("outer_lr", "outer_momentum")}
            result = accuracy_run(data, setting, float(row["target"]), monitor=True)
            # The same run as the study's: the monitor reads, it does not change a step.
            print(json.dumps({**result["row"], "study_steps_to_target": row["steps_to_target"]}), flush=True)
            history = result["orthogonality"]
            fields = [
                "workload",
                "H",
                "outer_lr",
                "outer_momentum",
                "variable",
                "mean",
                "first_quarter",
                "last_quarter",
            ]
            quarter = max(1, len(history) // 4)
            names = layer_names(sorted({name for _, v in history for name in v}))
            for variable, short in names.items():
                values = [v[variable] for _, v in history if variable in v]
                row = {
                    "workload": workload,
                    "H": h,
                    "outer_lr": setting["outer_lr"],
                    "outer_momentum": setting["outer_momentum"],
                    "variable": short,
                    "mean": round(float(np.mean(values)), 4),
                    "first_quarter": round(float(np.mean(values[:quarter])), 4),
                    "last_quarter": round(float(np.mean(values[-quarter:])), 4),
                }
                _convergence().append_row(path, fields, row)


# ------------------------------------------------------------------------------------------------- cost


def tx_bytes() -> int:
    """Bytes this host's eth0 has sent (this process runs in its namespace host)."""
    path = Path("/sys/class/net/eth0/statistics/tx_bytes")
    return int(path.read_text()) if path.exists() else 0


def worker(args: argparse.Namespace) -> None:
    """One process of a cost job (under tf_adasum.run): each method's step time and bytes, in rounds."""
    import keras
    import tensorflow as tf

    import tf_adasum

    comm = tf_adasum.init()
    x, y, _, _ = workload_data(args.workload, args.smoke, args.out)
    x, y = x[comm.rank :: comm.size], y[comm.rank :: comm.size]
    lr = INNER_LR[args.workload]

    def batches(count: int) -> tuple[np.ndarray, np.ndarray]:
        idx = np.arange(count * LOCAL_BATCH) % len(y)
        return x[idx], y[idx]

    def fit_cost(h: int, combine: str, outer_optimizer: Any, compression: str = "none") -> dict[str, float]:
        warmup, measured = max(h, 8), max(h, 16)
        model = make_model(args.workload)
        compile_model(model, lr)
        marks: dict[int, tuple[float, int]] = {}

        class Marks(keras.callbacks.Callback):
            def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
                if batch + 1 in (warmup, warmup + measured):
                    marks[batch + 1] = (time.perf_counter(), tx_bytes())

        callback = tf_adasum.AdasumCallback(
            sync_every=h, combine=combine, outer_optimizer=outer_optimizer, compression=compression
        )
        xs, ys = batches(warmup + measured)
        model.fit(xs, ys, batch_size=LOCAL_BATCH, shuffle=False, verbose=0, callbacks=[callback, Marks()])
        (t0, b0), (t1, b1) = marks[warmup], marks[warmup + measured]
        return {"ms": 1e3 * (t1 - t0) / measured, "bytes": (b1 - b0) / measured}

    def mwms_cost() -> dict[str, float]:
        warmup, measured = 8, 16
        strategy = comm.strategy  # MultiWorkerMirroredStrategy over the job's processes
        global_batch = LOCAL_BATCH * comm.size
        xs, ys = batches(warmup + measured)
        dataset = strategy.experimental_distribute_dataset(
            tf.data.Dataset.from_tensor_slices((xs, ys)).batch(LOCAL_BATCH).repeat()
        )
        with strategy.scope():
            model = make_model(args.workload)
            optimizer = keras.optimizers.Adam(lr)
            optimizer.build(model.trainable_variables)  # keras-team/keras#23085
            loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

        def replica_step(features: Any, labels: Any) -> Any:
            with tf.GradientTape() as tape:
                per_example = loss_fn(labels, model(features, training=True))
                loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
            return loss

        @tf.function
        def step(batch: Any) -> Any:
            return strategy.reduce("SUM", strategy.run(replica_step, args=batch), axis=None)

        iterator = iter(dataset)
        for _ in range(warmup):
            step(next(iterator)).numpy()
        t0, b0 = time.perf_counter(), tx_bytes()
        for _ in range(measured):
            step(next(iterator)).numpy()
        t1, b1 = time.perf_counter(), tx_bytes()
        return {"ms": 1e3 * (t1 - t0) / measured, "bytes": (b1 - b0) / measured}

    def local_cost() -> dict[str, float]:
        """fit's step with no callback, no sync: the local step every local method takes between syncs,
        on the cluster's shared cores; the slowest process's."""
        warmup, measured = 8, 64
        model = make_model(args.workload)
        compile_model(model, lr)
        marks: dict[int, tuple[float, int]] = {}

        def slowest(value: float) -> float:
            (top,) = tf_adasum.distributed.allreduce([tf.constant([value], tf.float64)], op=reduce_op.MAX)
            return float(top.numpy()[0])

        class Marks(keras.callbacks.Callback):
            def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
                if batch + 1 == warmup:
                    slowest(0.0)  # every process starts the measured steps at once, as they run together
                if batch + 1 in (warmup, warmup + measured):
                    marks[batch + 1] = (time.perf_counter(), tx_bytes())

        reduce_op = tf_adasum.distributed.ReduceOp
        xs, ys = batches(warmup + measured)
        model.fit(xs, ys, batch_size=LOCAL_BATCH, shuffle=False, verbose=0, callbacks=[Marks()])
        (t0, b0), (t1, b1) = marks[warmup], marks[warmup + measured]
        return {"ms": slowest(1e3 * (t1 - t0) / measured), "bytes": (b1 - b0) / measured}

    for round_ in range(args.rounds):
        cases: list[tuple[str, int, Any]] = [("mwms", 1, mwms_cost), ("local", 1, local_cost)]
        for h in args.hs:
            cases.append(("adasum", h, lambda h=h: fit_cost(h, "adasum", None)))
            cases.append(("adasum_outer", h, lambda h=h: fit_cost(h, "adasum", outer(0.5, 0.5))))
            cases.append(("mean_outer", h, lambda h=h: fit_cost(h, "mean", outer(0.7, 0.9))))
            for wire in args.cost_compressions:  # Adasum's deltas narrowed on the wire ("adasum_bf16")
                cases.append((f"adasum_{wire}", h, lambda h=h, w=wire: fit_cost(h, "adasum", None, w)))
        cases = [case for case in cases if args.cost_methods is None or case[0] in args.cost_methods]
        for method, h, measure in cases:
            cost = measure()
            if comm.rank == 0:
                print(json.dumps({"method": method, "H": h, "round": round_, **cost}), flush=True)


def validation_worker(args: argparse.Namespace) -> None:
    """One process of an end-to-end job (the validate and compression parts): --seed of one Adasum +
    outer setting trained with AdasumCallback(compression=--compression), each process on its replica's
    slices of the study's global batches of that seed; rank 0 reads the held-out accuracy at each sync,
    off the clock, and prints (step, seconds, accuracy) and the bytes its host sent during fit."""
    import keras
    import tensorflow as tf

    import tf_adasum

    comm = tf_adasum.init()
    x, y, x_val, y_val = workload_data(args.workload, args.smoke, args.out)
    h, (outer_lr, outer_momentum) = args.validate_h, args.validate_outer
    budget = args.budget or BUDGET[args.workload]
    keras.utils.set_random_seed(args.seed)
    model = make_model(args.workload)
    compile_model(model, INNER_LR[args.workload])
    predict = tf.function(
        lambda inputs: tf.argmax(model(inputs, training=False), axis=1, output_type=tf.int32)
    )
    rng = np.random.default_rng(args.seed)  # accuracy_run's order for this seed
    global_batch = LOCAL_BATCH * WORKERS
    order = np.concatenate([rng.permutation(len(y)) for _ in range(budget * global_batch // len(y) + 1)])
    mine = order[: budget * global_batch].reshape(budget, WORKERS, LOCAL_BATCH)[:, comm.rank].reshape(-1)
    curve: list[tuple[int, float, float]] = []
    sent = [0, 0]

    class Clock(keras.callbacks.Callback):
        def on_train_begin(self, logs: Any = None) -> None:
            self.step, self.off = 0, 0.0
            sent[0] = tx_bytes()
            self.start = time.perf_counter()

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            self.step += 1
            if self.step % h or comm.rank != 0:
                return
            now = time.perf_counter()
            correct = int(tf.reduce_sum(tf.cast(predict(x_val) == y_val, tf.int32)))
            curve.append((self.step, now - self.start - self.off, correct / len(y_val)))
            self.off += time.perf_counter() - now

        def on_train_end(self, logs: Any = None) -> None:
            sent[1] = tx_bytes()

    callback = tf_adasum.AdasumCallback(
        sync_every=h, outer_optimizer=outer(outer_lr, outer_momentum), compression=args.compression
    )
    model.fit(
        x[mine], y[mine], batch_size=LOCAL_BATCH, shuffle=False, verbose=0, callbacks=[callback, Clock()]
    )
    if comm.rank == 0:
        row = {"H": h, "outer_lr": outer_lr, "outer_momentum": outer_momentum, "seed": args.seed}
        row |= {"compression": args.compression, "fit_bytes": sent[1] - sent[0], "curve": curve}
        print(json.dumps(row))


def end_to_end_job(
    args: argparse.Namespace, c: Any, h: int, setting: str, seed: int, compression: str, extra: dict[str, str]
) -> dict[str, Any]:
    """One end-to-end job of validation_worker on the cluster `c`: rank 0's row."""
    sys.path.insert(0, str(ROOT / "benchmarks" / "collectives"))
    import bench_cluster

    job = ["--worker", "--validate", "--workload", args.workloads[0], "--validate-h", str(h)]
    job += ["--validate-outer", setting, "--seed", str(seed), "--compression", compression]
    job += ["--out", str(args.out), *(["--smoke"] if args.smoke else [])]
    if args.budget:
        job += ["--budget", str(args.budget)]
    result = bench_cluster.run_job(c, f"{WORKERS}x1", "tf", "studies/slow_links.py", job, args.timeout, extra)
    if result["rc"] != 0 or not result["rows"]:
        raise RuntimeError(
            f"end-to-end job failed ({result['rc']}): {result['stderr']}\n{result['stdout_tail']}"
        )
    return dict(result["rows"][0])


def validate_part(args: argparse.Namespace) -> None:
    """The composition checked once: seed 0 of the best Adasum + outer setting at --validate-h, trained
    end to end on the cluster at the first --rates, against steps x the cost part's ms per step."""
    sys.path.insert(0, str(ROOT / "benchmarks" / "collectives"))
    import bench_cluster

    workload, h, rate = args.workloads[0], args.validate_h, args.rates[0]
    budget = args.budget or BUDGET[workload]
    rows = [r for r in _convergence().read_rows(args.out / "accuracy.csv") if r["workload"] == workload]
    row = best_settings([r for r in rows if int(r["budget"]) == budget])[(workload, "adasum_outer", h)]
    target = float(row["target"])
    setting = f"{float(row['outer_lr'])},{float(row['outer_momentum'])}"
    with bench_cluster.cluster.Cluster(hosts=WORKERS, name=bench_cluster.NAME, rate=None) as c:
        c.shape(rate)
        link = bench_cluster.goodput(c)
        extra = {"TF_ADASUM_LINK_GBITS": f"{link / 1000:.2f}"}
        result = end_to_end_job(args, c, h, setting, 0, "none", extra)
    curve = result["curve"]
    reached = next(((step, seconds) for step, seconds, a in curve if a >= target), None)
    costs = [json.loads(line) for line in (args.out / "cost.jsonl").read_text().splitlines()]
    ms = np.mean(
        [
            c["ms"]
            for c in costs
            if (c["rate"], c["workload"], c["method"], c["H"]) == (rate, workload, "adasum_outer", h)
        ]
    )
    out = {
        "rate": rate,
        "goodput_mbit": link,
        "workload": workload,
        "H": h,
        "outer": setting,
        "target": target,
        "study_steps_to_target": row["steps_to_target"],
        "cluster_steps_to_target": reached and reached[0],
        "cluster_seconds_to_target": reached and round(reached[1], 2),
        "composed_seconds": reached and round(reached[0] * ms / 1e3, 2),
        "curve": curve,
    }
    with open(args.out / "validation.jsonl", "a") as f:
        f.write(json.dumps(out) + "\n")
    print(json.dumps({k: v for k, v in out.items() if k != "curve"}), flush=True)


COMPRESSIONS = ["none", "bf16", "fp16"]


def compression_part(args: argparse.Namespace) -> None:
    """Compressed deltas over whole runs: each seed of the best Adasum + outer setting at each
    --compression-hs, trained end to end on the cluster at the first --rates with AdasumCallback's
    compression none, bf16 and fp16 (the deltas cross processes narrowed, the arithmetic in float32):
    steps, seconds and bytes to the target, and the final accuracy. Resumable (OUT/compression.jsonl)."""
    sys.path.insert(0, str(ROOT / "benchmarks" / "collectives"))
    import bench_cluster

    workload, rate = args.workloads[0], args.rates[0]
    budget = args.budget or BUDGET[workload]
    rows = [r for r in _convergence().read_rows(args.out / "accuracy.csv") if r["workload"] == workload]
    rows = [r for r in rows if int(r["budget"]) == budget]
    best = best_settings(rows)
    path = args.out / "compression.jsonl"
    done = set()
    if path.exists():
        for line in path.read_text().splitlines():
            r = json.loads(line)
            done.add((r["workload"], r["rate"], r["H"], r["compression"], r["seed"]))
    with bench_cluster.cluster.Cluster(hosts=WORKERS, name=bench_cluster.NAME, rate=None) as c:
        c.shape(rate)
        link = bench_cluster.goodput(c)
        extra = {"TF_ADASUM_LINK_GBITS": f"{link / 1000:.2f}"}
        for seed in range(args.seeds):
            for h in args.compression_hs:
                row = best[(workload, "adasum_outer", h)]
                target = float(row["target"])
                setting = f"{float(row['outer_lr'])},{float(row['outer_momentum'])}"
                study = next(
                    (
                        r["steps_to_target"]
                        for r in rows
                        if (r["method"], int(r["H"]), int(r["seed"])) == ("adasum_outer", h, seed)
                        and (r["outer_lr"], r["outer_momentum"]) == (row["outer_lr"], row["outer_momentum"])
                    ),
                    None,
                )
                for compression in COMPRESSIONS:
                    if (workload, rate, h, compression, seed) in done:
                        continue
                    result = end_to_end_job(args, c, h, setting, seed, compression, extra)
                    curve = result["curve"]
                    reached = next(((step, sec) for step, sec, a in curve if a >= target), None)
                    out = {
                        "workload": workload,
                        "rate": rate,
                        "goodput_mbit": link,
                        "H": h,
                        "outer": setting,
                        "compression": compression,
                        "seed": seed,
                        "target": target,
                        "study_steps_to_target": study or None,
                        "steps_to_target": reached and reached[0],
                        "seconds_to_target": reached and round(reached[1], 2),
                        "final_accuracy": curve[-1][2],
                        "fit_megabytes": round(result["fit_bytes"] / 2**20, 2),
                        "fit_seconds": round(curve[-1][1], 2),
                        "curve": curve,
                    }
                    with open(path, "a") as f:
                        f.write(json.dumps(out) + "\n")
                    print(json.dumps({k: v for k, v in out.items() if k != "curve"}), flush=True)


def compression_table(out: Path, workload: str) -> list[str]:
    """Per H and compression, over the seeds: steps, seconds and megabytes to the target, final accuracy."""
    path = out / "compression.jsonl"
    if not path.exists():
        return []
    runs: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    for line in path.read_text().splitlines():
        r = json.loads(line)
        if r["workload"] == workload:
            runs.setdefault((r["rate"], r["H"], r["compression"]), []).append(r)
    if not runs:
        return []

    def spread(values: list[float], digits: int) -> str:
        return f"{np.mean(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"

    lines = [
        f"Compressed deltas end to end, {workload}: Adasum + outer, AdasumCallback on 4 namespace hosts",
        "",
        "| link | H | compression | seeds | steps to target (one-process study, uncompressed) "
        "| s to target | final accuracy | MB sent per host in fit | s in fit |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for (rate, h, compression), rs in sorted(
        runs.items(), key=lambda kv: (kv[0][0], kv[0][1], COMPRESSIONS.index(kv[0][2]))
    ):
        reached = [r for r in rs if r["steps_to_target"]]
        steps = [float(r["steps_to_target"]) for r in reached]
        study = [float(r["study_steps_to_target"]) for r in rs if r["study_steps_to_target"]]
        steps_text = spread(steps, 0) if len(reached) == len(rs) else f"{len(reached)} of {len(rs)} seeds"
        study_text = spread(study, 0) if len(study) == len(rs) else f"{len(study)} of {len(rs)} seeds"
        seconds = [float(r["seconds_to_target"]) for r in reached]
        lines.append(
            f"| {rate} ({rs[0]['goodput_mbit']:.0f} Mbit/s) | {h} | {compression} | {len(rs)} "
            f"| {steps_text} ({study_text}) | {spread(seconds, 1) if seconds else '-'} "
            f"| {spread([r['final_accuracy'] for r in rs], 3)} "
            f"| {spread([r['fit_megabytes'] for r in rs], 1)} | {spread([r['fit_seconds'] for r in rs], 1)} |"
        )
    return [*lines, ""]


def cost_part(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks" / "collectives"))
    import bench_cluster

    cluster = bench_cluster.cluster
    with cluster.Cluster(hosts=WORKERS, name=bench_cluster.NAME, rate=None) as c:
        for rate in args.rates:
            c.shape(rate)
            link = bench_cluster.goodput(c)
            for workload in args.workloads:
                extra = {"TF_ADASUM_LINK_GBITS": f"{link / 1000:.2f}"}
                job = [
                    "--worker",
                    "--workload",
                    workload,
                    "--rounds",
                    str(args.rounds),
                    "--hs",
                    *map(str, args.hs),
                    "--cost-compressions",
                    *args.cost_compressions,
                    *(["--cost-methods", *args.cost_methods] if args.cost_methods else []),
                ]
                job += ["--out", str(args.out), *(["--smoke"] if args.smoke else [])]
                result = bench_cluster.run_job(
                    c, f"{WORKERS}x1", "tf", "studies/slow_links.py", job, args.timeout, extra
                )
                if result["rc"] != 0 or not result["rows"]:
                    raise RuntimeError(
                        f"cost job {rate} {workload} failed ({result['rc']}): {result['stderr']}\n"
                        + result["stdout_tail"]
                    )
                with open(args.out / "cost.jsonl", "a") as f:
                    for row in result["rows"]:
                        full = {"rate": rate, "goodput_mbit": link, "workload": workload, **row}
                        f.write(json.dumps(full) + "\n")
                        print(json.dumps(full), flush=True)
                print(f"# cost {rate} {workload}: {result['seconds']} s", file=sys.stderr, flush=True)


def cores_worker(args: argparse.Namespace) -> None:
    """One process of the cores part: --workload's fit step, no sync, ms per step over whole steps."""
    import keras

    x, y, _, _ = workload_data(args.workload, args.smoke, args.out)
    warmup, measured = (2, 4) if args.smoke else (8, 64)
    idx = np.arange((warmup + measured) * LOCAL_BATCH) % len(y)
    model = make_model(args.workload)
    compile_model(model, INNER_LR[args.workload])
    marks: dict[int, float] = {}

    class Marks(keras.callbacks.Callback):
        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            if batch + 1 == warmup and args.cores_barrier is not None:
                together(args.cores_barrier, args.cores_count)
            if batch + 1 in (warmup, warmup + measured):
                marks[batch + 1] = time.perf_counter()

    model.fit(x[idx], y[idx], batch_size=LOCAL_BATCH, shuffle=False, verbose=0, callbacks=[Marks()])
    print(json.dumps({"ms": 1e3 * (marks[warmup + measured] - marks[warmup]) / measured}), flush=True)


def together(folder: Path, count: int, seconds: float = 300) -> None:
    """Waits until `count` processes have reached this point (a file each in `folder`): the processes of
    a cores round measure the same steps at once, whatever their start took."""
    (folder / str(os.getpid())).touch()
    deadline = time.monotonic() + seconds
    while len(list(folder.iterdir())) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(list(folder.iterdir()))} of {count} processes reached {folder}")
        time.sleep(0.01)


def cores_part(args: argparse.Namespace) -> None:
    """The local step in one process alone and in WORKERS processes at once, in alternating rounds:
    OUT/cores.jsonl, a row per workload, round and number of processes with each process's ms."""
    import subprocess
    import tempfile

    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    for workload in args.workloads:
        for round_ in range(args.rounds):
            for processes in (1, WORKERS):
                barrier = Path(tempfile.mkdtemp(prefix="cores-"))
                command = [sys.executable, __file__, "--cores-worker", "--workload", workload]
                command += ["--cores-barrier", str(barrier), "--cores-count", str(processes)]
                command += ["--out", str(args.out), *(["--smoke"] if args.smoke else [])]
                pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, "env": env}
                jobs = [subprocess.Popen(command, **pipes) for _ in range(processes)]
                ms = []
                try:
                    for job in jobs:
                        out, err = job.communicate(timeout=args.timeout)
                        if job.returncode != 0:
                            raise RuntimeError(f"cores {workload}: exit {job.returncode}: {err[-2000:]}")
                        ms.append(json.loads(out.strip().splitlines()[-1])["ms"])
                finally:
                    for job in jobs:
                        job.kill()
                    for mark in barrier.iterdir():
                        mark.unlink()
                    barrier.rmdir()
                row = {"workload": workload, "round": round_, "processes": processes, "ms": ms}
                with open(args.out / "cores.jsonl", "a") as f:
                    f.write(json.dumps(row) + "\n")
                print(json.dumps(row), flush=True)


def cores_table(
    out: Path, workload: str, results: list[dict[str, Any]], costs: dict[tuple[str, str, str, int], Any]
) -> list[str]:
    """The cores part's measure, and the 100 Mbit/s times composed with a host's cores to itself: each
    method's measured ms per step less what the cluster's shared cores add to a local step, the
    cluster's "local" step (fit with no sync, the slowest process's) less one process's alone; without
    cost rows of "local", the slowest of 4 processes at once here less one alone. What the cluster's step
    holds besides (the syncs, the callback, a window's wait for the slowest) is kept. The ratio is given
    for the mean excess and, in brackets, for each round's."""
    path = out / "cores.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    alone = [r["ms"][0] for r in rows if r["workload"] == workload and r["processes"] == 1]
    shared = [r["ms"] for r in rows if r["workload"] == workload and r["processes"] == WORKERS]
    rate = "100mbit"
    mine = [r for r in results if r["workload"] == workload and f"seconds_{rate}" in r]
    mwms = next((r for r in mine if r["method"] == "mwms"), None)
    if not alone or not shared or mwms is None:
        return []
    rounds = [max(ms) for ms in shared]
    lines = [
        f"The local step of {workload} with the cores shared ({len(alone)} rounds): {np.mean(alone):.1f} ms "
        f"in one process alone, {np.mean([np.mean(ms) for ms in shared]):.1f} ms on average and "
        f"{np.mean(rounds):.1f} ms for the slowest of {WORKERS} at once."
    ]
    local = costs.get((rate, workload, "local", 1))
    if local:
        rounds = [m["ms"] for m in local]
        lines[0] += (
            f" On the cluster at {rate}, fit with no sync took {np.mean(rounds):.1f} ms (the slowest "
            f"process; rounds {', '.join(f'{m:.1f}' for m in rounds)})."
        )
    excesses = [m - float(np.mean(alone)) for m in rounds]
    excess = float(np.mean(excesses))
    lines[0] += f" Composed at {rate}, each measured step {excess:.1f} ms shorter (a host's cores to itself):"
    lines += [
        "",
        "| method | H | steps to target | ms per step, cluster | x MWMS, cluster | ms per step, composed "
        "| x MWMS, composed (each round's excess) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]

    def ms_of(r: dict[str, Any]) -> float:
        return float(np.mean([m["ms"] for m in costs[(rate, workload, r["method"], r["H"])]]))

    def ratio(r: dict[str, Any], less: float) -> float:
        mine, theirs = np.mean(r["steps"]) * (ms_of(r) - less), np.mean(mwms["steps"]) * (ms_of(mwms) - less)
        return float(mine / theirs)

    for r in mine:
        steps, ms = float(np.mean(r["steps"])), ms_of(r)
        each = [ratio(r, less) for less in excesses]
        lines.append(
            f"| {LABELS[r['method']]} | {r['H']} | {steps:.0f} | {ms:.1f} | {ratio(r, 0.0):.2f} "
            f"| {ms - excess:.1f} | {ratio(r, excess):.2f} ({min(each):.2f}-{max(each):.2f}) |"
        )
    return [*lines, ""]


# ----------------------------------------------------------------------------------------------- report


LABELS = {
    "mwms": "MWMS every step (tuned rate)",
    "adasum": "Adasum every H",
    "adasum_outer": "Adasum every H + outer",
    "mean_outer": "mean every H + outer (DiLoCo)",
}


def orthogonality_table(out: Path, workload: str) -> list[str]:
    """Per H, the best Adasum + outer run's orthogonality: its mean over variables and syncs, and the
    range of its kernels' means (1: orthogonal deltas, Adasum adds them; 1/4: equal deltas)."""
    rows = [r for r in _convergence().read_rows(out / "orthogonality.csv") if r["workload"] == workload]
    if not rows:
        return []
    lines = [
        "Orthogonality of the 4 workers' deltas at the syncs (seed 0, the best Adasum + outer setting):",
        "",
        "| H | outer (lr, momentum) | mean: whole run (first quarter, last quarter) | kernels' means |",
        "| --- | --- | --- | --- |",
    ]
    for h in sorted({int(r["H"]) for r in rows}):
        mine = [r for r in rows if int(r["H"]) == h]
        overall = next(r for r in mine if r["variable"] == "orthogonality")
        kernels = [float(r["mean"]) for r in mine if r["variable"].endswith("kernel")]
        lines.append(
            f"| {h} | {float(overall['outer_lr']):g}, {float(overall['outer_momentum']):g} "
            f"| {float(overall['mean']):.2f} ({float(overall['first_quarter']):.2f}, "
            f"{float(overall['last_quarter']):.2f}) | {min(kernels):.2f}-{max(kernels):.2f} |"
        )
    return [*lines, ""]


def grid_table(rows: list[dict[str, Any]]) -> list[str]:
    """Seed 0 of every setting tried: steps to the target (final accuracy), a column per H."""
    hs = sorted({int(r["H"]) for r in rows if r["method"] != "one"})
    cells: dict[tuple[str, str], dict[int, str]] = {}
    for r in rows:
        if r["method"] == "one" or int(r["seed"]) != 0:
            continue
        if r["method"] == "mwms":
            setting = f"inner lr {float(r['inner_lr']):g}"
        elif r["method"] == "adasum":
            setting = "-"
        else:
            setting = f"{float(r['outer_lr']):g}, {float(r['outer_momentum']):g}"
        reached = steps_or_inf(r)
        text = f"{reached:.0f}" if math.isfinite(reached) else "never"
        cells.setdefault((r["method"], setting), {})[int(r["H"])] = (
            f"{text} ({float(r['final_accuracy']):.3f})"
        )
    lines = [
        "Every setting on seed 0: steps to the target (final accuracy)",
        "",
        "| method | outer (lr, momentum) | " + " | ".join(f"H = {h}" for h in hs) + " |",
        "| --- | --- |" + " --- |" * len(hs),
    ]
    for (method, setting), by_h in sorted(
        cells.items(), key=lambda kv: (list(LABELS).index(kv[0][0]), kv[0][1])
    ):
        lines.append(f"| {LABELS[method]} | {setting} | " + " | ".join(by_h.get(h, "") for h in hs) + " |")
    return lines


def accuracy_table(
    workload: str,
    mine: list[dict[str, Any]],
    ones: list[dict[str, Any]],
    costs: dict[tuple[str, str, str, int], list[dict[str, float]]],
    goodputs: dict[str, float],
    results: list[dict[str, Any]],
    heading: str | None = None,
) -> list[str]:
    """The study's main table of one workload: each method's best setting at each H over the seeds, its
    steps and final accuracy, and its time, bytes and ratio to MWMS's on each link; `results` gets the
    plots' points. Under `heading`, where given, instead of the workload's with its target."""
    lines: list[str] = []
    best = best_settings(mine)
    target = (
        float(next(r for r in mine if r["target"] not in ("", None))["target"])
        if len(mine) > len(ones)
        else None
    )
    lines += [
        heading
        or f"## {workload}: target {target} (one worker's final accuracy "
        f"{np.mean([float(r['final_accuracy']) for r in ones]):.4f}, {len(ones)} seeds, floored)",
        "",
    ]
    header = "| method | H | inner lr | outer (lr, momentum) | seeds | steps to target | final accuracy |"
    rates = sorted(goodputs, key=lambda r: goodputs[r])
    for rate in rates:
        header += f" s to target, {rate} | MB/host to target, {rate} | x MWMS, {rate} |"
    lines += [header, "|" + " --- |" * (header.count("|") - 1)]
    mwms_time: dict[str, float] = {}
    for (_, method, h), row in sorted(
        best.items(),
        key=lambda kv: (list(LABELS).index(kv[0][1]) if kv[0][1] in LABELS else -1, kv[0][2]),
    ):
        if method not in LABELS:
            continue
        setting = (row["inner_lr"], row["outer_lr"], row["outer_momentum"])
        runs = [
            r
            for r in mine
            if (r["method"], int(r["H"])) == (method, h)
            and (r["inner_lr"], r["outer_lr"], r["outer_momentum"]) == setting
        ]
        steps = [steps_or_inf(r) for r in runs]
        finals = [float(r["final_accuracy"]) for r in runs]
        reached = all(math.isfinite(s) for s in steps)
        outer_text = (
            "-"
            if method in ("mwms", "adasum")
            else f"{float(row['outer_lr']):g}, {float(row['outer_momentum']):g}"
        )
        steps_text = (
            f"{np.mean(steps):.0f} ({min(steps):.0f}-{max(steps):.0f})"
            if reached
            else f"reached in {sum(map(math.isfinite, steps))} of {len(steps)} seeds"
        )
        cells = (
            f"| {LABELS[method]} | {h} | {float(row['inner_lr']):g} | {outer_text} | {len(runs)} "
            f"| {steps_text} "
            f"| {np.mean(finals):.3f} ({min(finals):.3f}-{max(finals):.3f}) |"
        )
        result = {"workload": workload, "method": method, "H": h, "steps": steps, "final": finals}
        for rate in rates:
            measured = costs.get((rate, workload, method, h))
            if not measured or not reached:
                cells += " - | - | - |"
                continue
            ms = float(np.mean([m["ms"] for m in measured]))
            per_step_bytes = float(np.mean([m["bytes"] for m in measured]))
            seconds = [s * ms / 1e3 for s in steps]
            if method == "mwms":
                mwms_time[rate] = float(np.mean(seconds))
            ratio = float(np.mean(seconds)) / mwms_time[rate] if rate in mwms_time else math.nan
            result[f"seconds_{rate}"] = seconds
            cells += (
                f" {np.mean(seconds):.1f} ({min(seconds):.1f}-{max(seconds):.1f}) "
                f"| {np.mean(steps) * per_step_bytes / 2**20:.1f} | {ratio:.2f} |"
            )
        lines.append(cells)
        results.append(result)
    return lines


def report(args: argparse.Namespace) -> str:
    rows = _convergence().read_rows(args.out / "accuracy.csv")
    costs: dict[tuple[str, str, str, int], list[dict[str, float]]] = {}
    goodputs: dict[str, float] = {}
    if (args.out / "cost.jsonl").exists():
        for line in (args.out / "cost.jsonl").read_text().splitlines():
            c = json.loads(line)
            costs.setdefault((c["rate"], c["workload"], c["method"], int(c["H"])), []).append(c)
            goodputs.setdefault(c["rate"], c["goodput_mbit"])  # the first job's measure of the link
    lines = []
    results: list[dict[str, Any]] = []
    for workload in args.workloads:
        budget = args.budget or BUDGET[workload]
        mine = [r for r in rows if r["workload"] == workload and int(r["budget"]) == budget]
        ones = [r for r in mine if r["method"] == "one"]
        if ones:
            lines += accuracy_table(workload, mine, ones, costs, goodputs, results)
            lines += ["", *grid_table(mine), "", *orthogonality_table(args.out, workload)]
            lines += compression_table(args.out, workload)
            lines += cores_table(args.out, workload, results, costs)
            lines += workers_table(args.out, workload, budget)
            tuned = [
                r
                for r in _convergence().read_rows(args.out / "inner.csv")
                if r["workload"] == workload and int(r["budget"]) == budget
            ]
            if tuned:
                times = sorted({float(r["inner_lr"]) / INNER_LR[workload] for r in tuned})
                heading = (
                    f"The local methods at a tuned inner rate, {workload} (the one-worker rate "
                    f"{INNER_LR[workload]:g} times {', '.join(f'{m:g}' for m in times)}; each method's "
                    "outer step as above; MWMS at its tuned rate, as above):"
                )
                mwms = [r for r in mine if r["method"] == "mwms"]
                lines += accuracy_table(workload, [*ones, *mwms, *tuned], ones, costs, goodputs, [], heading)
                lines.append("")
        cost_lines = [
            "| link | method | H | ms per step (rounds) | KB sent per step per host |",
            "| --- | --- | --- | --- | --- |",
        ]
        for (rate, w, method, h), measured in sorted(costs.items()):
            if w == workload:
                ms = [m["ms"] for m in measured]
                cost_lines.append(
                    f"| {rate} ({goodputs[rate]:.0f} Mbit/s) | {method} | {h} | {np.mean(ms):.1f} "
                    f"({', '.join(f'{m:.1f}' for m in ms)}) "
                    f"| {np.mean([m['bytes'] for m in measured]) / 1024:.0f} |"
                )
        if len(cost_lines) > 2:
            lines += [f"Measured step costs, {workload}, 4 namespace hosts:", "", *cost_lines, ""]
    text = "\n".join(lines)
    (args.out / "table.md").write_text(text + "\n")
    rates = sorted(goodputs, key=lambda r: goodputs[r])
    plot(args, results, rates)
    if rates:
        plot_curves(args, rows, costs, rates[0])
    return text


# The curves plotted: MWMS and Adasum every step, and each way of syncing every 16 steps.
CURVES = {("mwms", 1), ("adasum", 1), ("adasum", 16), ("adasum_outer", 16), ("mean_outer", 16)}


def plot_curves(
    args: argparse.Namespace,
    rows: list[dict[str, Any]],
    costs: dict[tuple[str, str, str, int], list[dict[str, float]]],
    rate: str,
) -> None:
    """Held-out accuracy against the wall time on the slowest link, seed 0 of each method's best setting
    at H = 1 and 16: the figure a user chooses by."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = args.out / "curves.jsonl"
    if not path.exists():
        return
    curves = {setting_key(c): c for c in map(json.loads, path.read_text().splitlines())}
    workloads = [w for w in args.workloads if any(r["workload"] == w for r in rows)]
    figure, panels = plt.subplots(1, len(workloads), figsize=(6 * len(workloads), 4.2), squeeze=False)
    for panel, workload in zip(panels[0], workloads, strict=True):
        budget = args.budget or BUDGET[workload]
        best = best_settings([r for r in rows if r["workload"] == workload and int(r["budget"]) == budget])
        target = None
        for (_, method, h), row in sorted(best.items()):
            if (method, h) not in CURVES:
                continue
            curve = curves.get(setting_key(row))
            measured = costs.get((rate, workload, method, h))
            if curve is None or not measured:
                continue
            ms = float(np.mean([m["ms"] for m in measured]))
            steps, accuracy = zip(*curve["curve"], strict=True)
            label = f"{LABELS[method]}, H = {h}" if method != "mwms" else LABELS[method]
            panel.plot(np.multiply(steps, ms / 1e3), accuracy, label=label)
            target = float(row["target"]) if row["target"] not in ("", None) else target
        if target is not None:
            panel.axhline(target, color="grey", linestyle=":", linewidth=1, label="one-worker accuracy")
        panel.set_xscale("log")
        panel.set_xlabel(f"seconds on 4 hosts at {rate} (steps x measured ms per step)")
        panel.set_ylabel("held-out accuracy (seed 0)")
        panel.set_title(workload)
        panel.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(args.out / "curves.png", dpi=110)
    if args.out == OUT:  # the published run's: the docs site shows it
        figure.savefig(ROOT / "docs" / "training" / "slow-links-curves.png", dpi=110)
    plt.close(figure)


def plot(args: argparse.Namespace, results: list[dict[str, Any]], rates: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not rates or not results:
        return
    workloads = sorted({r["workload"] for r in results})
    figure, panels = plt.subplots(
        len(workloads), len(rates), figsize=(5 * len(rates), 3.8 * len(workloads)), squeeze=False
    )
    for i, workload in enumerate(workloads):
        for j, rate in enumerate(rates):
            panel = panels[i][j]
            for method, color in zip(LABELS, ("black", "tab:red", "tab:blue", "tab:green"), strict=True):
                points = [
                    (
                        r["H"],
                        np.mean(r[f"seconds_{rate}"]),
                        min(r[f"seconds_{rate}"]),
                        max(r[f"seconds_{rate}"]),
                    )
                    for r in results
                    if r["workload"] == workload and r["method"] == method and f"seconds_{rate}" in r
                ]
                if not points:
                    continue
                if method == "mwms":
                    panel.axhline(points[0][1], color=color, linestyle=":", label=LABELS[method])
                    continue
                hs, means, lows, highs = zip(*sorted(points), strict=True)
                panel.errorbar(
                    hs,
                    means,
                    yerr=[np.subtract(means, lows), np.subtract(highs, means)],
                    fmt="-o",
                    color=color,
                    label=LABELS[method],
                    capsize=3,
                )
            panel.set_xscale("log", base=2)
            panel.set_yscale("log")
            panel.set_xlabel("H (local steps per sync)")
            panel.set_ylabel("seconds to the one-worker accuracy")
            panel.set_title(f"{workload}, 4 hosts at {rate}")
            panel.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(args.out / "time_to_target.png", dpi=110)
    if args.out == OUT:  # the published run's: the docs site shows it beside the recommendation
        figure.savefig(ROOT / "docs" / "training" / "slow-links-time-to-target.png", dpi=110)
    plt.close(figure)


# ------------------------------------------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--parts",
        nargs="+",
        default=["accuracy", "orthogonality", "cost", "report"],
        choices=[
            "accuracy",
            "orthogonality",
            "workers",
            "inner",
            "cost",
            "validate",
            "compression",
            "cores",
            "report",
        ],
    )
    parser.add_argument(
        "--workloads", nargs="+", default=["cnn", "transformer"], choices=["cnn", "transformer"]
    )
    parser.add_argument("--hs", type=int, nargs="+", default=HS)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument(
        "--budget", type=int, default=None, help=f"steps per worker, a multiple of every H (default {BUDGET})"
    )
    parser.add_argument("--mwms-multipliers", type=float, nargs="+", default=[1, 2, 4, 8])
    setting = lambda text: tuple(map(float, text.split(",")))  # noqa: E731
    parser.add_argument(
        "--outer-grid", type=setting, nargs="+", default=OUTER_GRID, help="mean_outer's: LR,MOMENTUM ..."
    )
    parser.add_argument(
        "--adasum-outer-grid", type=setting, nargs="+", default=ADASUM_OUTER_GRID, help="adasum_outer's"
    )
    parser.add_argument("--rates", nargs="+", default=["100mbit", "1gbit"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--timeout", type=int, default=900, help="seconds per cost job")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--smoke", action="store_true", help="every part, tiny")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--validate", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cores-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cores-barrier", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--cores-count", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--validate-h", type=int, default=64, help="validate: the H of the end-to-end run")
    parser.add_argument("--validate-outer", type=setting, default=(0.5, 0.5), help=argparse.SUPPRESS)
    parser.add_argument("--workload", default="cnn", help=argparse.SUPPRESS)
    parser.add_argument(
        "--compression-hs", type=int, nargs="+", default=[16, 64], help="compression: the Hs run end to end"
    )
    parser.add_argument(
        "--workers-counts", type=int, nargs="+", default=[2, 8], help="workers: the numbers of workers"
    )
    parser.add_argument("--workers-hs", type=int, nargs="+", default=[16, 64], help="workers: the Hs")
    parser.add_argument("--inner-hs", type=int, nargs="+", default=[16, 64], help="inner: the Hs")
    parser.add_argument(
        "--inner-multipliers", type=float, nargs="+", default=[2, 4], help="inner: of the one-worker rate"
    )
    parser.add_argument(
        "--cost-compressions",
        nargs="*",
        default=[],
        choices=COMPRESSIONS[1:],
        help="cost: also Adasum every H with its deltas narrowed to these on the wire",
    )
    parser.add_argument(
        "--cost-methods",
        nargs="+",
        default=None,
        help="cost: only these of mwms, local (fit with no sync), adasum, adasum_outer, mean_outer, ...",
    )
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--compression", default="none", choices=COMPRESSIONS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.path.insert(0, str(ROOT))
    if args.worker:
        (validation_worker if args.validate else worker)(args)
        return 0
    if args.cores_worker:
        cores_worker(args)
        return 0
    methods = {"mwms", "local", "adasum", "adasum_outer", "mean_outer"}
    methods |= {f"adasum_{wire}" for wire in args.cost_compressions}
    if args.cost_methods is not None and not set(args.cost_methods) <= methods:
        parser.error(f"--cost-methods: no such method {sorted(set(args.cost_methods) - methods)}")
    if args.smoke:
        args.hs, args.seeds, args.budget, args.rounds = [4], 2, 16, 1
        args.mwms_multipliers, args.outer_grid, args.rates = [1, 2], [(0.5, 0.0)], ["100mbit"]
        args.adasum_outer_grid, args.compression_hs = args.outer_grid, [4]
        args.workers_counts, args.workers_hs = [2], [4]
        args.inner_hs, args.inner_multipliers = [4], [2]
        args.out = args.out.with_name(args.out.name + "_smoke")
    for budget in {args.budget or BUDGET[w] for w in args.workloads}:
        uneven = [h for h in args.hs if budget % max(h, 8)]
        if uneven:
            parser.error(f"a budget of {budget} steps is not a multiple of max(H, 8) for H in {uneven}")
    args.out.mkdir(parents=True, exist_ok=True)
    if "accuracy" in args.parts:
        accuracy_part(args)
    if "orthogonality" in args.parts:
        orthogonality_part(args)
    if "workers" in args.parts:
        workers_part(args)
    if "inner" in args.parts:
        inner_part(args)
    if "cost" in args.parts:
        cost_part(args)
    if "validate" in args.parts:
        validate_part(args)
    if "compression" in args.parts:
        compression_part(args)
    if "cores" in args.parts:
        cores_part(args)
    print(report(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
