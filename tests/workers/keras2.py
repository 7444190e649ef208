"""The worker of tests/test_keras2.py's tests across processes: `python -m tests.workers.keras2 OUT
MODE[,MODE...]` (tests/workers/dispatch.py). The modes of one launch share one Keras: the test launches
those named keras2* with TF_USE_LEGACY_KERAS=1, so that `tf.keras` is tf_keras (Keras 2), the others
without it, and each mode checks which Keras `tf.keras` is.

    keras2, keras3       Horovod's `tf.keras` custom loop: a linear model, SGD, the gradients combined by
                         DistributedGradientTape(op=Adasum), the variables broadcast from rank 0 first
    keras2_fit_adasum    Horovod's Keras script under tf_keras: model.fit with
    keras2_fit_average   DistributedOptimizer(SGD with momentum, op=Adasum or Average), the broadcast and
                         metric-average callbacks, a checkpoint on rank 0; each rank starts from its own
                         initial weights, and the broadcast makes them rank 0's
    keras2_fit_adasum_k2 op=Adasum with backward_passes_per_step=2: 2 local steps between syncs
    keras2_fit_average_k2  op=Average with backward_passes_per_step=2: Horovod's gradient accumulation
    keras2_strategy_sgd_1   a tf_keras model compiled under AdasumStrategy() (SGD with momentum, sync
    keras2_strategy_adam_2  every step; Adam, every 2 steps), every process given the global batches
    keras2_callback_1    the same script with the plain optimizer and AdasumCallback(sync_every=1 or 2)
    keras2_callback_2    instead of DistributedOptimizer and the broadcast
    keras2_callback_outer_2  AdasumCallback(sync_every=2) with a tf_keras outer optimizer (SGD, Nesterov)
    keras2_callback_mean_2   AdasumCallback(sync_every=2, combine="mean")
    keras2_callback_bf16_2   AdasumCallback(sync_every=2, compression="bf16")

Each mode writes its rank's data, start and final weights (and fit's history) to OUT/{MODE}{rank}.npz;
the test checks them against numpy.
"""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np
import tensorflow as tf

import tf_adasum
import tf_adasum.keras as hvd
import tf_adasum.tensorflow as hvd_tf
from tests.support.training import BETA_1, BETA_2, EPSILON, LR, MOMENTUM, OUTERS, problem
from tests.workers.dispatch import main

STEPS = 3
EPOCHS, BATCH, ROWS = 2, 16, 32


def _data(rank: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(100 + rank)
    return rng.standard_normal((ROWS, 3)).astype(np.float32), rng.standard_normal((ROWS, 2)).astype(
        np.float32
    )


def _linear(rank: int) -> tuple[object, list[np.ndarray]]:
    rng = np.random.default_rng(200 + rank)  # every rank its own start
    start = [rng.standard_normal((3, 2)).astype(np.float32), rng.standard_normal(2).astype(np.float32)]
    model = tf.keras.Sequential([tf.keras.Input((3,)), tf.keras.layers.Dense(2)])
    model.set_weights(start)
    return model, start


def _check_keras(mode: str) -> None:
    expected = "tf_keras" if mode.startswith("keras2") else "keras"
    assert tf.keras.__name__.split(".")[0] == expected, (mode, tf.keras.__name__)


def custom_loop(out: Path, mode: str) -> None:
    _check_keras(mode)
    hvd.init()
    rank = hvd.rank()
    x, y = _data(rank)
    model, start = _linear(rank)
    optimizer = tf.keras.optimizers.SGD(0.1)
    hvd.broadcast_variables(model.variables, root_rank=0)

    @tf.function
    def step() -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
        tape = hvd_tf.DistributedGradientTape(tape, op=hvd.Adasum)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    for _ in range(STEPS):
        step()
    w, b = model.get_weights()
    np.savez(out / f"{mode}{rank}.npz", x=x, y=y, start=start[0], start_bias=start[1], w=w, b=b)
    print(f"rank {rank}: {tf.keras.__name__} custom loop done", flush=True)


def fit(
    out: Path,
    mode: str,
    op: object = None,
    sync_every: int = 0,
    passes: int = 1,
    outer: bool = False,
    combine: str = "adasum",
    compression: str = "none",
) -> None:
    """Horovod's script with DistributedOptimizer(op, backward_passes_per_step=passes) or, with
    sync_every, the plain optimizer and AdasumCallback(sync_every) (tf_adasum's own one line), with
    `combine` and `compression`, and with `outer`, OUTERS["nesterov"]'s outer optimizer, tf_keras's own."""
    _check_keras(mode)
    hvd.init()
    rank = hvd.rank()
    x, y = _data(rank)
    model, start = _linear(rank)
    optimizer = tf.keras.optimizers.SGD(LR, momentum=MOMENTUM)
    if sync_every:
        model.compile(optimizer, "mse")
        _, lr, momentum = OUTERS["nesterov"]
        made = tf.keras.optimizers.SGD(lr, momentum=momentum, nesterov=True) if outer else None
        callbacks = [
            tf_adasum.AdasumCallback(
                sync_every, outer_optimizer=made, combine=combine, compression=compression
            )
        ]
    else:
        model.compile(hvd.DistributedOptimizer(optimizer, op=op, backward_passes_per_step=passes), "mse")
        callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0)]
    callbacks.append(hvd.callbacks.MetricAverageCallback())
    if rank == 0:
        callbacks.append(
            tf.keras.callbacks.ModelCheckpoint(str(out / f"{mode}.weights.h5"), save_weights_only=True)
        )
    history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=callbacks)
    w, b = model.get_weights()
    np.savez(
        out / f"{mode}{rank}.npz", x=x, y=y, start=start[0], start_bias=start[1], w=w, b=b,
        loss=np.array(history.history["loss"]), optimizer=type(model.optimizer).__module__,
    )  # fmt: skip
    print(f"rank {rank}: {tf.keras.__name__} fit with {type(model.optimizer).__name__} done", flush=True)


