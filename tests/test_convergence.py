"""benchmarks/studies/convergence.py: its vectorised replicas are the real strategies, step for step, and its
smoke run goes end to end."""

from __future__ import annotations

import sys
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_adasum
from tests.support.studies import STUDIES, smoke
from tests.support.training import cpus

sys.path.insert(0, str(STUDIES))

import convergence

STEPS = 3


# Four replicas: the tree's two levels, its pairs among them (two replicas, a pair alone, cost 13 s of
# CI and reach nothing more; the Transformer's case is at two).
CNN_CASES = [(m, k, "cnn", 4) for m, k in [("adasum", "sgd"), ("adasum", "adam"), ("average", "sgd")]]


# The CNN, and the Transformer (an Embedding's sparse gradient among its variables) with LAMB.
@pytest.mark.parametrize(
    ("method", "kind", "model_name", "n"), [*CNN_CASES, ("adasum", "lamb", "transformer", 2)]
)
def test_the_vectorised_replicas_equal_the_strategy_step_for_step(
    method: str, kind: str, model_name: str, n: int
) -> None:
    rng = np.random.default_rng(n)
    count = STEPS * n * convergence.LOCAL_BATCH
    if model_name == "transformer":
        x, y = convergence.pointer_task(count, n)
    else:
        x = rng.random((count, 16, 16, 1), dtype=np.float32)
        y = rng.integers(0, 10, len(x)).astype(np.int32)
    make_model = convergence.MODELS[model_name]

    def optimizer() -> keras.optimizers.Optimizer:
        return convergence.make_optimizer(kind, convergence.WarmupLinearDecay(convergence.PEAK[kind] * 4, 10))

    keras.utils.set_random_seed(0)
    simulated = make_model()
    start = simulated.get_weights()
    replicas = convergence.Replicas(simulated, method, n, optimizer)
    batches = x.reshape(STEPS, n, convergence.LOCAL_BATCH, *x.shape[1:]), y.reshape(STEPS, n, -1)
    history = []
    for step in range(STEPS):
        replicas.step(tf.constant(batches[0][step]), tf.constant(batches[1][step]))
        history.append(simulated.get_weights())

    if method == "adasum":
        strategy: tf.distribute.Strategy = tf_adasum.AdasumStrategy(devices=cpus(n))
    else:
        strategy = tf.distribute.MirroredStrategy(
            cpus(n), cross_device_ops=tf.distribute.ReductionToOneDevice()
        )
    with strategy.scope():
        model = make_model()
        model.set_weights(start)
        model.compile(optimizer=optimizer(), loss=convergence.LOSS)
    for step in range(STEPS):  # one global batch at a time, each replica its contiguous share
        rows = slice(step * n * convergence.LOCAL_BATCH, (step + 1) * n * convergence.LOCAL_BATCH)
        model.fit(x[rows], y[rows], batch_size=n * convergence.LOCAL_BATCH, shuffle=False, verbose=0)
        for variable, got, want in zip(model.weights, model.get_weights(), history[step], strict=True):
            # An attention key bias shifts every logit of a query equally: its true gradient is 0, and
            # LAMB normalises the float noise left in its place, which differs between the two runs.
            if not variable.path.endswith("key/bias"):
                np.testing.assert_allclose(
                    got, want, rtol=1e-4, atol=1e-6, err_msg=f"{variable.path}, step {step + 1}"
                )
    # ... and the steps moved the weights: the comparison is not between two untouched models.
    assert not np.allclose(history[-1][0], start[0])


@pytest.mark.slow
def test_the_smoke_run_goes_end_to_end_and_resumes(tmp_path: Path) -> None:
    done = smoke(tmp_path / "out")
    out = tmp_path / "out_smoke"
    rows = convergence.read_rows(out / "results.csv")
    assert {(r["optimizer"], r["method"]) for r in rows} == {
        ("sgd", "average"),
        ("sgd", "adasum"),
        ("adam", "adasum"),
        ("adam", "adasum_before"),
    }
    assert (out / "accuracy_vs_replicas.png").stat().st_size > 0
    assert (out / "orthogonality.png").stat().st_size > 0
    assert "optimizer method" in done.stdout
    assert "12 runs, 0 already in" in done.stdout, done.stdout

    again = smoke(tmp_path / "out")  # the same grid again: everything is in the CSV, nothing reruns
    assert "12 runs, 12 already in" in again.stdout and "[1/" not in again.stdout, again.stdout
    assert len(convergence.read_rows(out / "results.csv")) == 12
