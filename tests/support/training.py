"""Helpers of the in-process training tests: the toy problem, its optimizers, the numpy simulation
of replicas and processes, a linear model under a strategy, and a fit around a write of the weights."""

from __future__ import annotations

import itertools
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tests.support import oracle

LR, MOMENTUM = 0.1, 0.9


BETA_1, BETA_2, EPSILON = 0.9, 0.999, 1e-7


def cpus(p: int) -> list[str]:
    return [d.name for d in tf.config.list_logical_devices("CPU")[:p]]


def problem(seed: int = 0) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((64, 3)).astype(np.float32)
    y = rng.standard_normal((64, 2)).astype(np.float32)
    w = rng.standard_normal((3, 2)).astype(np.float32)
    return x, y, w, np.zeros(2, np.float32)


def make_inner(name: str) -> keras.optimizers.Optimizer:
    if name == "sgd_momentum":
        return keras.optimizers.SGD(LR, momentum=MOMENTUM)
    return keras.optimizers.Adam(LR, beta_1=BETA_1, beta_2=BETA_2, epsilon=EPSILON)


class Replica:
    """One replica's Keras-exact optimizer step, in float64, with its own state."""

    def __init__(self, kind: str, params: list[np.ndarray]) -> None:
        self.kind = kind
        self.m = [np.zeros_like(p) for p in params]
        self.v = [np.zeros_like(p) for p in params]

    def step(self, params: list[np.ndarray], grads: list[np.ndarray], t: int) -> list[np.ndarray]:
        out = []
        for i, (p, g) in enumerate(zip(params, grads, strict=True)):
            if self.kind == "sgd_momentum":
                self.m[i] = MOMENTUM * self.m[i] - LR * g
                out.append(p + self.m[i])
            else:
                alpha = LR * np.sqrt(1 - BETA_2**t) / (1 - BETA_1**t)
                self.m[i] = self.m[i] + (g - self.m[i]) * (1 - BETA_1)
                self.v[i] = self.v[i] + (g * g - self.v[i]) * (1 - BETA_2)
                out.append(p - self.m[i] * alpha / (np.sqrt(self.v[i]) + EPSILON))
        return out


# Outer optimizers of the tests: (kind, learning rate, momentum), as Outer takes them.
OUTERS = {
    "sgd": ("sgd", 0.7, 0.0),
    "nesterov": ("nesterov", 0.7, 0.9),
    "momentum": ("momentum", 0.5, 0.5),
    "adam": ("adam", 0.05, 0.0),
}


class Outer:
    """An outer optimizer in float64 as Keras steps it: SGD (with momentum, with Nesterov's) or Adam,
    stepping the anchor on the pseudo-gradient -combined at each sync."""

    def __init__(self, kind: str, lr: float, momentum: float = 0.0) -> None:
        self.kind, self.lr, self.momentum = kind, lr, momentum
        self.m: list[np.ndarray] | None = None
        self.v: list[np.ndarray] | None = None
        self.t = 0

    def step(self, anchor: list[np.ndarray], combined: list[np.ndarray]) -> list[np.ndarray]:
        if self.m is None:
            self.m = [np.zeros_like(a) for a in anchor]
            self.v = [np.zeros_like(a) for a in anchor]
        assert self.v is not None
        self.t += 1
        out = []
        for i, (a, d) in enumerate(zip(anchor, combined, strict=True)):
            g = -d
            if self.kind == "adam":
                alpha = self.lr * np.sqrt(1 - BETA_2**self.t) / (1 - BETA_1**self.t)
                self.m[i] = self.m[i] + (g - self.m[i]) * (1 - BETA_1)
                self.v[i] = self.v[i] + (g * g - self.v[i]) * (1 - BETA_2)
                out.append(a - self.m[i] * alpha / (np.sqrt(self.v[i]) + EPSILON))
            elif self.momentum == 0:
                out.append(a - self.lr * g)
            else:
                self.m[i] = self.momentum * self.m[i] - self.lr * g
                nesterov = self.kind == "nesterov"
                out.append(a + (self.momentum * self.m[i] - self.lr * g if nesterov else self.m[i]))
        return out

    def keras(self) -> keras.optimizers.Optimizer:
        if self.kind == "adam":
            return keras.optimizers.Adam(self.lr, beta_1=BETA_1, beta_2=BETA_2, epsilon=EPSILON)
        return keras.optimizers.SGD(self.lr, momentum=self.momentum, nesterov=self.kind == "nesterov")


