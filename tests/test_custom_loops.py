"""Custom training loops in one process, on logical CPUs: TensorFlow's tutorial loop ("Custom training
with tf.distribute.Strategy") with AdasumStrategy in place of MirroredStrategy, against the numpy
simulation of Adasum after the optimizer; the Horovod-style tape API in a world of one. The same loops
across real processes are in test_loops_across_processes.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_adasum
import tf_adasum.keras
import tf_adasum.tensorflow as hvd
from tests.support.custom_loops import STEPS, dataset, tutorial_model, tutorial_steps
from tests.support.training import cpus, make_inner, problem, simulate


def train(
    strategy: tf.distribute.Strategy, kind: str, loop: str = "for", steps: int = STEPS, **kw: Any
) -> Any:
    """Runs the tutorial loop in one of its three forms; returns (model, optimizer, the step losses)."""
    global_batch = 4 * strategy.num_replicas_in_sync
    model, optimizer = tutorial_model(strategy, kind)
    train_step = tutorial_steps(strategy, model, optimizer, global_batch, **kw)

    @tf.function
    def distributed_train_step(dataset_inputs: Any) -> tf.Tensor:
        per_replica_losses = strategy.run(train_step, args=(dataset_inputs,))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica_losses, axis=None)

    @tf.function
    def distributed_train_epoch(dist_dataset: Any) -> tf.Tensor:
        total_loss = 0.0
        for x in dist_dataset:
            per_replica_losses = strategy.run(train_step, args=(x,))
            total_loss += strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica_losses, axis=None)
        return total_loss

    dist_dataset = strategy.experimental_distribute_dataset(dataset(global_batch, steps))
    losses = []
    if loop == "for":
        for x in dist_dataset:
            losses.append(float(distributed_train_step(x)))
    elif loop == "iterator":
        iterator = iter(dist_dataset)
        for _ in range(steps):
            losses.append(float(distributed_train_step(next(iterator))))
    else:
        losses.append(float(distributed_train_epoch(dist_dataset)))
    return model, optimizer, losses


def replicas_agree(strategy: tf.distribute.Strategy, model: keras.Model) -> None:
    for variable in model.weights:
        components = [c.numpy() for c in strategy.experimental_local_results(variable.value)]
        for c in components[1:]:
            np.testing.assert_array_equal(c, components[0])  # every replica bitwise the same


def close(got: list[np.ndarray], want: list[np.ndarray], kind: str) -> None:
    # Adam divides by sqrt(v): float32 rounding of near-zero gradients moves its steps more than SGD's.
    atol = 2e-5 if kind == "adam" else 2e-6
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=atol)


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("kind", ["sgd_momentum", "adam"])
def test_the_tutorial_loop_with_adasum_strategy_is_adasum_after_the_optimizer(kind: str, p: int) -> None:
    strategy = tf_adasum.AdasumStrategy(devices=cpus(p))
    model, optimizer, losses = train(strategy, kind)
    simulated: list[float] = []
    want = simulate(kind, p, 1, STEPS, 4 * p, simulated)
    close(model.get_weights(), want, kind)
    replicas_agree(strategy, model)
    assert int(optimizer.iterations.numpy()) == STEPS
    # strategy.reduce(SUM) of the losses scaled by the global batch is the mean over the global batch.
    np.testing.assert_allclose(losses, np.mean(np.reshape(simulated, (STEPS, p)), axis=1), rtol=1e-5)
    # ... and MirroredStrategy's mean of gradients, which this loop used to give silently, is far from it.
    mirrored = tf.distribute.MirroredStrategy(cpus(p), cross_device_ops=tf.distribute.ReductionToOneDevice())
    model_m, optimizer_m = tutorial_model(mirrored, kind)
    with mirrored.scope():
        optimizer_m.build(model_m.trainable_variables)  # Keras 3 needs it there (keras-team/keras#23085)
    step = tutorial_steps(mirrored, model_m, optimizer_m, 4 * p)
    run = tf.function(lambda inputs: mirrored.run(step, args=(inputs,)))
    for x in mirrored.experimental_distribute_dataset(dataset(4 * p)):
        run(x)
    gap = max(
        float(np.max(np.abs(a - b))) for a, b in zip(model.get_weights(), model_m.get_weights(), strict=True)
    )
    assert gap > 1e-3, gap


@pytest.mark.parametrize("loop", ["iterator", "epoch_in_one_function"])
def test_the_tutorials_other_loops_give_the_same_weights(loop: str) -> None:
    strategy = tf_adasum.AdasumStrategy(devices=cpus(2))
    model, _, losses = train(strategy, "adam", loop=loop)
    close(model.get_weights(), simulate("adam", 2, 1, STEPS, 8), "adam")
    replicas_agree(strategy, model)
    assert np.isfinite(losses).all()


def test_compute_average_loss_without_a_global_batch_size_and_sync_every_two() -> None:
    strategy = tf_adasum.AdasumStrategy(devices=cpus(2), sync_every=2)
    model, _, _ = train(strategy, "sgd_momentum", average="replica_context")
    close(model.get_weights(), simulate("sgd_momentum", 2, 2, STEPS, 8), "sgd_momentum")
    replicas_agree(strategy, model)


def test_a_checkpoint_resumes_the_loop_exactly(tmp_path: Path) -> None:
    # The tutorial's tf.train.Checkpoint(optimizer=..., model=...): every replica's Adam moments too.
    global_batch, half = 8, STEPS // 2
    whole = train(tf_adasum.AdasumStrategy(devices=cpus(2)), "adam")[0].get_weights()
    runs = []
    for first in (0, half):
        strategy = tf_adasum.AdasumStrategy(devices=cpus(2))
        model, optimizer = tutorial_model(strategy, "adam")
        checkpoint = tf.train.Checkpoint(optimizer=optimizer, model=model)
        if first:
            checkpoint.restore(str(tmp_path / "ckpt-1")).assert_existing_objects_matched()
        step = tutorial_steps(strategy, model, optimizer, global_batch)
        run = tf.function(lambda inputs, strategy=strategy, step=step: strategy.run(step, args=(inputs,)))
        for x in strategy.experimental_distribute_dataset(dataset(global_batch, half, first)):
            run(x)
        if not first:
            checkpoint.save(str(tmp_path / "ckpt"))
            states = [
                [c.numpy() for c in strategy.experimental_local_results(v.value)] for v in optimizer.variables
            ]
            assert any(not np.array_equal(s[0], s[1]) for s in states), "the replicas' moments should differ"
        runs.append((model, optimizer))
    model, optimizer = runs[1]
    assert int(optimizer.iterations.numpy()) == STEPS
    for got, want in zip(model.get_weights(), whole, strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("kind", ["sgd_momentum", "adam"])
def test_a_model_first_built_inside_the_step_trains_with_adasum_too(kind: str) -> None:
    # The tutorial's create_model has no keras.Input: its weights, and so the optimizer's state, are
    # created inside the first traced step. (MirroredStrategy's Adam fails there, keras-team/keras#23085.)
    strategy = tf_adasum.AdasumStrategy(devices=cpus(2))
    _, _, w, b = problem()
    with strategy.scope():
        dense = keras.layers.Dense(
            2,
            kernel_initializer=keras.initializers.Constant(w),
            bias_initializer=keras.initializers.Constant(b),
        )
        model = keras.Sequential([dense])
        optimizer = make_inner(kind)
    step = tutorial_steps(strategy, model, optimizer, 8)
    run = tf.function(lambda inputs: strategy.run(step, args=(inputs,)))
    for x in strategy.experimental_distribute_dataset(dataset(8)):
        run(x)
    close(model.get_weights(), simulate(kind, 2, 1, STEPS, 8), kind)
    replicas_agree(strategy, model)


class StepsWithoutApply(keras.optimizers.SGD):
    """An optimizer whose apply skips Keras's: no route to Adasum, so the gradient sum must refuse."""

    def apply(self, grads: Any, trainable_variables: Any = None) -> None:
        self._backend_update_step(grads, trainable_variables, self.learning_rate)


