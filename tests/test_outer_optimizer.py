"""Local SGD with an outer optimizer (AdasumStrategy(sync_every=H, outer_optimizer=...)): at every sync the
replicas' combined delta, negated, is the gradient a real Keras optimizer steps the last synced weights
with; its state is one copy, the same on every replica, saved with the model.

Against the numpy simulation of the replicas (tests/support/training.py) with Keras's SGD, SGD with
Nesterov momentum and Adam as outer optimizers, on 2 and 3 replicas, H 1 and 4; Adasum and the mean (the
combine option, DiLoCo as published) told apart.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_adasum
from tests.support.training import (
    OUTERS,
    Outer,
    build_linear,
    cpus,
    make_inner,
    problem,
    replica_values,
    simulate,
)

STEPS = 8
# How far the weights after 8 steps (2 syncs) may lie from fp32's when the deltas travel narrowed: 4 unit
# roundoffs of the wire's dtype (bfloat16 2^-9, float16 2^-12) times the largest distance the fp32 run
# moved a weight. Measured: 0.5-1.7 unit roundoffs (2 and 3 processes, Adasum and the mean).
COMPRESSED_TOLERANCE = {"bf16": 4 * 2.0**-9, "fp16": 4 * 2.0**-12}


def fit(
    p: int, sync_every: int, outer: Outer | None, combine: str = "adasum", epochs: int = 1
) -> keras.Model:
    x, y, _, _ = problem()
    strategy = tf_adasum.AdasumStrategy(
        devices=cpus(p),
        sync_every=sync_every,
        outer_optimizer=None if outer is None else outer.keras(),
        combine=combine,
    )
    model = build_linear(strategy, lambda: make_inner("sgd_momentum"))
    rows = 2 * p * STEPS
    model.fit(x[:rows], y[:rows], batch_size=2 * p, epochs=epochs, shuffle=False, verbose=0)
    return model


def assert_replicas_alike(model: keras.Model) -> None:
    for components in replica_values(model.distribute_strategy, model):
        for c in components[1:]:
            np.testing.assert_array_equal(c, components[0])


@pytest.mark.parametrize(
    ("outer", "p", "sync_every"),
    [(o, p, h) for o in ("sgd", "nesterov", "adam") for p in (2, 3) for h in (1, 4)],
)
def test_the_outer_step_equals_numpy(outer: str, p: int, sync_every: int) -> None:
    model = fit(p, sync_every, Outer(*OUTERS[outer]))
    want = simulate("sgd_momentum", p, sync_every, STEPS, 2 * p, outer=Outer(*OUTERS[outer]))
    plain = simulate("sgd_momentum", p, sync_every, STEPS, 2 * p)
    assert not np.allclose(want[0], plain[0], atol=1e-3)  # the outer step shows in the result
    for got, w in zip(model.get_weights(), want, strict=True):
        np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-5)
    assert_replicas_alike(model)
    # The outer optimizer stepped once a sync, and its state lives under the strategy.
    outer_optimizer = model.optimizer.outer_optimizer
    assert int(outer_optimizer.iterations.numpy()) == STEPS // sync_every
    assert outer_optimizer is not model.distribute_strategy.outer_optimizer  # a copy, per wrapped optimizer


@pytest.mark.parametrize("p", [2, 3])
def test_the_mean_is_diloco_and_differs_from_adasum(p: int) -> None:
    model = fit(p, 4, Outer(*OUTERS["nesterov"]), combine="mean")
    want = simulate("sgd_momentum", p, 4, STEPS, 2 * p, outer=Outer(*OUTERS["nesterov"]), combine="mean")
    adasum = simulate("sgd_momentum", p, 4, STEPS, 2 * p, outer=Outer(*OUTERS["nesterov"]))
    assert not np.allclose(want[0], adasum[0], atol=1e-4)
    for got, w in zip(model.get_weights(), want, strict=True):
        np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-5)
    assert_replicas_alike(model)


def test_the_mean_without_an_outer_optimizer_is_model_averaging() -> None:
    model = fit(3, 2, None, combine="mean")
    want = simulate("sgd_momentum", 3, 2, STEPS, 6, combine="mean")
    for got, w in zip(model.get_weights(), want, strict=True):
        np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-6)


def test_an_outer_sgd_of_rate_one_is_plain_adasum_bit_for_bit() -> None:
    """anchor - 1 * (-combined) is anchor + combined exactly: the outer step's plumbing (back to the anchor,
    then the Keras step) adds no rounding of its own."""
    plain = fit(3, 4, None).get_weights()
    outer = fit(3, 4, Outer("sgd", 1.0)).get_weights()
    for a, b in zip(plain, outer, strict=True):
        np.testing.assert_array_equal(a, b)


def test_resume_mid_run_equals_the_run_uninterrupted(tmp_path: Path) -> None:
    """Saved after 9 steps of windows of 3 (3 outer steps), loaded under the strategy's scope, and fit on
    for 6 more: bitwise the run that never stopped. The outer optimizer's momentum comes back with the
    model; a model whose outer state is lost ends elsewhere (so this test can fail). (A .keras file holds
    one replica's weights: saved mid-window, the replicas' own steps since the window opened are lost,
    with or without an outer optimizer.)"""
    x, y, _, _ = problem()
    first_rows, all_rows = 4 * 9, 4 * 15  # global batches of 4 (2 replicas): steps 1-9, then 10-15

    def strategy() -> tf_adasum.AdasumStrategy:
        outer = Outer(*OUTERS["momentum"]).keras()
        return tf_adasum.AdasumStrategy(devices=cpus(2), sync_every=3, outer_optimizer=outer)

    whole = build_linear(strategy(), lambda: make_inner("adam"))
    whole.fit(x[:all_rows], y[:all_rows], batch_size=4, shuffle=False, verbose=0)

    first = build_linear(strategy(), lambda: make_inner("adam"))
    first.fit(x[:first_rows], y[:first_rows], batch_size=4, shuffle=False, verbose=0)
    first.save(tmp_path / "model.keras")
    results = []
    for lose_the_outer_state in (False, True):
        again = strategy()
        with again.scope():
            loaded = keras.models.load_model(tmp_path / "model.keras")
        outer = loaded.optimizer.outer_optimizer
        assert isinstance(outer, keras.optimizers.SGD) and outer.momentum == 0.5
        assert int(outer.iterations.numpy()) == 3
        if lose_the_outer_state:
            for momentum in outer.momentums:
                momentum.assign(np.zeros(momentum.shape, np.float32))
        rest = slice(first_rows, all_rows)
        loaded.fit(x[rest], y[rest], batch_size=4, shuffle=False, verbose=0)
        assert_replicas_alike(loaded)  # step 15 synced
        results.append(loaded.get_weights())
    assert_replicas_alike(whole)
    for a, b in zip(results[0], whole.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    assert not np.allclose(results[1][0], whole.get_weights()[0], atol=1e-5)


def test_a_custom_loop_steps_the_outer_optimizer_and_a_checkpoint_holds_its_state(tmp_path: Path) -> None:
    """TensorFlow's custom loop under AdasumStrategy(outer_optimizer=...): a plain optimizer stepped in
    strategy.run, the loss by tf.nn.compute_average_loss; equal to numpy's replicas. tf.train.Checkpoint
    of the plain optimizer holds the outer state."""
    x, y, w, b = problem()
    p, sync_every = 2, 4
    strategy = tf_adasum.AdasumStrategy(
        devices=cpus(p), sync_every=sync_every, outer_optimizer=Outer(*OUTERS["nesterov"]).keras()
    )
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        model.set_weights([w, b])
        optimizer = make_inner("sgd_momentum")
    global_batch = 2 * p
    data = tf.data.Dataset.from_tensor_slices((x[: global_batch * STEPS], y[: global_batch * STEPS]))
    dataset = strategy.experimental_distribute_dataset(data.batch(global_batch))

    @tf.function
    def train(batch: Any) -> None:
        def step(xr: tf.Tensor, yr: tf.Tensor) -> None:
            with tf.GradientTape() as tape:
                per_example = tf.reduce_mean(tf.square(model(xr) - yr), axis=1)
                loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))

        strategy.run(step, args=batch)

    for batch in dataset:
        train(batch)
    want = simulate("sgd_momentum", p, sync_every, STEPS, global_batch, outer=Outer(*OUTERS["nesterov"]))
    for got, expected in zip(model.get_weights(), want, strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    assert_replicas_alike(model)

    outer = tf_adasum.AdasumOptimizer.wrapping(optimizer).outer_optimizer
    saved = [v.numpy() for v in outer.variables]
    assert int(outer.iterations.numpy()) == STEPS // sync_every and np.any(saved[-1] != 0)
    path = tf.train.Checkpoint(optimizer=optimizer).save(tmp_path / "ckpt")
    for v in outer.variables:
        v.assign(tf.zeros_like(v))
    tf.train.Checkpoint(optimizer=optimizer).restore(path)
    for v, s in zip(outer.variables, saved, strict=True):
        np.testing.assert_array_equal(v.numpy(), s)


def test_a_replica_whose_delta_is_not_finite_stops_the_mean_naming_the_variable() -> None:
    """combine="mean" checks as the tree does: a NaN or Inf in any replica's delta raises
    NonFiniteUpdateError before the sync writes a weight, never a silent mean of NaN."""
    x, y, _, _ = problem()
    x = x[:16].copy()
    x[5] = 1e30  # in replica 1's share of the first global batch: its gradient overflows float32
    strategy = tf_adasum.AdasumStrategy(
        devices=cpus(2), combine="mean", outer_optimizer=Outer(*OUTERS["nesterov"]).keras()
    )
    model = build_linear(strategy, lambda: make_inner("sgd_momentum"))
    with pytest.raises(tf_adasum.NonFiniteUpdateError) as raised:
        model.fit(x, y[:16], batch_size=8, shuffle=False, verbose=0)
    message = str(raised.value)
    assert re.search(r"sequential\w*/dense\w*/kernel \(1 replica\(s\)\)", message), message
    assert "every replica stops at this step" in message, message
    assert int(model.optimizer.outer_optimizer.iterations.numpy()) == 0


# AdasumCallback(outer_optimizer=...) in one process, where the sync of one delta is that delta (across
# processes: test_across_processes_the_outer_state_is_one_and_the_step_equals_numpy).


def plain_model(make_optimizer: Any) -> keras.Model:
    _, _, w, b = problem()
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.set_weights([w, b])
    model.compile(optimizer=make_optimizer(), loss="mse")
    return model


@pytest.mark.parametrize(("outer", "sync_every"), [("nesterov", 4), ("adam", 1), ("sgd", 2)])
def test_the_callback_steps_the_outer_optimizer_as_numpy(outer: str, sync_every: int) -> None:
    x, y, _, _ = problem()
    model = plain_model(lambda: make_inner("sgd_momentum"))
    callback = tf_adasum.AdasumCallback(sync_every, outer_optimizer=Outer(*OUTERS[outer]).keras())
    model.fit(x[: 2 * STEPS], y[: 2 * STEPS], batch_size=2, shuffle=False, verbose=0, callbacks=[callback])
    want = simulate("sgd_momentum", 1, sync_every, STEPS, 2, outer=Outer(*OUTERS[outer]))
    for got, w in zip(model.get_weights(), want, strict=True):
        np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-5)
    plain = simulate("sgd_momentum", 1, sync_every, STEPS, 2)
    assert not np.allclose(want[0], plain[0], atol=1e-3)  # the outer step shows in the result
    # The outer optimizer stepped once a sync, and lives on the model's optimizer, where saving finds it.
    assert model.optimizer.tf_adasum_outer_optimizer is callback.outer_optimizer
    assert int(callback.outer_optimizer.iterations.numpy()) == STEPS // sync_every


def test_the_callbacks_outer_state_is_saved_with_the_model_and_resumes_exactly(tmp_path: Path) -> None:
    """8 steps of windows of 4, save_weights (and model.save), a new model and callback: set_model,
    load_weights of either file, 8 more steps: bitwise the 16 steps at once. Loaded before the callback
    meets the model (the model's own optimizer built, as Keras asks), the outer momentum is lost and the
    run ends elsewhere (so this test can fail). A model without tf_adasum's callback loads both files."""
    x, y, _, _ = problem()

    def callback() -> tf_adasum.AdasumCallback:
        return tf_adasum.AdasumCallback(4, outer_optimizer=Outer(*OUTERS["momentum"]).keras())

    def fit(model: keras.Model, rows: slice, cb: tf_adasum.AdasumCallback) -> None:
        model.fit(x[rows], y[rows], batch_size=2, shuffle=False, verbose=0, callbacks=[cb])

    whole = plain_model(lambda: make_inner("adam"))
    fit(whole, slice(0, 32), callback())
    first = plain_model(lambda: make_inner("adam"))
    fit(first, slice(0, 16), callback())
    first.save_weights(tmp_path / "run.weights.h5")
    first.save(tmp_path / "run.keras")
    results = []
    for attach_first, path in ((True, "run.weights.h5"), (True, "run.keras"), (False, "run.weights.h5")):
        again, cb = plain_model(lambda: make_inner("adam")), callback()
        if attach_first:
            cb.set_model(again)
        else:  # as Keras asks of a resume: the model's optimizer built, so only the outer state is lost
            again.optimizer.build(again.trainable_variables)
        again.load_weights(tmp_path / path)
        assert int(cb.outer_optimizer.iterations.numpy()) == (2 if attach_first else 0)
        fit(again, slice(16, 32), cb)
        results.append(again.get_weights())
    for result in results[:2]:
        for a, b in zip(result, whole.get_weights(), strict=True):
            np.testing.assert_array_equal(a, b)
    assert not np.allclose(results[2][0], whole.get_weights()[0], atol=1e-5)
    for path in ("run.weights.h5", "run.keras"):  # without tf_adasum's callback: the weights, alone
        plain = plain_model(lambda: make_inner("adam"))
        plain.load_weights(tmp_path / path)
        for a, b in zip(plain.get_weights(), first.get_weights(), strict=True):
            np.testing.assert_array_equal(a, b)
    assert isinstance(keras.models.load_model(tmp_path / "run.keras"), keras.Sequential)


def test_backup_and_restore_brings_the_callbacks_outer_state_back(tmp_path: Path) -> None:
    """Keras's BackupAndRestore, listed before the callback: an epoch, a new process's model and callback,
    fit to 2 epochs from the backup: bitwise 2 epochs at once, the outer optimizer's 4 steps counted."""
    x, y, _, _ = problem()

    def fit(epochs: int, backup: bool) -> tuple[keras.Model, tf_adasum.AdasumCallback]:
        model = plain_model(lambda: make_inner("adam"))
        callback = tf_adasum.AdasumCallback(4, outer_optimizer=Outer(*OUTERS["momentum"]).keras())
        backups = [keras.callbacks.BackupAndRestore(tmp_path / "backup", delete_checkpoint=False)]
        model.fit(
            x[:16], y[:16], batch_size=2, epochs=epochs, shuffle=False, verbose=0,
            callbacks=[*backups, callback] if backup else [callback],
        )  # fmt: skip
        return model, callback

    whole, _ = fit(2, backup=False)
    fit(1, backup=True)
    resumed, callback = fit(2, backup=True)
    assert int(callback.outer_optimizer.iterations.numpy()) == 4
    for a, b in zip(resumed.get_weights(), whole.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)


def test_the_callbacks_outer_step_under_mixed_precision_equals_float32_within_its_rounding() -> None:
    """mixed_float16: the outer optimizer hangs on the LossScaleOptimizer's inner one and steps at each
    sync; the weights lie near the float32 run's (the forward pass in float16)."""
    x, y, _, _ = problem()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        # A loss scale of 1 overflows at no step here (Keras's 2^15 skips the first steps).
        model = plain_model(
            lambda: keras.optimizers.LossScaleOptimizer(make_inner("sgd_momentum"), initial_scale=1.0)
        )
    finally:
        keras.mixed_precision.set_global_policy("float32")
    callback = tf_adasum.AdasumCallback(4, outer_optimizer=Outer(*OUTERS["nesterov"]).keras())
    model.fit(x[: 2 * STEPS], y[: 2 * STEPS], batch_size=2, shuffle=False, verbose=0, callbacks=[callback])
    assert model.optimizer.inner_optimizer.tf_adasum_outer_optimizer is callback.outer_optimizer
    assert int(model.optimizer.inner_optimizer.iterations.numpy()) == STEPS  # no step skipped
    assert int(callback.outer_optimizer.iterations.numpy()) == STEPS // 4
    want = simulate("sgd_momentum", 1, 4, STEPS, 2, outer=Outer(*OUTERS["nesterov"]))
    for got, w in zip(model.get_weights(), want, strict=True):
        np.testing.assert_allclose(got, w, rtol=1e-2, atol=1e-2)


def test_the_callback_refuses_an_outer_optimizer_it_cannot_serve() -> None:
    x, y, _, _ = problem()
    model = plain_model(lambda: make_inner("adam"))
    with pytest.raises(ValueError, match="outer_optimizer is the model's optimizer"):
        model.fit(
            x[:4], y[:4], verbose=0, callbacks=[tf_adasum.AdasumCallback(outer_optimizer=model.optimizer)]
        )
    with pytest.raises(ValueError, match=r"combine must be one of \('adasum', 'mean'\), got 'sum'"):
        tf_adasum.AdasumCallback(combine="sum")
    with pytest.raises(TypeError, match=r"outer_optimizer is a plain Keras optimizer"):
        tf_adasum.AdasumCallback(outer_optimizer=3)
    # An outer optimizer built on another model's variables: said, in the callback's words.
    callback = tf_adasum.AdasumCallback(2, outer_optimizer=Outer(*OUTERS["nesterov"]).keras())
    model.fit(x[:4], y[:4], batch_size=2, verbose=0, callbacks=[callback])
    other = plain_model(lambda: make_inner("adam"))
    with pytest.raises(ValueError, match=r"was built on 2 other variables .*not this model's 2 .*of its own"):
        other.fit(x[:4], y[:4], batch_size=2, verbose=0, callbacks=[callback])
    assert not hasattr(other.optimizer, "tf_adasum_outer_optimizer")
    # A model the callback refuses gets nothing hung on its optimizer.
    wrapped = plain_model(lambda: tf_adasum.AdasumOptimizer(make_inner("adam")))
    fresh = tf_adasum.AdasumCallback(2, outer_optimizer=Outer(*OUTERS["nesterov"]).keras())
    with pytest.raises(ValueError, match="already a AdasumOptimizer, which combines across processes itself"):
        wrapped.fit(x[:4], y[:4], batch_size=2, verbose=0, callbacks=[fresh])
    assert not hasattr(wrapped.optimizer, "tf_adasum_outer_optimizer")
    assert not fresh.outer_optimizer.built
    # An elastic state not given it refuses to commit it, in the order an elastic script runs: the state,
    # then fit with Horovod's commit callback. Said, naming the outer optimizer and the way out.
    from tf_adasum import elastic

    model = plain_model(lambda: make_inner("adam"))
    state = elastic.KerasState(model, epoch=0, batch=0)
    callback = tf_adasum.AdasumCallback(2, outer_optimizer=Outer(*OUTERS["nesterov"]).keras())
    commits = elastic.CommitStateCallback(state)
    name = callback.outer_optimizer.name
    with pytest.raises(
        ValueError, match=rf"cannot commit AdasumCallback's outer optimizer '{name}' \(SGD\) "
    ):
        model.fit(x[:4], y[:4], batch_size=2, verbose=0, callbacks=[callback, commits])
    # A later fit without an outer optimizer takes the stale one off.
    model.fit(x[:4], y[:4], batch_size=2, verbose=0, callbacks=[tf_adasum.AdasumCallback()])
    assert not hasattr(model.optimizer, "tf_adasum_outer_optimizer")
    state.commit()


def test_an_elastic_state_given_the_outer_optimizer_commits_and_restores_it() -> None:
    """KerasState(outer_optimizer=) holds the callback's outer state from the start: a restore brings
    it back with the weights; a callback stepping with another outer optimizer, or none, is refused at
    the commit, and a commit with other parts at the restore."""
    from tf_adasum import elastic

    x, y, _, _ = problem()
    model = plain_model(lambda: make_inner("adam"))
    outer = Outer(*OUTERS["nesterov"]).keras()
    state = elastic.KerasState(model, outer_optimizer=outer, epoch=0, batch=0)
    assert outer.built and model.optimizer.tf_adasum_outer_optimizer is outer  # before any fit
    callback = tf_adasum.AdasumCallback(2, outer_optimizer=outer)
    commits = elastic.CommitStateCallback(state, batches_per_commit=2)
    model.fit(x[:8], y[:8], batch_size=2, verbose=0, callbacks=[callback, commits])
    assert int(outer.iterations.numpy()) == 2
    committed = [v.numpy().copy() for v in outer.variables]
    weights = model.get_weights()
    model.fit(x[:4], y[:4], batch_size=2, verbose=0, callbacks=[callback])  # not committed
    assert int(outer.iterations.numpy()) == 3
    state.restore()
    for got, want in zip(outer.variables, committed, strict=True):
        np.testing.assert_array_equal(got.numpy(), want)
    for got, want in zip(model.get_weights(), weights, strict=True):
        np.testing.assert_array_equal(got, want)
    # A commit without the outer state cannot be restored into a state with it, nor the other way.
    bare = elastic.KerasState(plain_model(lambda: make_inner("adam")), epoch=0, batch=0)
    with pytest.raises(
        ValueError, match=r"holds the variables of \['model', 'optimizer', 'outer'\], the commit"
    ):
        state._apply(bare._snapshot())
    with pytest.raises(
        ValueError, match=r"holds the variables of \['model', 'optimizer'\], the commit those"
    ):
        bare._apply(state._committed[1])
    # Another outer optimizer on the callback, or none: refused as fit starts, before any step, naming
    # the one the state commits; the outer state stays hung, and the weights as they were.
    other = tf_adasum.AdasumCallback(2, outer_optimizer=Outer(*OUTERS["nesterov"]).keras())
    for wrong, asked in ((other, f"'{other.outer_optimizer.name}'"), (tf_adasum.AdasumCallback(2), "none")):
        before = model.get_weights()
        message = (
            rf"carries the outer optimizer '{outer.name}', which an elastic KerasState commits, .* {asked}"
        )
        with pytest.raises(ValueError, match=message):
            model.fit(x[:4], y[:4], batch_size=2, verbose=0, callbacks=[wrong, commits])
        assert model.optimizer.tf_adasum_outer_optimizer is outer
        for got, want in zip(model.get_weights(), before, strict=True):
            np.testing.assert_array_equal(got, want)
    state.commit()  # still the state's parts
    # A fit that commits the outer state with no AdasumCallback to step it: refused before any step.
    before = model.get_weights()
    unstepped = rf"outer optimizer '{outer.name}', and this fit has no AdasumCallback"
    with pytest.raises(ValueError, match=unstepped):
        model.fit(x[:4], y[:4], batch_size=2, verbose=0, callbacks=[commits])
    for got, want in zip(model.get_weights(), before, strict=True):
        np.testing.assert_array_equal(got, want)
    model.fit(x[:4], y[:4], batch_size=2, verbose=0, callbacks=[callback, commits])  # with it, as before
    # What a state cannot hang: a tf_keras optimizer, another object, a model under a strategy, one whose
    # optimizer steps an outer optimizer of its own (or none) and syncs itself.
    with pytest.raises(
        ValueError, match=r"outer_optimizer is a plain Keras 3 optimizer, .* got builtins\.int"
    ):
        elastic.KerasState(plain_model(lambda: make_inner("adam")), outer_optimizer=3)
    strategy = tf_adasum.AdasumStrategy(devices=cpus(2))
    with strategy.scope():
        under = plain_model(lambda: make_inner("adam"))
    with pytest.raises(ValueError, match=r"under a strategy, .* make the state without outer_optimizer"):
        elastic.KerasState(under, outer_optimizer=Outer(*OUTERS["nesterov"]).keras())
    # A LossScaleOptimizer's inner optimizer carries the state's outer one, and the fit steps it.
    scaled = plain_model(lambda: keras.optimizers.LossScaleOptimizer(make_inner("adam"), initial_scale=1.0))
    outer = Outer(*OUTERS["nesterov"]).keras()
    state = elastic.KerasState(scaled, outer_optimizer=outer, epoch=0, batch=0)
    commits = elastic.CommitStateCallback(state, batches_per_commit=2)
    scaled.fit(
        x[:4],
        y[:4],
        batch_size=2,
        verbose=0,
        callbacks=[tf_adasum.AdasumCallback(2, outer_optimizer=outer), commits],
    )
    assert (
        int(outer.iterations.numpy()) == 1
        and scaled.optimizer.inner_optimizer.tf_adasum_outer_optimizer is outer
    )
    wrapped = plain_model(lambda: tf_adasum.AdasumOptimizer(make_inner("adam")))
    with pytest.raises(ValueError, match=r"a tf_adasum optimizer that syncs itself \(here AdasumOptimizer\)"):
        elastic.KerasState(wrapped, outer_optimizer=Outer(*OUTERS["nesterov"]).keras())


def test_bad_outer_optimizers_and_combines_are_refused() -> None:
    with pytest.raises(ValueError, match=r"combine must be one of \('adasum', 'mean'\), got 'sum'"):
        tf_adasum.AdasumStrategy(devices=cpus(2), combine="sum")
    with pytest.raises(TypeError, match=r"outer_optimizer is a plain Keras optimizer .* got builtins\.int"):
        tf_adasum.AdasumStrategy(devices=cpus(2), outer_optimizer=3)
    with pytest.raises(ValueError, match="is a tf_adasum wrapper"):
        tf_adasum.AdasumOptimizer(
            keras.optimizers.SGD(), outer_optimizer=tf_adasum.AdasumOptimizer(keras.optimizers.SGD())
        )
    inner = keras.optimizers.SGD()
    with pytest.raises(ValueError, match="outer_optimizer is the inner optimizer"):
        tf_adasum.AdasumOptimizer(inner, outer_optimizer=inner)
    import tf_adasum.keras as hvd

    with pytest.raises(ValueError, match=r"takes op=Adasum and a Keras 3 optimizer, got op=Average"):
        hvd.DistributedOptimizer(keras.optimizers.SGD(), outer_optimizer=keras.optimizers.SGD())
    # A name is keras.optimizers.get's.
    assert isinstance(
        tf_adasum.AdasumStrategy(devices=cpus(2), outer_optimizer="sgd").outer_optimizer, keras.optimizers.SGD
    )


@pytest.mark.multiprocess
@pytest.mark.parametrize(("engine", "p"), [("mpi", 2), ("tf", 3)])
def test_across_processes_the_outer_state_is_one_and_the_step_equals_numpy(
    engine: str, p: int, tmp_path: Path
) -> None:
    """p processes of one replica each behave as p replicas of one strategy: the weights equal the numpy
    simulation, and every process holds the same weights and the same outer optimizer state, bitwise."""
    from tests.support import processes
    from tests.workers.multiprocess import OUTER_CASES

    code = processes.launch(engine, p, tmp_path, ["-m", "tests.workers.multiprocess", str(tmp_path), "outer"])
    assert code == 0, processes.log_tail(tmp_path)
    for kind, sync_every, combine, compression in OUTER_CASES:
        name = f"outer_{kind}_{sync_every}_{combine}_{compression}"
        ranks = [list(np.load(tmp_path / f"{name}{r}.npz").values()) for r in range(p)]
        outer = Outer(*OUTERS[kind])
        want = simulate("sgd_momentum", p, sync_every, STEPS, 2 * p, outer=outer, combine=combine)
        for r in range(p):
            assert len(ranks[r]) > 2  # the weights, then the outer state
            for mine, first in zip(ranks[r], ranks[0], strict=True):
                np.testing.assert_array_equal(mine, first)
        if compression == "none":
            for got, w in zip(ranks[0][:2], want, strict=True):
                np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-5)
            continue
        # Narrowed on the wire: within the tolerance of the same job's fp32 run, and not equal to it.
        exact = list(np.load(tmp_path / f"outer_{kind}_{sync_every}_{combine}_none0.npz").values())[:2]
        moved = max(float(np.max(np.abs(e - s))) for e, s in zip(exact, problem()[2:], strict=True))
        error = max(float(np.max(np.abs(g - e))) for g, e in zip(ranks[0][:2], exact, strict=True))
        assert 0 < error <= COMPRESSED_TOLERANCE[compression] * moved, (name, error, moved)
    # Horovod's recipe, DistributedOptimizer(op=Adasum, backward_passes_per_step=4, outer_optimizer=...):
    # each process its own rows, as replica r of the strategy reads them.
    ranks = [list(np.load(tmp_path / f"outer_horovod{r}.npz").values()) for r in range(p)]
    want = simulate("sgd_momentum", p, 4, STEPS, 2 * p, outer=Outer(*OUTERS["nesterov"]))
    for r in range(p):
        for mine, first in zip(ranks[r], ranks[0], strict=True):
            np.testing.assert_array_equal(mine, first)
    for got, w in zip(ranks[0][:2], want, strict=True):
        np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-5)
    # AdasumCallback(sync_every=4, outer_optimizer=...), Adasum and the mean, each process its own rows;
    # bf16 within the tolerance of fp32; a resume where rank 0 alone loaded the outer state.
    from tests.workers.multiprocess import CALLBACK_OUTER_CASES

    def callback_run(name: str) -> list[list[np.ndarray]]:
        ranks = [list(np.load(tmp_path / f"outer_callback_{name}{r}.npz").values()) for r in range(p)]
        for r in range(p):
            assert len(ranks[r]) > 2  # the weights, then the outer state
            for mine, first in zip(ranks[r], ranks[0], strict=True):
                np.testing.assert_array_equal(mine, first)
        return ranks

    for combine, compression in CALLBACK_OUTER_CASES:
        ranks = callback_run(f"{combine}_{compression}")
        want = simulate("sgd_momentum", p, 4, STEPS, 2 * p, outer=Outer(*OUTERS["nesterov"]), combine=combine)
        if compression == "none":
            for got, w in zip(ranks[0][:2], want, strict=True):
                np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-5, err_msg=combine)
            continue
        exact = callback_run(f"{combine}_none")[0][:2]
        moved = max(float(np.max(np.abs(e - s))) for e, s in zip(exact, problem()[2:], strict=True))
        error = max(float(np.max(np.abs(g - e))) for g, e in zip(ranks[0][:2], exact, strict=True))
        assert 0 < error <= COMPRESSED_TOLERANCE[compression] * moved, (combine, compression, error, moved)
    resumed = callback_run("resumed")  # bitwise alike on every rank: the outer state was root's
    assert int(resumed[0][2]) == 4  # the outer optimizer's count: 2 syncs loaded, 2 more
    # The mean divides by the count of replicas itself, whatever the wire: bfloat16 would round
    # 129 + 128 * (p - 1) (257 or 385) by 1 and miss by 0.4% or 0.3%.
    replicas = 129 + 128 * (p - 1)
    for r in range(p):
        means = json.loads((tmp_path / f"outer_mean_counts{r}.json").read_text())
        for compression, mean in means.items():
            np.testing.assert_allclose(mean, [p / replicas] * 4, rtol=1e-6, err_msg=compression)
