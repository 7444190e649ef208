"""Keras's optimizer options under tf_adasum, for tests/test_optimizer_options.py and its worker: the Keras
model and optimizer each case (tests/workers/data.py's OPTION_CASES) trains, what a fit records, and the
numpy reference: one worker's Keras SGD with the option on each replica's batches, combined by the rule
the docs give (docs/training/optimizer-options.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tests.support import oracle
from tests.support.training import mse_grads, problem
from tests.workers.data import (
    OPTION_EMA_MOMENTUM,
    OPTION_EPOCHS,
    OPTION_LOCAL,
    OPTION_LR,
    OPTION_SECOND_LR,
    OPTION_STEPS,
    Case,
)


def make_sgd(case: Case, learning_rate: float = OPTION_LR) -> keras.optimizers.Optimizer:
    """The case's SGD (create it under the strategy's scope, where there is one)."""
    rate = (
        keras.optimizers.schedules.ExponentialDecay(learning_rate, 2, 0.5) if case.schedule else learning_rate
    )
    optimizer = keras.optimizers.SGD(rate, **case.sgd)
    if case.exclude:
        optimizer.exclude_from_weight_decay(var_names=list(case.exclude))
    return optimizer


class TwoOptimizers(keras.Model):
    """A linear model whose train_step steps the kernel with the compiled optimizer and the bias with
    `second`: what tf.keras's MultiOptimizer set up, written as Keras 3 has it."""

    def __init__(self, second: keras.optimizers.Optimizer) -> None:
        super().__init__()
        self.dense = keras.layers.Dense(2)
        self.second = second

    def call(self, x: Any) -> Any:
        return self.dense(x)

    def train_step(self, data: Any) -> dict[str, Any]:
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
        kernel, bias = self.dense.kernel, self.dense.bias
        grad_kernel, grad_bias = tape.gradient(loss, [kernel, bias])
        self.optimizer.apply([grad_kernel], [kernel])
        self.second.apply([grad_bias], [bias])
        return {"loss": loss}


def linear_model(case: Case, optimizer: Any, second: Any = None) -> keras.Model:
    """The problem's linear model from its start, compiled with `optimizer` (and `second` stepping the
    bias where the case has two optimizers); under the strategy's scope, where there is one."""
    _, _, w, b = problem()
    if case.two_optimizers:
        model: keras.Model = TwoOptimizers(second)
        model(np.zeros((1, 3), np.float32))  # builds it
    else:
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.set_weights([w, b])
    model.compile(optimizer=optimizer, loss="mse")
    return model


def validation() -> tuple[np.ndarray, np.ndarray]:
    x, y, _, _ = problem(seed=1)
    return x[:16], y[:16]


def averages(optimizer: Any) -> list[Any]:
    """The moving averages of the optimizer that steps, through any wrappers; [] without use_ema."""
    while not getattr(optimizer, "use_ema", False) and hasattr(optimizer, "inner_optimizer"):
        optimizer = optimizer.inner_optimizer
    return list(getattr(optimizer, "_model_variables_moving_average", []))


class Recorder(keras.callbacks.Callback):
    """Every replica's copy of the weights and of their moving averages after each batch and at the start
    of each evaluation (after SwapEMAWeights, listed before it, swapped them in): one snapshot each, a
    list over variables of a list over replicas. In a process without a strategy, its one copy."""

    def __init__(self) -> None:
        super().__init__()
        self.snapshots: list[list[list[np.ndarray]]] = []
        self.evaluated: list[list[np.ndarray]] = []  # replica 0's weights at each evaluation's start

    def _copies(self) -> list[list[np.ndarray]]:
        strategy = self.model.distribute_strategy
        variables = [*self.model.trainable_weights, *averages(self.model.optimizer)]
        return [[c.numpy() for c in strategy.experimental_local_results(v.value)] for v in variables]

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self.snapshots.append(self._copies())

    def on_test_begin(self, logs: dict[str, Any] | None = None) -> None:
        copies = self._copies()
        self.snapshots.append(copies)
        self.evaluated.append([replicas[0] for replicas in copies[: len(self.model.trainable_weights)]])


def replica_batches(p: int) -> list[list[tuple[np.ndarray, np.ndarray]]]:
    """Replica (or process) r's batch at each step of an epoch: rows (s * p + r) * OPTION_LOCAL, ... of the
    problem, as AdasumStrategy cuts a global batch of p * OPTION_LOCAL rows."""
    x, y, _, _ = problem()
    rows = [
        [slice((s * p + r) * OPTION_LOCAL, (s * p + r + 1) * OPTION_LOCAL) for s in range(OPTION_STEPS)]
        for r in range(p)
    ]
    return [[(x[i], y[i]) for i in replica] for replica in rows]


def process_rows(rank: int, p: int) -> tuple[np.ndarray, np.ndarray]:
    """Process `rank`'s rows, its batches of replica_batches one after the other."""
    x, y = (np.concatenate(parts) for parts in zip(*replica_batches(p)[rank], strict=True))
    return x, y