def mse_grads(params: list[np.ndarray], x: np.ndarray, y: np.ndarray) -> list[np.ndarray]:
    """Gradients of Keras's mean squared error for the linear model x @ w + b, in float64."""
    err = x @ params[0] + params[1] - y
    return [2 * x.T @ err / err.size, 2 * err.sum(0) / err.size]


def accumulated_adam(k: int, average: bool, passes: int = 8, batch: int = 8) -> list[np.ndarray]:
    """Horovod's gradient accumulation on problem(), one process, Adam: each pass's gradient summed, and
    at every k-th pass the sum (divided by k with `average`) stepped on; Adam's bias correction counts
    passes, as the iteration count does."""
    x, y, w, b = problem()
    params = [w.astype(np.float64), b.astype(np.float64)]
    adam, summed = Replica("adam", params), [np.zeros_like(p) for p in params]
    for step in range(passes):
        rows = slice(batch * step, batch * (step + 1))
        summed = [s + g for s, g in zip(summed, mse_grads(params, x[rows], y[rows]), strict=True)]
        if (step + 1) % k == 0:
            params = adam.step(params, [s / k if average else s for s in summed], step + 1)
            summed = [np.zeros_like(p) for p in params]
    return params


def simulate_replicas(
    kind: str,
    start: list[np.ndarray],
    batches: list[list[tuple[np.ndarray, np.ndarray]]],
    sync_every: int,
    losses: list[float] | None = None,
    writes: dict[int, list[np.ndarray]] | None = None,
    after_each_step: list[list[np.ndarray]] | None = None,
    mean_groups: list[int] | None = None,
    outer: Outer | None = None,
    combine: str = "adasum",
) -> list[np.ndarray]:
    """Replica r steps on batches[r] with its own optimizer state; every sync: the tree over the deltas.

    With `mean_groups` (each process's number of replicas, in order: local_reduction="mean"), every
    sync is the tree over each group's mean delta instead; with combine="mean", the mean of every
    replica's. With `outer`, the sync's new weights are its step from the anchor on the combined delta.

    Each replica's loss before each of its steps is appended to `losses`, when given. `writes[i]`, when
    given, is what a user writes into every replica before step i (set_weights, ...): the new weights,
    from which the window's deltas are then measured, with the optimizer states kept. Replica 0's
    weights after each step (and its sync) are appended to `after_each_step`, when given.
    """
    anchor = [w.astype(np.float64) for w in start]
    p = len(batches)
    params = [list(anchor) for _ in range(p)]
    replicas = [Replica(kind, anchor) for _ in range(p)]
    for step in range(len(batches[0])):
        if writes and step in writes:
            anchor = [w.astype(np.float64) for w in writes[step]]
            params = [list(anchor) for _ in range(p)]
        for r in range(p):
            x, y = (a.astype(np.float64) for a in batches[r][step])
            if losses is not None:
                losses.append(float(np.mean((x @ params[r][0] + params[r][1] - y) ** 2)))
            params[r] = replicas[r].step(params[r], mse_grads(params[r], x, y), step + 1)
        if (step + 1) % sync_every == 0:
            deltas = [[q - a for q, a in zip(params[r], anchor, strict=True)] for r in range(p)]
            if mean_groups is not None:
                starts = np.cumsum([0, *mean_groups])
                deltas = [
                    [np.mean(parts, axis=0) for parts in zip(*deltas[a:b], strict=True)]
                    for a, b in itertools.pairwise(starts)
                ]
            if combine == "mean":
                combined = [np.mean(parts, axis=0) for parts in zip(*deltas, strict=True)]
            else:
                combined = oracle.tree(deltas)
            if outer is None:
                anchor = [a + d for a, d in zip(anchor, combined, strict=True)]
            else:
                anchor = outer.step(anchor, combined)
            params = [list(anchor) for _ in range(p)]
        if after_each_step is not None:
            after_each_step.append(list(params[0]))
    return anchor


def simulate(
    kind: str,
    p: int,
    sync_every: int,
    steps: int,
    global_batch: int,
    losses: list[float] | None = None,
    mean_groups: list[int] | None = None,
    outer: Outer | None = None,
    combine: str = "adasum",
) -> list[np.ndarray]:
    """The strategy's replicas: replica r takes the r-th contiguous share of every global batch."""
    x, y, w, b = problem()
    local = global_batch // p
    starts = [[s * global_batch + r * local for s in range(steps)] for r in range(p)]
    shares = [[(x[i : i + local], y[i : i + local]) for i in replica] for replica in starts]
    return simulate_replicas(
        kind, [w, b], shares, sync_every, losses, mean_groups=mean_groups, outer=outer, combine=combine
    )


