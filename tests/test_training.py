"""model.fit under AdasumStrategy and with AdasumOptimizer, on logical CPUs, against a numpy simulation."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_adasum
from tests.support.training import (
    WRITES,
    StopAfter,
    build_linear,
    check_fit_write_fit,
    cpus,
    fit_write_fit,
    make_inner,
    problem,
    replica_values,
    simulate,
)


@pytest.mark.parametrize(
    ("kind", "p", "sync_every", "local_reduction"),
    [(k, p, s, "adasum") for k in ("sgd_momentum", "adam") for p in (2, 4) for s in (1, 2)]
    + [("adam", 4, 1, "mean"), ("sgd_momentum", 2, 2, "mean")],
)
def test_fit_equals_the_simulation(kind: str, p: int, sync_every: int, local_reduction: str) -> None:
    # local_reduction="mean" in one process: the replicas' deltas averaged (the tree over one process).
    x, y, _, _ = problem()
    strategy = tf_adasum.AdasumStrategy(
        devices=cpus(p), sync_every=sync_every, local_reduction=local_reduction
    )
    model = build_linear(strategy, lambda: make_inner(kind))  # a plain optimizer: the strategy wraps it
    assert isinstance(model.optimizer, tf_adasum.AdasumOptimizer)
    global_batch, steps = 4 * p, 4
    model.fit(
        x[: global_batch * steps],
        y[: global_batch * steps],
        batch_size=global_batch,
        shuffle=False,
        verbose=0,
    )
    groups = [p] if local_reduction == "mean" else None
    want = simulate(kind, p, sync_every, steps, global_batch, mean_groups=groups)
    if groups is not None:  # not the tree: the simulation tells the two apart
        assert not np.allclose(want[0], simulate(kind, p, sync_every, steps, global_batch)[0], atol=1e-4)
    # Adam divides by sqrt(v): float32 rounding of near-zero gradients moves its steps more than SGD's.
    atol = 2e-5 if kind == "adam" else 2e-6
    for got, w in zip(model.get_weights(), want, strict=True):
        np.testing.assert_allclose(got, w, rtol=2e-5, atol=atol)
    for components in replica_values(strategy, model):
        for c in components[1:]:
            np.testing.assert_array_equal(c, components[0])  # every replica bitwise the same
    assert int(model.optimizer.iterations.numpy()) == steps


@pytest.mark.parametrize("kind", ["sgd_momentum", "adam"])
def test_two_replicas_on_identical_rows_train_as_one_device(kind: str) -> None:
    # Each global batch is one device's batch twice: both replicas take the same step, and Adasum of two
    # equal deltas is that delta, bitwise (its coefficients are exactly 1/2). So the fit must equal one
    # device's, bit for bit, with every replica the same.
    x, y, _, _ = problem()
    batch, steps = 8, 4
    twice = [np.concatenate([a[i * batch : (i + 1) * batch]] * 2) for a in (x, y) for i in range(steps)]
    x2, y2 = np.concatenate(twice[:steps]), np.concatenate(twice[steps:])
    one = build_linear(tf.distribute.OneDeviceStrategy("/cpu:0"), lambda: make_inner(kind))
    one.fit(x[: batch * steps], y[: batch * steps], batch_size=batch, shuffle=False, verbose=0)
    strategy = tf_adasum.AdasumStrategy(devices=cpus(2))
    two = build_linear(strategy, lambda: make_inner(kind))
    two.fit(x2, y2, batch_size=2 * batch, shuffle=False, verbose=0)
    for got, want in zip(two.get_weights(), one.get_weights(), strict=True):
        np.testing.assert_array_equal(got, want)
    assert not np.array_equal(one.get_weights()[0], problem()[2]), "the fit moved the weights"
    for components in replica_values(strategy, two):
        for c in components[1:]:
            np.testing.assert_array_equal(c, components[0])


@pytest.mark.slow
@pytest.mark.parametrize(("how", "kind", "p", "sync_every"), WRITES)
def test_weights_written_between_two_fits_are_the_new_weights(
    how: str, kind: str, p: int, sync_every: int
) -> None:
    # As under MirroredStrategy: the written weights on every replica, then Adasum of the steps that
    # follow. Measured from the anchors of the last sync instead, the write itself would be combined
    # as if it were every replica's update.
    strategy = tf_adasum.AdasumStrategy(devices=cpus(p), sync_every=sync_every)
    model, *run = fit_write_fit(strategy, how, kind, p)
    check_fit_write_fit(model.get_weights(), how, kind, p, sync_every, tuple(run))
    for components in replica_values(strategy, model):
        for c in components[1:]:
            np.testing.assert_array_equal(c, components[0])


def test_a_model_compiled_outside_the_scope_trains_as_one_compiled_inside() -> None:
    # MirroredStrategy trains this (a slot-less optimizer, by name, created outside the scope); so must
    # AdasumStrategy, with Adasum, not refuse it at the first step.
    x, y, w, b = problem()
    strategy = tf_adasum.AdasumStrategy(devices=cpus(2))
    models = []
    for inside in (True, False):
        with strategy.scope():
            model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
            model.set_weights([w, b])
            if inside:
                model.compile(optimizer="sgd", loss="mse")
        if not inside:
            model.compile(optimizer="sgd", loss="mse")
        model.fit(x[:32], y[:32], batch_size=8, shuffle=False, verbose=0)
        assert isinstance(model.optimizer, tf_adasum.AdasumOptimizer)
        models.append(model)
    for inside, outside in zip(*(m.get_weights() for m in models), strict=True):
        np.testing.assert_array_equal(outside, inside)


def test_a_replica_whose_update_is_not_finite_stops_fit_naming_it_and_the_variable() -> None:
    # The cross-process sync's error, on local replicas too: not the kernel's InvalidArgumentError,
    # which names neither.
    x, y, _, _ = problem()
    x = x[:16].copy()
    x[5] = 1e30  # in replica 1's share of the first global batch: its gradient overflows float32
    strategy = tf_adasum.AdasumStrategy(devices=cpus(2))
    model = build_linear(strategy, lambda: make_inner("sgd_momentum"))
    with pytest.raises(tf_adasum.NonFiniteUpdateError) as raised:
        model.fit(x, y[:16], batch_size=8, shuffle=False, verbose=0)
    message = str(raised.value)
    assert "the update of replica(s) [1] is not finite" in message, message
    # Keras numbers the layers of later models: sequential_3/dense_3/kernel.
    assert re.search(
        r"replica 1: tensor 0 of 2 \(sequential\w*/dense\w*/kernel\) holds NaN or Inf", message
    ), message
    assert "lower the learning rate, clip the gradients" in message, message


def test_adasum_differs_from_mirrored_averaging() -> None:
    # The same run under MirroredStrategy (gradient mean) ends elsewhere: the test above can fail.
    x, y, _, _ = problem()
    mirrored = tf.distribute.MirroredStrategy(cpus(2), cross_device_ops=tf.distribute.ReductionToOneDevice())
    model = build_linear(mirrored, lambda: make_inner("sgd_momentum"))
    model.fit(x[:32], y[:32], batch_size=8, shuffle=False, verbose=0)
    want = simulate("sgd_momentum", 2, 1, 4, 8)
    assert not np.allclose(model.get_weights()[0], want[0], rtol=1e-3)


def test_wrapper_without_a_strategy_is_the_inner_optimizer() -> None:
    x, y, _, _ = problem()
    plain = build_linear(tf.distribute.get_strategy(), lambda: make_inner("adam"))
    wrapped = build_linear(
        tf.distribute.get_strategy(), lambda: tf_adasum.AdasumOptimizer(make_inner("adam"))
    )
    for model in (plain, wrapped):
        model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    for a, b in zip(plain.get_weights(), wrapped.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("wrapper", ["AdasumOptimizer", "AllreduceOptimizer"])
def test_fit_without_a_strategy_traces_its_train_step_once(wrapper: str) -> None:
    # Keras builds an optimizer without a strategy in the first trace of the train step; the slots made
    # there make TensorFlow trace the whole step again. tf_adasum builds its wrappers before the trace.
    x, y, _, _ = problem()
    wrap = getattr(tf_adasum, wrapper)
    model = build_linear(tf.distribute.get_strategy(), lambda: wrap(make_inner("adam")))
    traces: list[bool] = []
    train_step = model.train_step

    def traced_step(data: Any) -> Any:
        traces.append(tf.inside_function())
        return train_step(data)

    model.train_step = traced_step
    model.fit(x[:16], y[:16], batch_size=8, shuffle=False, verbose=0)
    assert traces == [True]
    assert int(model.optimizer.iterations.numpy()) == 2
    assert len(model.optimizer.variables) > len(model.trainable_variables)  # Adam's slots, made eagerly


def test_have_values_is_false_for_a_variable_made_in_the_trace() -> None:
    # What the optimizer's eager build and first-step broadcast and the strategy's adoption ask before
    # they read weights: a variable made inside the function being traced has no value until it runs.
    from tf_adasum.common.variables import have_values

    made = keras.Variable(np.ones(3, np.float32))
    seen: list[bool] = []
    inside: list[keras.Variable] = []

    @tf.function
    def step() -> tf.Tensor:
        if not inside:
            inside.append(keras.Variable(np.zeros(3, np.float32)))
        with tf.init_scope():
            seen.append(have_values([made]))
            seen.append(have_values([made, inside[0]]))
        return inside[0] + 1.0

    step()
    assert seen[:2] == [True, False]
    assert have_values([made, inside[0]]) and have_values([])


def digits_data() -> tuple[np.ndarray, ...]:
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)[..., None]
    y = digits.target.astype(np.int32)
    order = np.random.default_rng(0).permutation(len(y))
    x, y = x[order], y[order]
    return x[:1500], y[:1500], x[1500:], y[1500:]


def digits_cnn(
    strategy: tf.distribute.Strategy, after_conv: tuple[Any, ...] = (), after_logits: tuple[Any, ...] = ()
) -> keras.Model:
    """The small CNN the digits tests train (seeded), compiled with Adam under `strategy`."""
    keras.utils.set_random_seed(1)
    with strategy.scope():
        layers = [keras.Input((8, 8, 1)), keras.layers.Conv2D(16, 3, activation="relu"), *after_conv]
        model = keras.Sequential([*layers, keras.layers.Flatten(), keras.layers.Dense(10), *after_logits])
        model.compile(
            optimizer=keras.optimizers.Adam(3e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    return model


def test_cnn_on_digits_trains_with_four_replicas() -> None:
    x, y, x_val, y_val = digits_data()
    strategy = tf_adasum.AdasumStrategy(devices=cpus(4))
    model = digits_cnn(strategy, after_conv=(keras.layers.BatchNormalization(),))
    history = model.fit(x, y, batch_size=64, epochs=8, validation_data=(x_val, y_val), verbose=0)
    assert history.history["val_accuracy"][-1] > 0.9, history.history


def test_save_restore_and_resume(tmp_path: Path) -> None:
    x, y, _, _ = problem()
    strategy = tf_adasum.AdasumStrategy(devices=cpus(2))
    model = build_linear(strategy, lambda: make_inner("adam"))
    model.fit(x[:16], y[:16], batch_size=8, shuffle=False, verbose=0)

    model.save(tmp_path / "model.keras")
    with strategy.scope():
        loaded = keras.models.load_model(tmp_path / "model.keras")
    assert isinstance(loaded.optimizer, tf_adasum.AdasumOptimizer)
    assert isinstance(loaded.optimizer.inner, keras.optimizers.Adam)
    assert int(loaded.optimizer.iterations.numpy()) == 2
    for a, b in zip(loaded.optimizer.inner.variables, model.optimizer.inner.variables, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy())  # Adam's moments came back too
    for a, b in zip(model.get_weights(), loaded.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)

    checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
    path = checkpoint.save(tmp_path / "ckpt")
    saved = model.get_weights()
    model.fit(x[16:32], y[16:32], batch_size=8, shuffle=False, verbose=0)
    checkpoint.restore(path)
    for a, b in zip(model.get_weights(), saved, strict=True):
        np.testing.assert_array_equal(a, b)
    for components in replica_values(strategy, model):
        for c in components[1:]:
            np.testing.assert_array_equal(c, components[0])
    assert int(model.optimizer.iterations.numpy()) == 2

    model.save_weights(tmp_path / "w.weights.h5")
    other = build_linear(strategy, lambda: make_inner("adam"))
    other.load_weights(tmp_path / "w.weights.h5")
    for a, b in zip(other.get_weights(), saved, strict=True):
        np.testing.assert_array_equal(a, b)


class RecordStart(keras.callbacks.Callback):
    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self.weights = self.model.get_weights()
        self.iterations = int(self.model.optimizer.iterations.numpy())


def test_backup_and_restore_resumes_from_the_interrupted_state(tmp_path: Path) -> None:
    # Keras 3 restores the state saved mid-epoch, then reruns that epoch from its first batch.
    x, y, _, _ = problem()
    strategy = tf_adasum.AdasumStrategy(devices=cpus(2))
    backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"), save_freq=2)
    stop = StopAfter(4)
    model = build_linear(strategy, lambda: make_inner("sgd_momentum"))
    with pytest.raises(RuntimeError, match="interrupted"):
        model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[backup, stop])

    resumed = build_linear(strategy, lambda: make_inner("sgd_momentum"))
    start = RecordStart()
    resumed.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[backup, start])
    for a, b in zip(start.weights, stop.weights, strict=True):
        np.testing.assert_array_equal(a, b)
    assert start.iterations == 4
    for components in replica_values(strategy, resumed):
        for c in components[1:]:
            np.testing.assert_array_equal(c, components[0])


def test_bad_use_gives_clear_errors() -> None:
    with pytest.raises(TypeError, match=r"AdasumOptimizer wraps a Keras optimizer.*got builtins\.str"):
        tf_adasum.AdasumOptimizer("adam")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="sync_every must be a positive integer, got 0"):
        tf_adasum.AdasumOptimizer(keras.optimizers.SGD(), sync_every=0)
    for make in (tf_adasum.AdasumStrategy, tf_adasum.AdasumCallback):  # one check for all three
        with pytest.raises(ValueError, match="sync_every must be a positive integer, got True"):
            make(sync_every=True)
    with pytest.raises(ValueError, match="already an AdasumOptimizer"):
        tf_adasum.AdasumOptimizer(tf_adasum.AdasumOptimizer(keras.optimizers.SGD()))

    x, y, _, _ = problem()
    strategy = tf_adasum.AdasumStrategy(devices=cpus(2))
    optimizer_outside = keras.optimizers.SGD()
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        model.compile(optimizer=optimizer_outside, loss="mse")
    with pytest.raises(ValueError, match=r"inside the same strategy\.scope"):
        model.fit(x, y, batch_size=8, verbose=0)

    outside = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    with strategy.scope():
        outside.compile(optimizer="sgd", loss="mse")
    with pytest.raises((ValueError, RuntimeError), match=r"scope|Strategy"):
        outside.fit(x, y, batch_size=8, verbose=0)


def test_schedule_weight_decay_and_clipping_apply_in_the_local_step() -> None:
    # Both replicas get the same batch, so their deltas are equal and adasum(d, d) = d exactly: two
    # replicas must then equal one process running the same AdamW with its schedule, decay and clipping.
    x, y, _, _ = problem()
    local = 4
    duplicated = np.concatenate([np.concatenate([x[i : i + local]] * 2) for i in range(0, 32, local)])
    duplicated_y = np.concatenate([np.concatenate([y[i : i + local]] * 2) for i in range(0, 32, local)])

    def adamw() -> keras.optimizers.Optimizer:
        schedule = keras.optimizers.schedules.ExponentialDecay(0.05, decay_steps=2, decay_rate=0.5)
        return keras.optimizers.AdamW(schedule, weight_decay=0.1, clipnorm=0.5)

    single = build_linear(tf.distribute.get_strategy(), adamw)
    single.fit(x[:32], y[:32], batch_size=local, shuffle=False, verbose=0)
    strategy = tf_adasum.AdasumStrategy(devices=cpus(2))
    model = build_linear(strategy, adamw)
    model.fit(duplicated, duplicated_y, batch_size=2 * local, shuffle=False, verbose=0)
    for a, b in zip(model.get_weights(), single.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert float(model.optimizer.learning_rate.numpy()) == pytest.approx(0.05 * 0.5**4)


def test_evaluate_and_predict_under_the_strategy() -> None:
    x, y, _, _ = problem()
    strategy = tf_adasum.AdasumStrategy(devices=cpus(2))
    model = build_linear(strategy, lambda: make_inner("sgd_momentum"))
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    predictions = model.predict(x, batch_size=8, verbose=0)
    w, b = model.get_weights()
    np.testing.assert_allclose(predictions, x @ w + b, rtol=1e-5, atol=1e-6)
    loss = model.evaluate(x, y, batch_size=8, verbose=0)
    assert loss == pytest.approx(float(np.mean((x @ w + b - y) ** 2)), rel=1e-5)


def test_the_strategy_holds_its_latest_iterators_until_newer_ones_replace_them() -> None:
    # Keras's fit and evaluate drop the iterator of their symbolic build at once, and destroying a
    # MultiDeviceIterator while its background thread reads kills the process (strategy.py,
    # _keeping_iterators): an iterator the caller dropped must outlive KEPT_ITERATORS newer ones.
    import gc
    import weakref

    from tf_adasum.training.strategy import KEPT_ITERATORS

    strategy = tf_adasum.AdasumStrategy(devices=cpus(2))
    for distributed in (
        strategy.experimental_distribute_dataset(tf.data.Dataset.range(64).batch(8)),
        strategy.distribute_datasets_from_function(lambda context: tf.data.Dataset.range(64).batch(4)),
    ):
        assert isinstance(distributed, tf.distribute.DistributedDataset)
        dropped = weakref.ref(iter(distributed))
        gc.collect()
        assert dropped() is not None
        newer = [iter(distributed) for _ in range(KEPT_ITERATORS)]
        gc.collect()
        assert dropped() is None
        # Each still reads the data, split over the replicas.
        first = next(newer[-1])
        assert [int(v.shape[0]) for v in strategy.experimental_local_results(first)] in ([4, 4], [4])
        del newer

    # fit and evaluate go through it: a fresh strategy holds their iterators (the symbolic build's and
    # the epoch's, among others) and no others.
    strategy = tf_adasum.AdasumStrategy(devices=cpus(2))
    x = np.ones((32, 3), np.float32)
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.fit(x, x[:, :2], batch_size=8, verbose=0)
    from_fit = {id(i) for i in strategy._recent_iterators}
    assert from_fit
    model.evaluate(x, x[:, :2], batch_size=8, verbose=0)
    assert {id(i) for i in strategy._recent_iterators} - from_fit


@pytest.mark.slow
def test_thirty_two_replicas_run_three_epochs_and_predict_a_partial_batch(tmp_path: Path) -> None:
    # Epoch boundaries used to stall for minutes at 32 replicas (see _compat.quiet_per_device_iterators).
    import json
    import subprocess
    import sys

    env = {
        **os.environ,
        "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
        "TF_ADASUM_TEST_REPLICAS": "32",
        "TF_ADASUM_TEST_EPOCHS": "3",  # two epoch boundaries
    }
    try:
        subprocess.run(
            [sys.executable, "-m", "tests.workers.training_replicas", str(tmp_path), "fit_then_predict"],
            env=env,
            capture_output=True,
            timeout=240,
            check=True,
        )
    except subprocess.TimeoutExpired:
        progress = tmp_path / "replicas.progress"
        done = progress.read_text() if progress.exists() else "0"
        pytest.fail(f"32 replicas stalled: {done} of 3 epochs in 240 s")
    result = json.loads((tmp_path / "replicas.json").read_text())
    assert result["epochs"] == 3, result
    assert max(result["seconds"]) < 60, result  # the first epoch traces; none waits on tf.data threads
    assert result["predict"] == {"rows": 2160, "error": None}


def _train(model: keras.Model, x: np.ndarray, y: np.ndarray, global_batch: int, **kwargs: Any) -> None:
    model.fit(x, y, batch_size=global_batch, shuffle=False, verbose=0, **kwargs)


def _replica_states(strategy: tf.distribute.Strategy, model: keras.Model) -> list[list[np.ndarray]]:
    return [
        [c.numpy() for c in strategy.experimental_local_results(v.value)]
        for v in model.optimizer.inner.variables
    ]


@pytest.mark.parametrize(
    "how", ["checkpoint", "checkpoint_after_build", "save_weights", "backup_and_restore"]
)
@pytest.mark.parametrize("kind", ["sgd_momentum", "adam"])
@pytest.mark.parametrize("p", [2, 3])
def test_resuming_equals_training_without_a_break(p: int, kind: str, how: str, tmp_path: Path) -> None:
    # Each replica's optimizer state is its own and must come back to that replica; otherwise the
    # resumed run drifts from the uninterrupted one.
    x, y, _, _ = problem()
    global_batch, k = 4 * p, 2
    first, second = slice(0, k * global_batch), slice(k * global_batch, 2 * k * global_batch)
    strategy = tf_adasum.AdasumStrategy(devices=cpus(p))
    whole = build_linear(strategy, lambda: make_inner(kind))
    _train(whole, x[: 2 * k * global_batch], y[: 2 * k * global_batch], global_batch)

    before = build_linear(strategy, lambda: make_inner(kind))
    after = build_linear(strategy, lambda: make_inner(kind))
    if how == "backup_and_restore":
        backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"), save_freq=k)
        with pytest.raises(RuntimeError, match="interrupted"):
            _train(before, x[: 2 * k * global_batch], y[: 2 * k * global_batch], global_batch,
                   callbacks=[backup, StopAfter(k + 1)])  # fmt: skip
        # Keras 3 reruns the interrupted epoch from its first batch: resume on the second half only.
        _train(after, x[second], y[second], global_batch, callbacks=[backup])
    else:
        _train(before, x[first], y[first], global_batch)
        states = _replica_states(strategy, before)
        assert any(not np.array_equal(s[0], s[1]) for s in states), "replicas' states should differ"
        if how == "checkpoint":  # into an optimizer not built yet: the restore waits for its variables
            path = tf.train.Checkpoint(model=before, optimizer=before.optimizer).save(tmp_path / "ckpt")
            tf.train.Checkpoint(model=after, optimizer=after.optimizer).restore(path)
            with strategy.scope():
                after.optimizer.build(after.trainable_variables)
        elif how == "checkpoint_after_build":  # into one that has trained elsewhere: all of it replaced
            _train(after, x[second][::-1], y[second][::-1], global_batch)
            path = tf.train.Checkpoint(model=before, optimizer=before.optimizer).save(tmp_path / "ckpt")
            tf.train.Checkpoint(model=after, optimizer=after.optimizer).restore(path)
        else:
            before.save_weights(tmp_path / "w.weights.h5")
            with strategy.scope():
                after.optimizer.build(after.trainable_variables)
            after.load_weights(tmp_path / "w.weights.h5")
        for restored, saved in zip(_replica_states(strategy, after), states, strict=True):
            for a, b in zip(restored, saved, strict=True):
                np.testing.assert_array_equal(a, b)  # each replica got its own state back
        _train(after, x[second], y[second], global_batch)
    for a, b in zip(after.get_weights(), whole.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)


def test_resuming_on_another_number_of_replicas_warns_and_starts_every_replica_from_replica_0(
    tmp_path: Path,
) -> None:
    x, y, _, _ = problem()
    two = tf_adasum.AdasumStrategy(devices=cpus(2))
    before = build_linear(two, lambda: make_inner("sgd_momentum"))
    _train(before, x[:16], y[:16], 8)
    before.save_weights(tmp_path / "w.weights.h5")
    replica_0 = [s[0] for s in _replica_states(two, before)]
    three = tf_adasum.AdasumStrategy(devices=cpus(3))
    after = build_linear(three, lambda: make_inner("sgd_momentum"))
    with three.scope():
        after.optimizer.build(after.trainable_variables)
    with pytest.warns(UserWarning, match="state of 2 replicas but this strategy has 3"):
        after.load_weights(tmp_path / "w.weights.h5")
    for restored, first in zip(_replica_states(three, after), replica_0, strict=True):
        for component in restored:
            np.testing.assert_array_equal(component, first)


class WithAnUnusedWeight(keras.layers.Layer):
    """A Dense layer that also owns a weight its output never uses: its gradient is None."""

    def build(self, input_shape: Any) -> None:
        self.kernel = self.add_weight(shape=(input_shape[-1], 2), initializer="ones")
        self.unused = self.add_weight(shape=(4,), initializer="ones")

    def call(self, x: Any) -> Any:
        return keras.ops.matmul(x, self.kernel)


@pytest.mark.parametrize("kind", ["sgd_momentum", "adam"])
def test_a_variable_without_a_gradient_stays_put(kind: str) -> None:
    x, y, _, _ = problem()
    strategy = tf_adasum.AdasumStrategy(devices=cpus(2))
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), WithAnUnusedWeight()])
        model.compile(optimizer=make_inner(kind), loss="mse")
    with pytest.warns(UserWarning, match="Gradients do not exist"):  # Keras's own word for it
        model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    kernel, unused = model.get_weights()
    np.testing.assert_array_equal(unused, np.ones(4))
    assert not np.allclose(kernel, 1.0)  # the used weight trained
    for components in replica_values(strategy, model):
        for c in components[1:]:
            np.testing.assert_array_equal(c, components[0])


def test_a_train_step_without_adasum_under_the_strategy_is_refused() -> None:
    x, y, _, _ = problem()
    strategy = tf_adasum.AdasumStrategy(devices=cpus(2))
    model = build_linear(strategy, lambda: make_inner("sgd_momentum"))
    with strategy.scope():
        model.optimizer = make_inner("sgd_momentum")  # replaced after compile: nothing wraps it
    with pytest.raises(ValueError, match="AdasumStrategy is training with SGD, not an AdasumOptimizer"):
        model.fit(x, y, batch_size=8, verbose=0)


def test_the_wrapper_follows_loss_scale_optimizer_and_reads_earlier_saves(tmp_path: Path) -> None:
    x, y, _, _ = problem()
    strategy = tf_adasum.AdasumStrategy(devices=cpus(2))
    model = build_linear(strategy, lambda: make_inner("adam"))
    model.fit(x[:16], y[:16], batch_size=8, shuffle=False, verbose=0)
    optimizer = model.optimizer
    assert optimizer.inner is optimizer.inner_optimizer
    own = optimizer._variables
    assert [id(v) for v in optimizer.variables] == [id(v) for v in own + optimizer.inner_optimizer.variables]

    # The config says inner_optimizer now; a config that says inner, as before, still loads.
    config = optimizer.get_config()
    config["inner"] = config.pop("inner_optimizer")
    with strategy.scope():
        assert isinstance(
            tf_adasum.AdasumOptimizer.from_config(config).inner_optimizer, keras.optimizers.Adam
        )

    # A store written before `variables` listed the inner optimizer's holds this optimizer's own only.
    store: dict[str, Any] = {}
    optimizer.save_own_variables(store)
    earlier = {str(i): store[str(i)] for i in range(len(own))}
    other = build_linear(strategy, lambda: make_inner("adam"))
    with strategy.scope():
        other.optimizer.build(other.trainable_variables)
    other.optimizer.load_own_variables(earlier)
    for got, want in zip(other.optimizer._variables, own, strict=True):
        np.testing.assert_array_equal(got.numpy(), want.numpy())  # the anchors among them

    # A tf.train.Checkpoint from before the rename calls the inner optimizer "inner": it restores.
    before = tf.Module()
    before.inner = optimizer.inner_optimizer
    path = tf.train.Checkpoint(optimizer=before).save(tmp_path / "ckpt")
    with strategy.scope():
        fresh = tf_adasum.AdasumOptimizer(make_inner("adam"))
        fresh.build(model.trainable_variables)
    tf.train.Checkpoint(optimizer=fresh).restore(path).expect_partial()
    assert int(fresh.inner_optimizer.iterations.numpy()) == 2
