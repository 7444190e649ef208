"""Mixed precision under AdasumStrategy on logical CPUs: a replica's overflow skips the step everywhere.

Keras's LossScaleOptimizer skips a step whose gradients are not finite and halves the loss scale.
Under a strategy it reads that decision from the first replica only, since it expects all-reduced
gradients; Adasum's replicas keep their own, so tf_adasum makes the decision global (see
tf_adasum._compat.install_global_loss_scale_finiteness). These tests overflow the second replica only.
The same cases across processes are in test_multiprocess.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import keras
import numpy as np
import pytest

import tf_adasum
from tests.support.training import build_linear, cpus, make_inner, problem, replica_values, simulate
from tests.test_training import digits_cnn, digits_data

INITIAL_SCALE = 2.0**15


@pytest.fixture
def policy(request: pytest.FixtureRequest) -> Iterator[str]:
    keras.mixed_precision.set_global_policy(request.param)
    try:
        yield request.param
    finally:
        keras.mixed_precision.set_global_policy("float32")


def overflowing_batches(p: int, batches: int, overflow_replica: int) -> tuple[np.ndarray, np.ndarray]:
    """Global batches of 2 examples per replica; in the first, one replica's share overflows float16."""
    x, y, _, _ = problem()
    x, y = x[: 2 * p * batches].copy(), y[: 2 * p * batches].copy()
    # Times the loss scale 2^15, this replica's gradients pass float16's largest value, 65504.
    x[2 * overflow_replica : 2 * overflow_replica + 2] *= 3e3
    return x, y


@pytest.mark.parametrize("policy", ["mixed_float16"], indirect=True)
@pytest.mark.parametrize("sync_every", [1, 2])
def test_one_replicas_overflow_skips_the_step_on_every_replica(policy: str, sync_every: int) -> None:
    strategy = tf_adasum.AdasumStrategy(devices=cpus(2), sync_every=sync_every)
    model = build_linear(strategy, lambda: make_inner("sgd_momentum"))
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    assert isinstance(model.optimizer.inner_optimizer, tf_adasum.AdasumOptimizer)
    start = model.get_weights()
    x, y = overflowing_batches(2, 1 + sync_every, overflow_replica=1)

    model.fit(x[:4], y[:4], batch_size=4, shuffle=False, verbose=0)
    assert float(model.optimizer.dynamic_scale.numpy()) == INITIAL_SCALE / 2
    assert int(model.optimizer.iterations.numpy()) == 0  # skipped: no replica stepped
    for got, want in zip(model.get_weights(), start, strict=True):
        np.testing.assert_array_equal(got, want)

    # Then finite batches: every replica steps, and they sync after sync_every steps.
    model.fit(x[4:], y[4:], batch_size=4, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == sync_every
    assert float(model.optimizer.dynamic_scale.numpy()) == INITIAL_SCALE / 2
    assert not all(np.array_equal(a, b) for a, b in zip(model.get_weights(), start, strict=True))
    for components in replica_values(strategy, model):
        assert np.all(np.isfinite(components[0]))
        for c in components[1:]:
            np.testing.assert_array_equal(c, components[0])


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"], indirect=True)
@pytest.mark.parametrize("sync_every", [1, 2])
def test_without_overflow_mixed_precision_follows_the_float32_simulation(
    policy: str, sync_every: int
) -> None:
    x, y, _, _ = problem()
    strategy = tf_adasum.AdasumStrategy(devices=cpus(2), sync_every=sync_every)

    def optimizer() -> keras.optimizers.Optimizer:
        # Each replica's loss is its own, as a single worker's (tests/test_loss_scaling.py): Keras's
        # default first scale, 2^15, overflows this problem's float16 gradients once, as it would on one
        # worker. Half of it does not.
        inner = make_inner("sgd_momentum")
        return (
            keras.optimizers.LossScaleOptimizer(inner, initial_scale=2.0**14)
            if policy == "mixed_float16"
            else inner
        )

    model = build_linear(strategy, optimizer)
    global_batch, steps = 8, 4
    model.fit(
        x[: global_batch * steps],
        y[: global_batch * steps],
        batch_size=global_batch,
        shuffle=False,
        verbose=0,
    )
    assert int(model.optimizer.iterations.numpy()) == steps
    want = simulate("sgd_momentum", 2, sync_every, steps, global_batch)
    # The layer computes in float16 (11-bit significand) or bfloat16 (8-bit); weights stay float32.
    tolerance = 5e-3 if policy == "mixed_float16" else 4e-2
    for got, w in zip(model.get_weights(), want, strict=True):
        np.testing.assert_allclose(got, w, rtol=tolerance, atol=tolerance)
    for components in replica_values(strategy, model):
        for c in components[1:]:
            np.testing.assert_array_equal(c, components[0])


@pytest.mark.parametrize("policy", ["mixed_bfloat16"], indirect=True)
def test_bfloat16_trains_the_digits_cnn(policy: str) -> None:
    x, y, x_val, y_val = digits_data()
    strategy = tf_adasum.AdasumStrategy(devices=cpus(2))
    # Logits in float32, as Keras advises for mixed precision.
    model = digits_cnn(strategy, after_logits=(keras.layers.Activation("linear", dtype="float32"),))
    assert model.layers[0].compute_dtype == "bfloat16"
    history = model.fit(x, y, batch_size=64, epochs=6, validation_data=(x_val, y_val), verbose=0)
    assert history.history["val_accuracy"][-1] > 0.9, history.history
    for components in replica_values(strategy, model):
        for c in components[1:]:
            np.testing.assert_array_equal(c, components[0])


def test_a_loss_scale_optimizer_passed_to_compile_is_wrapped_around_adasum() -> None:
    strategy = tf_adasum.AdasumStrategy(devices=cpus(2))
    model = build_linear(
        strategy, lambda: keras.optimizers.LossScaleOptimizer(make_inner("adam"), initial_scale=128.0)
    )
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    assert model.optimizer.initial_scale == 128.0
    assert isinstance(model.optimizer.inner_optimizer, tf_adasum.AdasumOptimizer)
    assert isinstance(model.optimizer.inner_optimizer.inner_optimizer, keras.optimizers.Adam)
    with pytest.raises(ValueError, match=r"LossScaleOptimizer\(AdasumOptimizer\(optimizer\)\)"):
        tf_adasum.AdasumOptimizer(keras.optimizers.LossScaleOptimizer(make_inner("adam")))