def strategy(out: Path, mode: str, kind: str, sync_every: int) -> None:
    """model.fit of a tf_keras model compiled under AdasumStrategy() (one replica a process): every
    process is given the global batches and takes its share."""
    _check_keras(mode)
    x, y, w, b = problem()
    adasum = tf_adasum.AdasumStrategy(sync_every=sync_every)
    with adasum.scope():
        model = tf.keras.Sequential([tf.keras.Input((3,)), tf.keras.layers.Dense(2)])
        model.set_weights([w, b])
        optimizer = (
            tf.keras.optimizers.SGD(LR, momentum=MOMENTUM)
            if kind == "sgd_momentum"
            else tf.keras.optimizers.Adam(LR, beta_1=BETA_1, beta_2=BETA_2, epsilon=EPSILON)
        )
        model.compile(optimizer, "mse")
    history = model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    w, b = model.get_weights()
    rank = tf_adasum.init().rank
    np.savez(out / f"{mode}{rank}.npz", w=w, b=b, loss=np.array(history.history["loss"]))
    print(f"rank {rank}: {tf.keras.__name__} fit under AdasumStrategy done", flush=True)


MODES = {
    "keras2": lambda out: custom_loop(out, "keras2"),
    "keras3": lambda out: custom_loop(out, "keras3"),
    "keras2_fit_adasum": lambda out: fit(out, "keras2_fit_adasum", hvd.Adasum),
    "keras2_fit_average": lambda out: fit(out, "keras2_fit_average", hvd.Average),
    "keras2_fit_adasum_k2": lambda out: fit(out, "keras2_fit_adasum_k2", hvd.Adasum, passes=2),
    "keras2_fit_average_k2": lambda out: fit(out, "keras2_fit_average_k2", hvd.Average, passes=2),
    "keras2_strategy_sgd_1": lambda out: strategy(out, "keras2_strategy_sgd_1", "sgd_momentum", 1),
    "keras2_strategy_adam_2": lambda out: strategy(out, "keras2_strategy_adam_2", "adam", 2),
    "keras2_callback_1": lambda out: fit(out, "keras2_callback_1", sync_every=1),
    "keras2_callback_2": lambda out: fit(out, "keras2_callback_2", sync_every=2),
    "keras2_callback_outer_2": lambda out: fit(out, "keras2_callback_outer_2", sync_every=2, outer=True),
    "keras2_callback_mean_2": lambda out: fit(out, "keras2_callback_mean_2", sync_every=2, combine="mean"),
    "keras2_callback_bf16_2": lambda out: fit(
        out, "keras2_callback_bf16_2", sync_every=2, compression="bf16"
    ),
}

if __name__ == "__main__":
    main(MODES)