def test_no_optimizer_sums_the_replicas_gradients_under_adasum_strategy() -> None:
    strategy = tf_adasum.AdasumStrategy(devices=cpus(2))
    model, _ = tutorial_model(strategy, "sgd_momentum")
    with strategy.scope():
        optimizer = StepsWithoutApply(0.1)
        optimizer.build(model.trainable_variables)
    step = tutorial_steps(strategy, model, optimizer, 8)
    run = tf.function(lambda inputs: strategy.run(step, args=(inputs,)))
    with pytest.raises(ValueError, match=r"would average its replicas' gradients.*tf_adasum.AdasumOptimizer"):
        run(next(iter(strategy.experimental_distribute_dataset(dataset(8)))))


def test_the_horovod_tape_api_in_a_world_of_one() -> None:
    hvd.init()
    x, y, w, b = problem()
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.set_weights([w, b])
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean((model(x[:8]) - y[:8]) ** 2)
    plain = tape.gradient(loss, model.trainable_variables)
    for op in (hvd.Average, hvd.Sum, hvd.Adasum):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x[:8]) - y[:8]) ** 2)
        reduced = hvd.DistributedGradientTape(tape, op=op).gradient(loss, model.trainable_variables)
        for got, want in zip(reduced, plain, strict=True):
            assert isinstance(got, tf.Tensor)
            np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-6)
    # Eagerly and compiled, the collectives return tensors, as Horovod's TF2 API does.
    compiled = tf.function(lambda t: hvd.allreduce(t, op=hvd.Sum))
    for result in (hvd.allreduce(tf.ones(3)), compiled(tf.ones(3)), hvd.broadcast(tf.ones(3), 0)):
        assert isinstance(result, tf.Tensor)
    assert isinstance(tf_adasum.keras.allreduce([1.0, 2.0]), tf.Tensor)
    np.testing.assert_array_equal(hvd.allgather(tf.ones((2, 3))).numpy(), np.ones((2, 3)))
    fp16 = hvd.allreduce(tf.constant([1.0, 2.0]), compression=hvd.Compression.fp16, prescale_factor=2.0)
    assert fp16.dtype == tf.float32
    np.testing.assert_array_equal(fp16.numpy(), [2.0, 4.0])
    with pytest.raises(NotImplementedError, match=r"hvd.join\(\) is not supported"):
        hvd.join()
    with pytest.raises(NotImplementedError, match=r"DistributedGradientTape\(device_dense="):
        hvd.DistributedGradientTape(tape, device_dense="/gpu:0")
    with pytest.raises(ValueError, match="applies to op=Average only"):
        hvd.DistributedGradientTape(tape, op=hvd.Sum, gradient_predivide_factor=2.0)
    assert isinstance(hvd.DistributedOptimizer(make_inner("adam"), op=hvd.Adasum), tf_adasum.AdasumOptimizer)


