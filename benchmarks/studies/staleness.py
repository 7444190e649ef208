"""Stale updates and accumulation: the hybrid asynchronous SGD of "Making Asynchronous Stochastic
Gradient Descent Work for Transformers" (Aji and Heafield, 2019), with Adasum as a third accumulator.

The paper's parameter server runs the one optimizer (Adam's moments live there). Workers pull the
weights, compute a gradient, and push it; by the time it arrives the server has updated `s` times, so
it is `s` updates stale (N equal-speed workers: s = N - 1). Its fix, global accumulation, has the
server wait for k gradients and take one optimizer step on their sum; that raises the batch and lowers
the staleness (k = N workers: (N - 1)/N on average). This simulates that server in one process:

- modes (the paper's Table 3 rows, with k = 4 as its 4 GPUs):
    async          every pushed gradient is one optimizer step;
    local          each worker sums k gradients of its pulled weights before it pushes (Ott et al.);
    global         the server waits for k pushed gradients and steps once on their sum;
    global_adasum  as global, but the k gradients are combined by tf_adasum.adasum_tree, the product's
                   contract tree, instead of summed: Adasum of raw gradients, then the server's one
                   optimizer (a parameter server holds the only optimizer state, so Adasum cannot go
                   after it here as AdasumStrategy puts it);
- staleness: every pushed gradient was computed on the weights of `s` server updates ago, with `s`
  constant or drawn per push, uniformly from 0..2s (mean s). With a constant s, local and global are
  the same run (k gradients of the same weights, one mean), so local runs only with drawn staleness;
- the paper's setting, "round_robin" with s = N - 1: N = k equal-speed workers taking turns. Async and
  local pushes are then N - 1 updates stale (the constant-s runs), and of every k pushes that global
  accumulation combines, k - 1 are 1 update stale and one is fresh: the paper's mean of 0.75 at N = 4;
- "sum" is the sum scaled by 1/k, the mean, as MirroredStrategy does: with staleness 0, global is
  exactly synchronous SGD over k replicas and global_adasum exactly synchronous Adasum of the k
  gradients before the optimizer (convergence.py's adasum_before; Horovod's DistributedOptimizer with
  op=Adasum combines gradients too), which tests/test_staleness.py checks against
  benchmarks/studies/convergence.py's replicas. Adam cannot see the 1/k; for SGD the learning-rate sweep
  absorbs it.

Two experiments, each over a learning-rate sweep (the paper's Table 1) and several seeds, with the
same number of examples for every mode, so a mode with k-gradient steps takes k times fewer steps:
- cnn: the convergence study's LeNet-like CNN on digits, momentum SGD (0.9);
- transformer: a 2-layer Transformer encoder classifier (18k parameters) with Adam (beta_2 = 0.98,
  as the paper), on a task generated here: the first of 12 tokens is a position p, and the label is
  the token at p, which needs attention to a position chosen by content.

Usage:
    python benchmarks/studies/staleness.py                    # the full grid, resumable from its CSV
    python benchmarks/studies/staleness.py --smoke            # seconds: every mode once, tiny
    python benchmarks/studies/staleness.py --experiments transformer --staleness 0 3 --seeds 1

Writes OUT/results.csv (one row per run), OUT/accuracy_vs_staleness.png and
OUT/accuracy_vs_learning_rate.png, and prints the table.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks" / "studies"))

import convergence  # noqa: E402  (imports tf_adasum first: a quiet TensorFlow start)

# isort: split
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_adasum  # noqa: E402
from tf_adasum.demo import augmented_digits  # noqa: E402

BATCH = 32
ACCUMULATE = 4  # the paper's k: its 4 GPUs


@dataclass(frozen=True)
class Mode:
    local: int  # gradients a worker sums before it pushes
    accumulate: int  # pushed gradients the server combines into one optimizer step
    combine: str  # how the server combines them: "sum" (scaled by 1/k) or "adasum"


def modes(k: int = ACCUMULATE) -> dict[str, Mode]:
    return {
        "async": Mode(1, 1, "sum"),
        "local": Mode(k, 1, "sum"),
        "global": Mode(1, k, "sum"),
        "global_adasum": Mode(1, k, "adasum"),
    }


class Server:
    """The parameter server: the weights (`model`), their last versions, and the one optimizer.

    A worker's gradient is computed on a second copy of the model (`worker`) loaded with the version
    it pulled; gradients pulled at the same version are computed in one vectorised pass.
    """

    def __init__(
        self, model: keras.Model, worker: keras.Model, optimizer: Any, mode: Mode, keep: int
    ) -> None:
        self.model, self.worker, self.optimizer, self.mode = model, worker, optimizer, mode
        self.optimizer.build(model.trainable_variables)
        self.versions: deque[list[tf.Tensor]] = deque(maxlen=keep + 1)
        self.versions.append([tf.identity(v.value) for v in model.trainable_variables])
        self._gradients_at = tf.function(self._gradients_at_fn)
        self._update = tf.function(self._update_fn, reduce_retracing=True)

    def _gradients_at_fn(self, version: list[tf.Tensor], x: tf.Tensor, y: tf.Tensor) -> list[tf.Tensor]:
        for variable, value in zip(self.worker.trainable_variables, version, strict=True):
            variable.assign(value)
        return convergence.stacked_gradients(self.worker, x, y)

    def _update_fn(self, groups: list[list[tf.Tensor]], order: tf.Tensor) -> list[tf.Tensor]:
        """Puts the groups' gradients back in push order, combines and applies them; returns the new
        version of the weights."""
        pushes = self.mode.accumulate
        combined = []
        for parts in zip(*groups, strict=True):
            grads = tf.gather(tf.concat(parts, 0), order) if len(parts) > 1 else parts[0]
            combined.append(tf.reshape(grads, [pushes, self.mode.local, *grads.shape[1:]]))
        per_push = [tf.reduce_mean(g, 1) for g in combined]
        if self.mode.combine == "adasum" and pushes > 1:
            update = tf_adasum.adasum_tree([[g[j] for g in per_push] for j in range(pushes)])
        else:
            update = [tf.reduce_mean(g, 0) for g in per_push]
        self.optimizer.apply(update, self.model.trainable_variables)
        # Reading a variable shares its buffer until the next update writes it, which then copies.
        return [tf.identity(v.value) for v in self.model.trainable_variables]

    def step(self, x: tf.Tensor, y: tf.Tensor, staleness: Sequence[int]) -> list[int]:
        """One optimizer step from `accumulate` pushes; push j was pulled `staleness[j]` updates ago
        and carries `local` gradients, of x[j * local + i], y[j * local + i]. Returns the staleness
        each push really had (at the start there are fewer versions to be stale by)."""
        local, kept = self.mode.local, self.versions.maxlen - 1
        if len(staleness) != self.mode.accumulate or max(staleness) > kept:
            raise ValueError(
                f"expected {self.mode.accumulate} staleness values of at most {kept} (the versions "
                f"kept), got {list(staleness)}"
            )
        ages = [min(s, len(self.versions) - 1) for s in staleness]
        groups, rows = [], []
        for age in sorted(set(ages)):
            mine = [j * local + i for j, a in enumerate(ages) if a == age for i in range(local)]
            if len(mine) < len(x):
                xs, ys = tf.gather(x, mine), tf.gather(y, mine)
            else:
                xs, ys = x, y
            groups.append(self._gradients_at(self.versions[-1 - age], xs, ys))
            rows += mine
        self.versions.append(self._update(groups, tf.constant(np.argsort(rows), tf.int32)))
        return ages


def draw_staleness(rng: np.random.Generator, s: int, draw: str, count: int) -> list[int]:
    """The staleness of the `count` pushes of one update."""
    if draw == "constant" or (draw == "round_robin" and count == 1):
        return [s] * count
    if draw == "round_robin":  # s + 1 workers in turn, the server waiting for one push from each
        if count != s + 1:
            raise ValueError(f"round_robin: {s + 1} workers take turns, so accumulate {s + 1}, not {count}")
        return [1] * s + [0]
    return [int(a) for a in rng.integers(0, 2 * s + 1, count)]


# --- the experiments ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Experiment:
    model: Callable[[], keras.Model]
    optimizer: Callable[[Any], keras.optimizers.Optimizer]
    peak: float  # the base peak learning rate: one replica, no staleness (tuned once, see README)
    epochs: float


EXPERIMENTS = {
    "cnn": Experiment(convergence.make_model, lambda rate: keras.optimizers.SGD(rate, momentum=0.9), 0.01, 3),
    "transformer": Experiment(
        convergence.make_transformer,
        lambda rate: keras.optimizers.Adam(rate, beta_1=0.9, beta_2=0.98, epsilon=1e-9),
        0.003,
        3,
    ),
}


def load_data(name: str, out: Path, smoke: bool) -> tuple[np.ndarray, ...]:
    if name == "cnn":
        if smoke:
            return augmented_digits(out / "digits16_smoke.npz", copies=2, validation_copies=1)
        return augmented_digits(ROOT / "demo_output" / "digits16_held_out.npz")
    count = 2_000 if smoke else 20_000
    return convergence.pointer_data(count)


def batches(
    x: np.ndarray, y: np.ndarray, per_update: int, total: int, rng: np.random.Generator
) -> Iterator[tuple[tf.Tensor, tf.Tensor]]:
    """`total` updates' worth of [per_update, BATCH, ...] batches, each epoch in a new order."""
    per_epoch = len(y) // (per_update * BATCH)
    if per_epoch == 0:
        raise ValueError(f"{len(y)} examples make no update of {per_update} batches of {BATCH}")
    done = 0
    while done < total:
        order = rng.permutation(len(y))[: per_epoch * per_update * BATCH]
        xs = tf.constant(x[order].reshape(per_epoch, per_update, BATCH, *x.shape[1:]))
        ys = tf.constant(y[order].reshape(per_epoch, per_update, BATCH))
        for i in range(min(per_epoch, total - done)):
            yield xs[i], ys[i]
            done += 1


