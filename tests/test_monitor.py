"""OrthogonalityMonitor on constructed updates of known orthogonality, under AdasumStrategy.

Four replicas, one example each, a model of two bias-free Dense branches starting at zero: replica r's
first input is (r + 1) e_r and its second e_0, so plain SGD moves the first kernel along orthogonal
directions of different lengths (orthogonality 1: Adasum adds them) and the second by one same step
(orthogonality 1/4: Adasum returns it once). The same cases across processes, under AdasumCallback,
are in test_existing_scripts.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_adasum
from tests.support.training import cpus

P = 4


def two_branches(strategy: tf.distribute.Strategy, optimizer: Any) -> keras.Model:
    with strategy.scope():
        orthogonal, parallel = keras.Input((P,)), keras.Input((P,))
        zeros = {"use_bias": False, "kernel_initializer": "zeros"}
        out = keras.layers.Add()(
            [
                keras.layers.Dense(1, name="orthogonal", **zeros)(orthogonal),
                keras.layers.Dense(1, name="parallel", **zeros)(parallel),
            ]
        )
        model = keras.Model([orthogonal, parallel], out)
        model.compile(optimizer=optimizer(), loss="mse")
    return model


def constructed_data(steps: int = 1, lengths: bool = True) -> tuple[list[np.ndarray], np.ndarray]:
    """Replica r's first input is (r + 1) e_r with `lengths`; without, e_r, which gives every replica the
    same error at every step, by symmetry, so that the parallel steps stay equal after a sync too."""
    eye = np.eye(P, dtype=np.float32)
    scale = np.arange(1, P + 1, dtype=np.float32)[:, None] if lengths else 1
    first = np.concatenate([eye * scale] * steps)
    second = np.concatenate([np.tile(eye[:1], (P, 1))] * steps)  # and e_0
    return [first, second], np.ones((P * steps, 1), np.float32)


def test_orthogonal_parallel_and_mixed_updates_give_1_one_over_n_and_between(tmp_path: Path) -> None:
    strategy = tf_adasum.AdasumStrategy(devices=cpus(P))
    model = two_branches(strategy, lambda: keras.optimizers.SGD(0.1))
    monitor = tf_adasum.callbacks.OrthogonalityMonitor(every=1)
    board = keras.callbacks.TensorBoard(str(tmp_path / "logs"))
    x, y = constructed_data()
    history = model.fit(x, y, batch_size=P, shuffle=False, verbose=0, callbacks=[monitor, board])

    values = monitor.values()
    assert values["orthogonality/orthogonal/kernel"] == pytest.approx(1.0, rel=1e-12)
    assert values["orthogonality/parallel/kernel"] == pytest.approx(1 / P, rel=1e-12)
    assert values["orthogonality"] == pytest.approx((1 + 1 / P) / 2, rel=1e-12)
    assert monitor.history == [(1, values)]  # one report per step with every=1
    assert history.history["orthogonality/parallel/kernel"] == [pytest.approx(1 / P, rel=1e-12)]

    # TensorBoard, after the monitor in the list, wrote them as scalars.
    tags = set()
    for event_file in (tmp_path / "logs").rglob("events.out.tfevents.*"):
        for event in tf.compat.v1.train.summary_iterator(str(event_file)):
            tags |= {value.tag for value in event.summary.value}
    assert {"epoch_orthogonality", "epoch_orthogonality/parallel/kernel"} <= tags, tags


def test_reports_every_n_steps_and_stops_recording_after_fit() -> None:
    strategy = tf_adasum.AdasumStrategy(devices=cpus(P), sync_every=2)
    model = two_branches(strategy, lambda: keras.optimizers.SGD(0.1, momentum=0.9))
    monitor = tf_adasum.callbacks.OrthogonalityMonitor(every=2)
    x, y = constructed_data(steps=6, lengths=False)
    model.fit(x, y, batch_size=P, shuffle=False, verbose=0, callbacks=[monitor])
    assert [step for step, _ in monitor.history] == [2, 4, 6]
    for _, values in monitor.history:  # the same directions at every sync, momentum or not
        assert values["orthogonality/orthogonal/kernel"] == pytest.approx(1.0, rel=1e-12)
        assert values["orthogonality/parallel/kernel"] == pytest.approx(1 / P, rel=1e-12)
    assert tf_adasum.training.model_sync.sync_stats(model.optimizer) is None
    recorded = int(monitor._stats.syncs.numpy())
    model.fit(x, y, batch_size=P, shuffle=False, verbose=0)  # without the monitor: nothing recorded
    assert int(monitor._stats.syncs.numpy()) == recorded == 3


def test_a_monitor_without_adasum_warns_and_bad_arguments_are_refused() -> None:
    model = two_branches(tf.distribute.get_strategy(), lambda: keras.optimizers.SGD(0.1))
    x, y = constructed_data()
    with pytest.warns(UserWarning, match="OrthogonalityMonitor has seen no Adasum sync"):
        model.fit(x, y, batch_size=P, verbose=0, callbacks=[tf_adasum.callbacks.OrthogonalityMonitor()])
    with pytest.raises(ValueError, match="every must be a positive integer, got 0"):
        tf_adasum.callbacks.OrthogonalityMonitor(every=0)