def build_linear(strategy: tf.distribute.Strategy, make_optimizer: Any) -> keras.Model:
    _, _, w, b = problem()
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        model.set_weights([w, b])
        model.compile(optimizer=make_optimizer(), loss="mse")
    return model


def replica_values(strategy: tf.distribute.Strategy, model: keras.Model) -> list[list[np.ndarray]]:
    return [[c.numpy() for c in strategy.experimental_local_results(v.value)] for v in model.weights]


def shares(x: np.ndarray, y: np.ndarray, steps: list[int], p: int, local: int) -> list[list[Any]]:
    """Replica r's share of global batch `s` for each s in `steps`: rows s * p * local + r * local, ..."""
    rows = [[slice((s * p + r) * local, (s * p + r + 1) * local) for s in steps] for r in range(p)]
    return [[(x[i], y[i]) for i in replica] for replica in rows]


# (how the weights are written, optimizer, replicas, sync_every), for fit_write_fit.
KINDS = ("sgd_momentum", "adam")


WRITES = [("set_weights", kind, p, k) for kind in KINDS for p in (2, 3) for k in (1, 2)] + [
    ("assign", "adam", 3, 2),
    ("assign", "sgd_momentum", 2, 1),
    ("early_stopping", "sgd_momentum", 3, 2),
    ("early_stopping", "adam", 2, 1),
]


def written_data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    return rng.standard_normal((128, 3)).astype(np.float32), rng.standard_normal((128, 2)).astype(np.float32)


def fit_write_fit(strategy: tf.distribute.Strategy, how: str, kind: str, replicas: int) -> tuple[Any, ...]:
    """fit, a write into the weights by `how`, fit again: the model, its start, what was written, the
    global batches run, and how many ran before the write. Three steps before the write: with
    sync_every 2 it lands inside a window, after one unsynced step. Across processes every process
    runs this on the same data, and the strategy hands each its share."""
    x, y = written_data()
    model = build_linear(strategy, lambda: make_inner(kind))
    start = model.get_weights()
    local, first = 4, 3
    then = 4 if how == "early_stopping" else 3  # to end on a sync
    gb = local * replicas
    if how == "early_stopping":
        # The second epoch cannot improve by min_delta: fit stops there and restores the first's weights.
        stop = keras.callbacks.EarlyStopping("loss", min_delta=1e9, patience=1, restore_best_weights=True)
        model.fit(x[: first * gb], y[: first * gb], batch_size=gb, epochs=3, shuffle=False, verbose=0,
                  callbacks=[stop])  # fmt: skip
        before = [*range(first), *range(first)]
    else:
        model.fit(x[: first * gb], y[: first * gb], batch_size=gb, shuffle=False, verbose=0)
        before = list(range(first))
        rng = np.random.default_rng(2)  # the same on every process (inside a window, weights are not)
        written = [w + rng.standard_normal(w.shape).astype(np.float32) for w in start]
        if how == "set_weights":
            model.set_weights(written)
        else:
            for variable, value in zip(model.trainable_variables, written, strict=True):
                variable.assign(value)
    written = model.get_weights()
    rows = slice(first * gb, (first + then) * gb)
    model.fit(x[rows], y[rows], batch_size=gb, shuffle=False, verbose=0)
    return model, start, written, before + list(range(first, first + then)), len(before)


def check_fit_write_fit(
    got: list[np.ndarray], how: str, kind: str, p: int, sync_every: int, run: tuple[Any, ...]
) -> None:
    """`got`, the weights after fit_write_fit on p replicas, against the simulation."""
    start, written, steps, at = run
    x, y = written_data()
    replica_0: list[list[np.ndarray]] = []
    want = simulate_replicas(kind, start, shares(x, y, steps, p, 4), sync_every,
                             writes={at: written}, after_each_step=replica_0)  # fmt: skip
    if how == "early_stopping":  # EarlyStopping did restore: the first epoch's weights, replica 0's
        for w, r in zip(written, replica_0[2], strict=True):
            np.testing.assert_allclose(w, r, rtol=2e-5, atol=2e-5)
    atol = 2e-5 if kind == "adam" else 2e-6
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=atol)


class StopAfter(keras.callbacks.Callback):
    """Records the weights after `batches` batches, then interrupts training."""

    def __init__(self, batches: int) -> None:
        super().__init__()
        self.batches = batches
        self.weights: list[np.ndarray] = []

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if batch + 1 == self.batches:
            self.weights = self.model.get_weights()
            raise RuntimeError("interrupted")