def run(
    data: tuple[np.ndarray, ...],
    experiment: str,
    mode_name: str,
    staleness: int,
    draw: str,
    multiplier: float,
    seed: int,
    epochs: float,
    k: int = ACCUMULATE,
) -> dict[str, Any]:
    """One training run; returns its CSV row."""
    spec, mode = EXPERIMENTS[experiment], modes(k)[mode_name]
    x, y, x_val, y_val = data
    per_update = mode.local * mode.accumulate
    total = max(1, int(len(y) // (per_update * BATCH) * epochs))
    keras.utils.set_random_seed(seed)
    model = spec.model()
    server = Server(
        model,
        spec.model(),
        spec.optimizer(convergence.WarmupLinearDecay(spec.peak * multiplier, total)),
        mode,
        keep=2 * staleness,
    )
    rng = np.random.default_rng(seed)
    stale = np.random.default_rng([seed, staleness])
    start, ages = time.perf_counter(), []
    for xs, ys in batches(x, y, per_update, total, rng):
        ages += server.step(xs, ys, draw_staleness(stale, staleness, draw, mode.accumulate))
    return {
        "experiment": experiment,
        "mode": mode_name,
        "k": k,
        "staleness": staleness,
        "draw": draw,
        "multiplier": multiplier,
        "seed": seed,
        "epochs": epochs,
        "peak": spec.peak,
        "accuracy": round(convergence.accuracy(model, x_val, y_val), 4),
        "updates": total,
        "mean_staleness": round(float(np.mean(ages)), 3),
        "seconds": round(time.perf_counter() - start, 1),
    }


FIELDS = [
    "experiment",
    "mode",
    "k",
    "staleness",
    "draw",
    "multiplier",
    "seed",
    "epochs",
    "peak",
    "accuracy",
    "updates",
    "mean_staleness",
    "seconds",
]
KEY = ["experiment", "mode", "k", "staleness", "draw", "multiplier", "seed", "epochs", "peak"]


def key(row: dict[str, Any]) -> tuple[str, ...]:
    return tuple(f"{float(row[f]):g}" if f in ("multiplier", "epochs", "peak") else str(row[f]) for f in KEY)


DRAWS = ("constant", "uniform", "round_robin")


def settings(stalenesses: Sequence[int], drawn: Sequence[int]) -> list[tuple[int, str]]:
    return [(s, "constant") for s in stalenesses] + [(s, "uniform") for s in drawn]


def grid(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every run to do, as CSV keys. With a constant staleness, local is global's run (the same k
    gradients of the same weights, the same mean), so it runs only with drawn staleness: there a
    local push has one draw for its k gradients, and global's k pushes one each."""
    cells = []
    for experiment in args.experiments:
        for s, draw in settings(args.staleness, args.drawn):
            for mode in modes(args.k):
                if draw == "constant" and mode == "local":
                    continue
                cells.append((experiment, mode, s, draw))
        if args.round_robin:  # async and local there are the constant runs at s = k - 1
            cells += [(experiment, mode, args.k - 1, "round_robin") for mode in ("global", "global_adasum")]
    return [
        {
            "experiment": experiment,
            "mode": mode,
            "k": args.k,
            "staleness": s,
            "draw": draw,
            "multiplier": multiplier,
            "seed": seed,
            "epochs": args.epochs or EXPERIMENTS[experiment].epochs,
            "peak": EXPERIMENTS[experiment].peak,
        }
        for experiment, mode, s, draw in cells
        for multiplier in args.multipliers
        for seed in range(args.seeds)
    ]


def grouped(rows: list[dict[str, Any]]) -> dict[tuple[str, str, str, str], dict[float, list[float]]]:
    """(experiment, mode, staleness, draw) -> multiplier -> accuracies. A constant staleness's
    global run stands for local too; at s = k - 1 the constant async and local runs are also the
    round-robin setting's (k workers in turn)."""
    groups: dict[tuple[str, str, str, str], dict[float, list[float]]] = {}
    for row in rows:
        targets = [(row["mode"], row["draw"])]
        if row["draw"] == "constant" and row["mode"] in ("async", "global"):
            as_local = "local" if row["mode"] == "global" else "async"
            targets += [("local", "constant")] if row["mode"] == "global" else []
            if int(row["staleness"]) == int(row["k"]) - 1:
                targets.append((as_local, "round_robin"))
        for mode, draw in targets:
            cell = groups.setdefault((row["experiment"], mode, row["staleness"], draw), {})
            cell.setdefault(float(row["multiplier"]), []).append(float(row["accuracy"]))
    return groups


def table(rows: list[dict[str, Any]]) -> str:
    """Per experiment, mode and staleness: mean accuracy (over seeds) at each learning rate."""
    groups = grouped(rows)
    multipliers = sorted({m for cell in groups.values() for m in cell})
    lines = []
    order = {name: i for i, name in enumerate(modes())}
    for experiment in EXPERIMENTS:
        keys = sorted(
            (g for g in groups if g[0] == experiment),
            key=lambda g: (DRAWS.index(g[3]), int(g[2]), order.get(g[1], 9)),
        )
        if not keys:
            continue
        peak = EXPERIMENTS[experiment].peak
        rates = "".join(f"{peak * m:>9.2g}" for m in multipliers)
        lines += [
            "",
            f"{experiment}: mean held-out accuracy by peak learning rate",
            f"{'mode':<14} {'s':>9}{rates}  best",
        ]
        for group in keys:
            cell = groups[group]
            means = [np.mean(cell[m]) if m in cell else np.nan for m in multipliers]
            staleness = {
                "constant": group[2],
                "uniform": f"{group[2]} (0-{2 * int(group[2])})",
                "round_robin": f"N={int(group[2]) + 1} rr",
            }[group[3]]
            values = "".join(f"{v:>9.3f}" for v in means)
            lines.append(f"{group[1]:<14} {staleness:>9}{values}  {np.nanmax(means):.3f}")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = grouped(rows)
    experiments = [e for e in EXPERIMENTS if any(g[0] == e for g in groups)]
    colors = dict(zip(modes(), ("tab:grey", "tab:orange", "tab:blue", "tab:red"), strict=True))

    figure, panels = plt.subplots(1, len(experiments), figsize=(5.5 * len(experiments), 4.2), squeeze=False)
    for panel, experiment in zip(panels[0], experiments, strict=True):
        for mode, color in colors.items():
            for tuned, style in ((False, "-o"), (True, "--^")):
                points = sorted(
                    (int(g[2]), cell)
                    for g, cell in groups.items()
                    if g[0] == experiment and g[1] == mode and g[3] == "constant"
                )
                if not points:
                    continue
                values = [
                    max(np.mean(v) for v in cell.values()) if tuned else np.mean(cell.get(1.0, [np.nan]))
                    for _, cell in points
                ]
                label = f"{mode}, {'best rate' if tuned else 'base rate'}"
                panel.plot([s for s, _ in points], values, style, color=color, label=label)
        panel.set_xlabel("staleness s (server updates)")
        panel.set_title(f"{experiment}: accuracy against staleness")
        panel.set_ylim(0, 1.02)
        panel.legend(fontsize=7, loc="lower left")
    panels[0][0].set_ylabel("held-out accuracy (mean of the seeds)")
    figure.tight_layout()
    figure.savefig(out / "accuracy_vs_staleness.png", dpi=110)
    plt.close(figure)

    # One panel per constant staleness, then the paper's setting (k workers in turn), if run.
    columns = sorted({(g[3] != "constant", int(g[2]), g[3]) for g in groups if g[3] != "uniform"})
    figure, panels = plt.subplots(
        len(experiments),
        len(columns),
        figsize=(3.6 * len(columns), 3.2 * len(experiments)),
        squeeze=False,
        sharey=True,
    )
    for row_panels, experiment in zip(panels, experiments, strict=True):
        peak = EXPERIMENTS[experiment].peak
        for panel, (_, s, draw) in zip(row_panels, columns, strict=True):
            for mode, color in colors.items():
                cell = groups.get((experiment, mode, str(s), draw))
                if cell:
                    rates = sorted(cell)
                    panel.plot(
                        [peak * m for m in rates],
                        [np.mean(cell[m]) for m in rates],
                        "-o",
                        color=color,
                        label=mode,
                    )
            panel.set_xscale("log")
            panel.minorticks_off()  # the rates are the ticks; log minor labels would overlap them
            panel.set_xticks(
                [peak * m for m in sorted(groups[(experiment, "async", "0", "constant")])]
                if (experiment, "async", "0", "constant") in groups
                else []
            )
            where = f"s = {s}" if draw == "constant" else f"{s + 1} workers in turn"
            panel.set_title(f"{experiment}, {where}", fontsize=9)
            panel.set_xlabel("peak learning rate", fontsize=8)
            panel.set_ylim(0, 1.02)
        row_panels[0].set_ylabel("held-out accuracy")
        row_panels[0].legend(fontsize=7, loc="lower left")
    figure.tight_layout()
    figure.savefig(out / "accuracy_vs_learning_rate.png", dpi=110)
    plt.close(figure)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--experiments", nargs="+", default=list(EXPERIMENTS), choices=list(EXPERIMENTS))
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 3], help="constant s")
    parser.add_argument("--drawn", type=int, nargs="*", default=[3], help="s drawn from 0..2s")
    parser.add_argument("--multipliers", type=float, nargs="+", default=[0.5, 1, 2, 4, 8])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--k", type=int, default=ACCUMULATE, help="gradients per local/global sum")
    parser.add_argument(
        "--no-round-robin",
        dest="round_robin",
        action="store_false",
        help="leave out the paper's setting: k workers in turn (global's pushes 0 or 1 stale)",
    )
    parser.add_argument("--epochs", type=float, default=0, help="default: each experiment's own")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "studies" / "staleness_output")
    parser.add_argument("--smoke", action="store_true", help="every mode once on a sliver of the data")
    args = parser.parse_args()
    if args.smoke:
        args.staleness, args.drawn, args.multipliers, args.seeds, args.epochs = [0, 2], [1], [1], 1, 0.2
        args.out = args.out.with_name(args.out.name + "_smoke")
    args.out.mkdir(parents=True, exist_ok=True)
    results = args.out / "results.csv"

    runs = grid(args)
    wanted = {key(r) for r in runs}
    done = {key(r) for r in convergence.read_rows(results)} & wanted
    todo = [r for r in runs if key(r) not in done]
    print(f"{len(runs)} runs, {len(runs) - len(todo)} already in {results}", flush=True)
    data: dict[str, tuple[np.ndarray, ...]] = {}
    started = time.perf_counter()
    for i, r in enumerate(todo):
        if r["experiment"] not in data:
            data[r["experiment"]] = load_data(r["experiment"], args.out, args.smoke)
        row = run(
            data[r["experiment"]],
            r["experiment"],
            r["mode"],
            r["staleness"],
            r["draw"],
            r["multiplier"],
            r["seed"],
            r["epochs"],
            args.k,
        )
        convergence.append_row(results, FIELDS, row)
        left = (time.perf_counter() - started) / (i + 1) * (len(todo) - i - 1)
        print(
            f"[{i + 1}/{len(todo)}] {row['experiment']} {row['mode']:<13} s={row['staleness']} "
            f"{row['draw']:<8} lr x{row['multiplier']:g} seed {row['seed']}: accuracy "
            f"{row['accuracy']:.3f} ({row['updates']} updates, mean staleness {row['mean_staleness']}) "
            f"in {row['seconds']:.0f} s; about {left / 60:.0f} min left",
            flush=True,
        )
    rows = [r for r in convergence.read_rows(results) if key(r) in wanted]
    print(table(rows))
    plot(convergence.read_rows(results), args.out)  # every run in the CSV, from any invocation
    print(
        f"\nresults: {results}\nplots: {args.out / 'accuracy_vs_staleness.png'}, "
        f"{args.out / 'accuracy_vs_learning_rate.png'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
