"""The Adasum paper's headline experiment, scaled to this machine: does convergence survive more replicas
at the one-replica learning rate?

The paper (arXiv 2006.02924) trains LeNet-5 on MNIST with a fixed epoch budget and the learning rate
tuned for one worker: summing or averaging stops converging beyond 8 workers, Adasum still converges
at 32. Here:

- data: scikit-learn's digits, 16x16, 20% of the 1,797 originals held out before augmenting
  (tf_adasum.demo.augmented_digits); ~20k training images, validation on copies of held-out originals;
- model: a LeNet-like CNN of ~20k parameters; 32 examples per replica per step;
- optimizer: momentum SGD (0.9), peak learning rate LR with a linear warm-up (10% of the steps) and a
  linear decay to zero over EPOCHS epochs, the same for every N: N replicas take N times fewer steps;
- methods: "average" (the gradient mean: MirroredStrategy, Horovod's Average) and "adasum" (Adasum
  after the optimizer, every step: AdasumStrategy); with Adam also "adasum_before" (Adasum of the raw
  gradients, then one Adam: Horovod's op=Adasum), against "adasum" (after, the product);
- a small learning-rate search: each method also runs at LR x2, x4, ...; the table reports x1 and the
  best multiplier;
- --model transformer: the staleness study's 2-layer Transformer encoder on its pointer task (the label
  is the token at the position the first token names) instead of the CNN, for LAMB + Adasum, the
  paper's BERT combination; results under convergence_transformer_output/.

N replicas run in one process, vectorised: every replica holds the same weights at the start of a step
(they sync every step), so their gradients come from one vectorised backward pass
(tf.vectorized_map); then each replica steps with its own real Keras optimizer and state, and their
deltas are combined with tf_adasum.adasum_tree, the product's contract tree. tests/test_convergence.py
checks that this equals AdasumStrategy (and the average, MirroredStrategy) step for step at N = 2 and 4.

Usage:
    python benchmarks/studies/convergence.py                 # the full grid, resumable from its CSV
    python benchmarks/studies/convergence.py --smoke         # seconds: every part once, tiny
    python benchmarks/studies/convergence.py --replicas 1 16 --seeds 1 --multipliers 1
    python benchmarks/studies/convergence.py --model transformer --optimizers lamb --epochs 3

Writes OUT/results.csv (one row per run), OUT/orthogonality.csv (per layer, during training),
OUT/accuracy_vs_replicas.png and OUT/orthogonality.png, and prints the table.
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import tf_adasum  # noqa: E402  (first: TensorFlow starts without its C++ start-up log)

# isort: split
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.get_logger().setLevel("ERROR")  # pfor's note that Conv2DBackpropFilter runs as a loop, per trace

from tf_adasum.demo import augmented_digits  # noqa: E402
from tf_adasum.ops import squared_norms  # noqa: E402

LOCAL_BATCH = 32
FIELDS = [
    "optimizer",
    "method",
    "replicas",
    "multiplier",
    "seed",
    "epochs",
    "peak",
    "accuracy",
    "steps",
    "seconds",
]
METHODS = {"sgd": ["average", "adasum"], "adam": ["adasum", "adasum_before"], "lamb": ["average", "adasum"]}
# The one-replica peak learning rates, tuned once (see README).
PEAK = {"sgd": 0.01, "adam": 0.002, "lamb": 0.004}
# "adasum_meanL": AdasumStrategy(local_reduction="mean") with L replicas per process: each group of L
# consecutive replicas' deltas averaged, then the tree over the groups' means (Horovod's hierarchical mode).
MEAN_PREFIX = "adasum_mean"


class WarmupLinearDecay(keras.optimizers.schedules.LearningRateSchedule):
    """Linear warm-up to `peak` over the first 10% of `total` steps, then linear decay to zero."""

    def __init__(self, peak: float, total: int) -> None:
        self.peak, self.total = peak, total
        self.warmup = max(1, total // 10)

    def __call__(self, step: Any) -> Any:
        step = tf.cast(step, tf.float32)
        up = self.peak * (step + 1) / self.warmup
        down = self.peak * (self.total - step) / max(1, self.total - self.warmup)
        return tf.maximum(tf.minimum(up, down), 0.0)

    def get_config(self) -> dict[str, Any]:
        return {"peak": self.peak, "total": self.total}


def make_model() -> keras.Model:
    """LeNet-like: 19,850 parameters for 16x16 digits."""
    return keras.Sequential(
        [
            keras.Input((16, 16, 1)),
            keras.layers.Conv2D(6, 5, activation="relu", name="conv1"),
            keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(16, 3, activation="relu", name="conv2"),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(120, activation="relu", name="dense1"),
            keras.layers.Dense(84, activation="relu", name="dense2"),
            keras.layers.Dense(10, name="logits"),
        ],
        name="lenet",
    )


POINTER_LENGTH = 12  # tokens per sequence; the first is a position p in 1..11, the label is token p
POINTER_VOCAB = 10  # tokens 1..9 after the first


def pointer_task(count: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """`count` sequences of the pointer task and their labels, generated from `seed`."""
    rng = np.random.default_rng(seed)
    x = rng.integers(1, POINTER_VOCAB, (count, POINTER_LENGTH))
    x[:, 0] = rng.integers(1, POINTER_LENGTH, count)
    return x.astype(np.int32), x[np.arange(count), x[:, 0]].astype(np.int32)


class PositionEmbedding(keras.layers.Layer):
    """A learned vector per position, added to the token embeddings."""

    def build(self, input_shape: tuple[int, ...]) -> None:
        self.table = self.add_weight(shape=input_shape[1:], initializer="glorot_uniform", name="table")

    def call(self, inputs: Any) -> Any:
        return inputs + self.table


def pointer_data(count: int) -> tuple[np.ndarray, ...]:
    """`count` training sequences and count // 10 validation ones, from their own seeds."""
    return (*pointer_task(count, 0), *pointer_task(count // 10, 1))


def make_transformer() -> keras.Model:
    """Token and position embeddings (32), two post-norm encoder blocks (4 heads), mean-pool, logits."""
    width = 32
    tokens = keras.Input((POINTER_LENGTH,), dtype="int32")
    h = keras.layers.Embedding(max(POINTER_VOCAB, POINTER_LENGTH), width, name="tokens")(tokens)
    h = PositionEmbedding(name="positions")(h)
    for block in range(2):
        attended = keras.layers.MultiHeadAttention(4, width // 4, name=f"attention{block}")(h, h)
        h = keras.layers.LayerNormalization(name=f"norm{block}a")(h + attended)
        hidden = keras.layers.Dense(2 * width, activation="relu", name=f"ffn{block}a")(h)
        h = keras.layers.LayerNormalization(name=f"norm{block}b")(
            h + keras.layers.Dense(width, name=f"ffn{block}b")(hidden)
        )
    pooled = keras.layers.GlobalAveragePooling1D()(h)
    return keras.Model(tokens, keras.layers.Dense(POINTER_VOCAB, name="logits")(pooled), name="encoder")


def make_optimizer(kind: str, learning_rate: Any) -> keras.optimizers.Optimizer:
    if kind == "sgd":
        return keras.optimizers.SGD(learning_rate, momentum=0.9)
    if kind == "lamb":
        return keras.optimizers.Lamb(learning_rate)
    return keras.optimizers.Adam(learning_rate)


LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
# --model: the network; the Transformer is the staleness study's, on its pointer task.
MODELS = {"cnn": make_model, "transformer": make_transformer}


def stacked_gradients(model: keras.Model, x: tf.Tensor, y: tf.Tensor) -> list[tf.Tensor]:
    """Every replica's gradient of its own mean loss, in one vectorised pass: x[r] and y[r] are replica
    r's batch; the result is [N, *shape] per trainable variable."""
    weights = [v.value for v in model.trainable_variables]

    def one(batch: tuple[tf.Tensor, tf.Tensor]) -> list[tf.Tensor]:
        inputs, labels = batch
        with tf.GradientTape() as tape:
            loss = LOSS(labels, model(inputs, training=True))
        # An Embedding's gradient comes as IndexedSlices, which vectorized_map cannot stack.
        return [tf.convert_to_tensor(g) for g in tape.gradient(loss, weights)]

    return tf.vectorized_map(one, (x, y))


class Replicas:
    """N data-parallel replicas of `model` in one process, each with its own Keras optimizer.

    method "average": one optimizer steps on the mean of the replicas' gradients (MirroredStrategy).
    method "adasum": every replica's optimizer steps from the shared weights on its own gradient, and
        the deltas are combined with tf_adasum.adasum_tree (AdasumStrategy, sync_every=1).
    method "adasum_before": one optimizer steps on adasum_tree of the raw gradients.
    """

    def __init__(self, model: keras.Model, method: str, n: int, optimizer: Callable[[], Any]) -> None:
        self.model, self.method, self.n = model, method, n
        self.weights = [v.value for v in model.trainable_variables]
        self.shared = optimizer()
        self.shared.build(model.trainable_variables)
        self.local: list[Any] = []
        self.copies: list[list[tf.Variable]] = []
        self.group = int(method[len(MEAN_PREFIX) :]) if method.startswith(MEAN_PREFIX) else 1
        if n % self.group:
            raise ValueError(f"{method}: {n} replicas do not make groups of {self.group}")
        if method == "adasum" or self.group > 1:
            for _ in range(n):
                copy = [tf.Variable(w, trainable=False) for w in self.weights]
                local = optimizer()
                local.build(copy)
                self.copies.append(copy)
                self.local.append(local)
        # The orthogonality of the last step, per variable: |combined|^2 / sum_r |d_r|^2.
        self.orthogonality = tf.Variable(tf.zeros([len(self.weights)], tf.float64), trainable=False)
        self.step = tf.function(self._step)

    def _step(self, x: tf.Tensor, y: tf.Tensor) -> None:
        grads = stacked_gradients(self.model, x, y)
        per_replica = [[g[r] for g in grads] for r in range(self.n)]
        if self.method == "average":
            self.shared.apply([tf.reduce_mean(g, 0) for g in grads], self.model.trainable_variables)
            return
        if self.method == "adasum_before":
            combined = tf_adasum.adasum_tree(per_replica) if self.n > 1 else per_replica[0]
            self.shared.apply(combined, self.model.trainable_variables)
            self._record(per_replica, combined)
            return
        deltas = []
        for r in range(self.n):
            for copy, w in zip(self.copies[r], self.weights, strict=True):
                copy.assign(w)
            self.local[r].apply(per_replica[r], self.copies[r])
            deltas.append([c - w for c, w in zip(self.copies[r], self.weights, strict=True)])
        if self.group > 1:  # each process's replicas averaged, then the tree over the processes
            deltas = [
                [
                    tf.reduce_mean(tf.stack(parts), 0)
                    for parts in zip(*deltas[g : g + self.group], strict=True)
                ]
                for g in range(0, self.n, self.group)
            ]
        combined = tf_adasum.adasum_tree(deltas) if len(deltas) > 1 else deltas[0]
        for w, d in zip(self.weights, combined, strict=True):
            w.assign_add(d)
        self._record(deltas, combined)

    def _record(self, per_replica: list[list[tf.Tensor]], combined: list[tf.Tensor]) -> None:
        # OrthogonalityMonitor's measure, with the same fused norms the product's syncs record.
        total = tf.add_n([squared_norms(d) for d in per_replica])
        self.orthogonality.assign(tf.math.divide_no_nan(squared_norms(combined), total))


def accuracy(model: keras.Model, x: np.ndarray, y: np.ndarray) -> float:
    logits = model.predict(x, batch_size=1024, verbose=0)
    return float(np.mean(np.argmax(logits, axis=1) == y))


def run(
    data: tuple[np.ndarray, ...],
    kind: str,
    method: str,
    n: int,
    multiplier: float,
    seed: int,
    epochs: float,
    trace: Callable[[int, list[str], np.ndarray], None] | None = None,
    model_name: str = "cnn",
) -> dict[str, Any]:
    """One training run; returns its CSV row. `trace(step, names, orthogonality)` sees the orthogonality."""
    x, y, x_val, y_val = data
    global_batch = LOCAL_BATCH * n
    per_epoch = len(y) // global_batch
    total = max(1, int(per_epoch * epochs))
    keras.utils.set_random_seed(seed)
    model = MODELS[model_name]()
    replicas = Replicas(
        model, method, n, lambda: make_optimizer(kind, WarmupLinearDecay(PEAK[kind] * multiplier, total))
    )
    names = [v.path for v in model.trainable_variables]
    rng = np.random.default_rng(seed)
    start, step = time.perf_counter(), 0
    every = max(1, total // 40)
    while step < total:
        order = rng.permutation(len(y))[: per_epoch * global_batch]
        xs = tf.constant(x[order].reshape(per_epoch, n, LOCAL_BATCH, *x.shape[1:]))
        ys = tf.constant(y[order].reshape(per_epoch, n, LOCAL_BATCH))
        for i in range(min(per_epoch, total - step)):
            replicas.step(xs[i], ys[i])
            step += 1
            if trace is not None and (step % every == 0 or step == total):
                trace(step, names, replicas.orthogonality.numpy())
    return {
        "optimizer": kind,
        "method": method,
        "replicas": n,
        "multiplier": multiplier,
        "seed": seed,
        "epochs": epochs,
        "peak": PEAK[kind],
        "accuracy": round(accuracy(model, x_val, y_val), 4),
        "steps": total,
        "seconds": round(time.perf_counter() - start, 1),
    }


def key(row: dict[str, Any]) -> tuple[Any, ...]:
    """What makes a run: rows of another budget or one-replica rate in the same CSV are other runs."""
    return (
        row["optimizer"],
        row["method"],
        int(row["replicas"]),
        float(row["multiplier"]),
        int(row["seed"]),
        float(row["epochs"]),
        float(row["peak"]),
    )


def append_row(path: Path, fields: list[str], row: dict[str, Any]) -> None:
    """Appends one row to a results CSV, with the header if the file is new: runs resume from it."""
    with open(path, "a", newline="") as f:
        writer = csv.DictWriter(f, fields)
        if f.tell() == 0:
            writer.writeheader()
        writer.writerow(row)


def read_rows(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    with open(path) as f:
        return list(csv.DictReader(f))


def table(rows: list[dict[str, Any]]) -> str:
    """Per optimizer, method and N: accuracy mean and spread at x1, and at the best multiplier."""
    lines = [
        f"{'optimizer':<9} {'method':<14} {'N':>3}  {'x1 mean':>8} {'(min-max)':>14}  "
        f"{'best x':>6} {'mean':>6} {'(min-max)':>14}"
    ]
    groups: dict[tuple[str, str, int], dict[float, list[float]]] = {}
    for row in rows:
        by_multiplier = groups.setdefault((row["optimizer"], row["method"], int(row["replicas"])), {})
        by_multiplier.setdefault(float(row["multiplier"]), []).append(float(row["accuracy"]))
    for (kind, method, n), by_multiplier in sorted(groups.items()):
        base = by_multiplier.get(1.0, [])
        best = max(by_multiplier, key=lambda m: np.mean(by_multiplier[m]))
        tuned = by_multiplier[best]

        def spread(values: list[float]) -> str:
            return f"({min(values):.3f}-{max(values):.3f})" if values else ""

        base_mean = f"{np.mean(base):.3f}" if base else "-"
        lines.append(
            f"{kind:<9} {method:<14} {n:>3}  {base_mean:>8} {spread(base):>14}  "
            f"{best:>6g} {np.mean(tuned):>6.3f} {spread(tuned):>14}"
        )
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], trace_rows: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = [k for k in METHODS if any(r["optimizer"] == k for r in rows)]
    figure, panels = plt.subplots(1, len(kinds), figsize=(5.5 * len(kinds), 4.2), sharey=True, squeeze=False)
    for panel, kind in zip(panels[0], kinds, strict=True):
        mine = [r for r in rows if r["optimizer"] == kind]
        for method, color in zip(METHODS[kind], ("tab:blue", "tab:red"), strict=True):
            # At N = 1 every method is the same run, stored under the first method.
            chosen = [r for r in mine if r["method"] == method or int(r["replicas"]) == 1]
            ns = sorted({int(r["replicas"]) for r in chosen})
            for tuned, style in ((False, "-o"), (True, "--^")):
                means = []
                for n in ns:
                    by_multiplier: dict[float, list[float]] = {}
                    for r in chosen:
                        if int(r["replicas"]) == n:
                            by_multiplier.setdefault(float(r["multiplier"]), []).append(float(r["accuracy"]))
                    if tuned:
                        means.append(max(np.mean(v) for v in by_multiplier.values()))
                    else:
                        means.append(np.mean(by_multiplier.get(1.0, [np.nan])))
                label = f"{method}, {'best rate of the search' if tuned else 'one-replica rate'}"
                panel.plot(ns, means, style, color=color, label=label)
        panel.set_xscale("log", base=2)
        panel.set_xlabel("replicas N")
        panel.set_title(f"{kind}: held-out accuracy after a fixed epoch budget")
        panel.legend(fontsize=8, loc="lower left")
    panels[0][0].set_ylabel("validation accuracy (mean of the seeds)")
    panels[0][0].set_ylim(0, 1)
    figure.tight_layout()
    figure.savefig(out / "accuracy_vs_replicas.png", dpi=110)
    plt.close(figure)

    if trace_rows:
        figure, axes = plt.subplots(figsize=(7, 4.2))
        layers = sorted({r["variable"] for r in trace_rows if r["variable"].endswith("kernel")})
        for layer in layers:
            points = [
                (int(r["step"]), float(r["orthogonality"])) for r in trace_rows if r["variable"] == layer
            ]
            axes.plot(*zip(*points, strict=True), label=layer)
        n = int(trace_rows[0]["replicas"])
        axes.axhline(1 / n, color="grey", linestyle=":", linewidth=1, label="1/N (parallel updates)")
        axes.set_xlabel("step")
        axes.set_ylabel("|adasum(d)|² / Σ|d_i|²")
        axes.set_title(f"orthogonality of the replicas' updates, per layer's kernel (SGD, Adasum, N = {n})")
        axes.set_ylim(0, 1.05)
        axes.legend(fontsize=7)
        figure.tight_layout()
        figure.savefig(out / "orthogonality.png", dpi=110)
        plt.close(figure)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--multipliers", type=float, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--optimizers", nargs="+", default=["sgd", "adam"], choices=["sgd", "adam", "lamb"])
    parser.add_argument(
        "--methods",
        nargs="+",
        default=None,
        help=f"instead of each optimizer's; {MEAN_PREFIX}L: L per process",
    )
    parser.add_argument("--epochs", type=float, default=6)
    parser.add_argument("--sgd-lr", type=float, default=PEAK["sgd"], help="one-replica peak rate, SGD")
    parser.add_argument("--adam-lr", type=float, default=PEAK["adam"], help="one-replica peak rate, Adam")
    parser.add_argument("--lamb-lr", type=float, default=PEAK["lamb"], help="one-replica peak rate, LAMB")
    parser.add_argument("--trace-replicas", type=int, default=16, help="N whose orthogonality is plotted")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "studies" / "convergence_output")
    parser.add_argument(
        "--model",
        default="cnn",
        choices=list(MODELS),
        help="transformer: the staleness study's, on its pointer task (out: convergence_transformer_output)",
    )
    parser.add_argument("--smoke", action="store_true", help="every part once on a sliver of the data")
    args = parser.parse_args()
    if args.model != "cnn" and args.out == parser.get_default("out"):
        args.out = args.out.with_name(f"convergence_{args.model}_output")
    if args.smoke:
        args.replicas, args.seeds, args.multipliers, args.epochs = [1, 4], 1, [1, 2], 0.3
        args.trace_replicas = 4
        args.out = args.out.with_name(args.out.name + "_smoke")

    PEAK.update(sgd=args.sgd_lr, adam=args.adam_lr, lamb=args.lamb_lr)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.model == "transformer":
        data = pointer_data(2_000 if args.smoke else 20_000)
    elif args.smoke:  # two copies of each original: generated in seconds
        data = augmented_digits(args.out / "digits16_smoke.npz", copies=2, validation_copies=1)
    else:
        data = augmented_digits(ROOT / "demo_output" / "digits16_held_out.npz")
    results, traces = args.out / "results.csv", args.out / "orthogonality.csv"

    def this_grid(row: dict[str, Any]) -> bool:
        return float(row["epochs"]) == args.epochs and float(row["peak"]) == PEAK[row["optimizer"]]

    done = {key(r) for r in read_rows(results) if this_grid(r)}
    grid = [
        (kind, method, n, multiplier, seed)
        for kind in args.optimizers
        for n in args.replicas
        for method in args.methods or METHODS[kind]
        for multiplier in args.multipliers
        for seed in range(args.seeds)
        if not (n == 1 and method != (args.methods or METHODS[kind])[0])  # at N = 1 all are the same
    ]
    todo = [g for g in grid if (*g[:3], float(g[3]), g[4], float(args.epochs), PEAK[g[0]]) not in done]
    print(
        f"{len(data[1])} training, {len(data[3])} validation images; {len(grid)} runs, "
        f"{len(grid) - len(todo)} already in {results}",
        flush=True,
    )
    # Work is proportional to the examples processed (the same for every N), plus a cost per step.
    started, spent = time.perf_counter(), 0.0
    for i, (kind, method, n, multiplier, seed) in enumerate(todo):
        trace_rows: list[dict[str, Any]] = []
        traced = (
            kind == "sgd"
            and method == "adasum"
            and n == args.trace_replicas
            and multiplier == 1
            and seed == 0
        )

        def trace(
            step: int, names: list[str], values: np.ndarray, rows: list[Any] = trace_rows, n: int = n
        ) -> None:
            rows.extend(
                {"replicas": n, "step": step, "variable": v, "orthogonality": float(o)}
                for v, o in zip(names, values, strict=True)
            )

        row = run(data, kind, method, n, multiplier, seed, args.epochs, trace if traced else None, args.model)
        append_row(results, FIELDS, row)
        if trace_rows:
            with open(traces, "w", newline="") as f:
                writer = csv.DictWriter(f, ["replicas", "step", "variable", "orthogonality"])
                writer.writeheader()
                writer.writerows(trace_rows)
        spent = time.perf_counter() - started
        left = spent / (i + 1) * (len(todo) - i - 1)
        print(
            f"[{i + 1}/{len(todo)}] {kind} {method:<13} N={n:<2} lr x{multiplier:g} seed {seed}: "
            f"accuracy {row['accuracy']:.3f} in {row['seconds']:.0f} s; about {left / 60:.0f} min left",
            flush=True,
        )
    rows = [r for r in read_rows(results) if this_grid(r)]
    print("\n" + table(rows))
    plot(rows, read_rows(traces), args.out)
    plots = [str(args.out / name) for name in ("accuracy_vs_replicas.png", "orthogonality.png")]
    print(f"\nresults: {results}\nplots: {', '.join(plots)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