@dataclass
class Reference:
    weights: list[np.ndarray]  # after fit (with use_ema, Keras's finalize has written the averages in)
    averages: list[np.ndarray]  # the moving averages after fit
    evaluated: list[list[np.ndarray]]  # the weights each epoch's evaluation sees (SwapEMAWeights)


def learning_rate(case: Case, step: int) -> float:
    return OPTION_LR * 0.5 ** (step / 2) if case.schedule else OPTION_LR


def clipped(case: Case, grads: list[np.ndarray]) -> list[np.ndarray]:
    """Keras's clipping of one step's gradients: clipnorm per tensor, global_clipnorm over all of them."""
    options = case.sgd
    if options.get("clipnorm"):
        c = options["clipnorm"]
        return [g * c / max(float(np.linalg.norm(g)), c) for g in grads]
    if options.get("global_clipnorm"):
        c = options["global_clipnorm"]
        norm = float(np.sqrt(sum(np.sum(g * g) for g in grads)))
        return [g * c * min(1 / norm, 1 / c) for g in grads]
    if options.get("clipvalue"):
        return [np.clip(g, -options["clipvalue"], options["clipvalue"]) for g in grads]
    return grads


def simulate(
    case: Case, batches: list[list[tuple[np.ndarray, np.ndarray]]], average_before_the_sync: bool = False
) -> Reference:
    """The rule: replica r runs one worker's Keras SGD with the case's options on batches[r], with its own
    accumulators; every sync_every updates the deltas since the last sync are combined with the contract
    tree; the moving average follows the synced weights, updated and written in as Keras does on one
    worker. With average_before_the_sync, each replica averages its own weights before the sync instead
    (what tf_adasum must not do): the reference holds replica 0's."""
    _, _, w, b = problem()
    p, accumulation = len(batches), case.accumulation
    period = case.sync_every * accumulation
    rates = [
        1.0,
        OPTION_SECOND_LR / OPTION_LR if case.two_optimizers else 1.0,
    ]  # the bias's optimizer's, relative
    anchor = [w.astype(np.float64), b.astype(np.float64)]
    params = [list(anchor) for _ in range(p)]
    accumulated = [[np.zeros_like(a) for a in anchor] for _ in range(p)]
    averaged = [[np.zeros_like(a) for a in anchor] for _ in range(p)]
    evaluated = []
    step = 0
    for _ in range(OPTION_EPOCHS):
        for s in range(OPTION_STEPS):
            for r in range(p):
                x, y = (a.astype(np.float64) for a in batches[r][s])
                grads = mse_grads(params[r], x, y)
                if (step + 1) % accumulation:
                    accumulated[r] = [a + g for a, g in zip(accumulated[r], grads, strict=True)]
                    continue
                grads = [(g + a) / accumulation for g, a in zip(grads, accumulated[r], strict=True)]
                accumulated[r] = [np.zeros_like(a) for a in anchor]
                grads = clipped(case, grads)
                lr = learning_rate(case, step)
                decay = case.sgd.get("weight_decay") or 0.0
                kernel, bias = params[r]
                kernel = kernel - kernel * decay * lr  # "bias" is excluded from weight decay
                params[r] = [kernel - lr * rates[0] * grads[0], bias - lr * rates[1] * grads[1]]
            if case.ema and average_before_the_sync:
                averaged = [moving_average(case, step, averaged[r], params[r]) for r in range(p)]
            if (step + 1) % period == 0:
                deltas = [[q - a for q, a in zip(params[r], anchor, strict=True)] for r in range(p)]
                anchor = [a + d for a, d in zip(anchor, oracle.tree(deltas), strict=True)]
                params = [list(anchor) for _ in range(p)]
            if case.ema and not average_before_the_sync:
                averaged = [moving_average(case, step, averaged[0], params[0])] * p
            frequency = case.sgd.get("ema_overwrite_frequency")
            if frequency and (step // accumulation + 1) % frequency == 0:
                anchor = list(averaged[0])  # written into every replica: the next window starts there
                params = [list(averaged[r]) for r in range(p)]
            step += 1
        evaluated.append(list(averaged[0]) if case.ema else list(params[0]))
    weights = list(averaged[0]) if case.ema else list(params[0])
    return Reference(weights, list(averaged[0]) if case.ema else [], evaluated)


def moving_average(
    case: Case, step: int, average: list[np.ndarray], weights: list[np.ndarray]
) -> list[np.ndarray]:
    """Keras's update of the moving average at a step: momentum 0 at its first update (Keras's iterations,
    the updates with gradient accumulation, still 0)."""
    momentum = OPTION_EMA_MOMENTUM if step // case.accumulation else 0.0
    return [momentum * a + (1 - momentum) * v for a, v in zip(average, weights, strict=True)]


def mse(weights: list[np.ndarray], x: np.ndarray, y: np.ndarray) -> float:
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    return float(np.mean((x64 @ weights[0] + weights[1] - y64) ** 2))