def test_mixed_precision_in_the_tutorial_loop_is_adasum_too() -> None:
    strategy = tf_adasum.AdasumStrategy(devices=cpus(2))
    model, inner = tutorial_model(strategy, "sgd_momentum")
    with strategy.scope():
        optimizer = keras.optimizers.LossScaleOptimizer(inner, initial_scale=1.0, dynamic_growth_steps=1000)
    loss_object = keras.losses.MeanSquaredError(reduction=None)

    def train_step(inputs: Any) -> tf.Tensor:
        x, y = inputs
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(loss_object(y, model(x, training=True)), global_batch_size=8)
            scaled = optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    run = tf.function(lambda inputs: strategy.run(train_step, args=(inputs,)))
    for x in strategy.experimental_distribute_dataset(dataset(8)):
        run(x)
    close(model.get_weights(), simulate("sgd_momentum", 2, 1, STEPS, 8), "sgd_momentum")
    replicas_agree(strategy, model)


@pytest.mark.parametrize("wrapper", [tf_adasum.AdasumOptimizer, tf_adasum.AllreduceOptimizer])
def test_an_optimizer_stepped_directly_runs_its_wrappers_step(wrapper: Any, monkeypatch: Any) -> None:
    # A script that wrapped `base` but steps `base` itself still syncs: its step is the wrapper's.
    steps: list[Any] = []
    original = wrapper.apply

    def counting(self: Any, grads: Any, trainable_variables: Any = None) -> None:
        steps.append(self)
        original(self, grads, trainable_variables)

    monkeypatch.setattr(wrapper, "apply", counting)
    _, _, w, b = problem()
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.set_weights([w, b])
    base = make_inner("sgd_momentum")
    wrapped = wrapper(base)
    grads = [tf.ones_like(v) for v in model.trainable_variables]
    base.apply_gradients(zip(grads, model.trainable_variables, strict=True))
    assert steps == [wrapped]
    assert int(base.iterations.numpy()) == 1  # and the wrapper's own step of `base` ran once, not again


def test_the_tape_reduces_an_embeddings_sparse_gradient_dense() -> None:
    embedding = keras.layers.Embedding(6, 2)
    ids = tf.constant([[0, 3, 3]])
    for op in (hvd.Average, hvd.Adasum):
        with tf.GradientTape(persistent=True) as tape:
            loss = tf.reduce_sum(embedding(ids) ** 2)
        plain = tape.gradient(loss, embedding.trainable_variables)[0]
        assert isinstance(plain, tf.IndexedSlices)
        (reduced,) = hvd.DistributedGradientTape(tape, op=op).gradient(loss, embedding.trainable_variables)
        assert isinstance(reduced, tf.Tensor) and reduced.shape == (6, 2)
        np.testing.assert_allclose(reduced.numpy(), tf.convert_to_tensor(plain).numpy(), rtol=1e-6)
