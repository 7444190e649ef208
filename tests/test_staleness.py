"""benchmarks/studies/staleness.py: its Adam is the paper's (Table 2), staleness is what it says, with none it
is the synchronous harness exactly, and its smoke run goes end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_adasum

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "studies"))

import convergence  # noqa: E402
import staleness  # noqa: E402

from tests.support.studies import smoke  # noqa: E402

# "Making Asynchronous SGD Work for Transformers", Table 2, as printed (three decimals, trailing zeros
# dropped): Adam with beta_1 = 0.9, beta_2 = 0.98, lr = 0.001, times t = 1..6.
TABLE_2 = {
    "constant": {
        "g": [1, 1, 1, 1, 1, 1],
        "m": "0.1 0.19 0.271 0.344 0.41 0.469",
        "v": "0.02 0.04 0.059 0.078 0.096 0.114",
        "m_hat": "1 1 1 1 1 1",
        "v_hat": "1 1 1 1 1 1",
        "theta": "-0.001 -0.002 -0.003 -0.004 -0.005 -0.006",
    },
    "scaled": {
        "g": [0.5, 1.5, 0.5, 1.5, 0.5, 1.5],
        "m": "0.05 0.195 0.226 0.353 0.368 0.481",
        "v": "0.005 0.05 0.054 0.098 0.101 0.144",
        "m_hat": "0.5 1.026 0.832 1.026 0.898 1.026",
        "v_hat": "0.25 1.26 0.917 1.26 1.05 1.26",
        "theta": "-0.001 -0.002 -0.003 -0.004 -0.005 -0.005",
    },
    "different sign": {
        "g": [-1, 2, -1, 2, -1, 2],
        "m": "-0.1 0.11 -0.001 0.199 0.079 0.271",
        "v": "0.02 0.1 0.118 0.195 0.211 0.287",
        "m_hat": "-1 0.579 -0.004 0.579 0.193 0.579",
        "v_hat": "1 2.515 2 2.515 2.2 2.515",
        "theta": "0.001 0.001 0.001 0.000 0.000 -0.000",
    },
}


@pytest.mark.parametrize("sequence", list(TABLE_2))
def test_the_harness_adam_reproduces_table_2(sequence: str) -> None:
    row = TABLE_2[sequence]
    optimizer = staleness.EXPERIMENTS["transformer"].optimizer(0.001)
    theta = keras.Variable(0.0, dtype="float64", name="theta")
    optimizer.build([theta])
    (m,) = [v for v in optimizer.variables if v.path.endswith("theta_momentum")]
    (v,) = [v for v in optimizer.variables if v.path.endswith("theta_velocity")]
    beta_1, beta_2 = optimizer.beta_1, optimizer.beta_2
    got: dict[str, list[float]] = {name: [] for name in ("m", "v", "m_hat", "v_hat", "theta")}
    for t, g in enumerate(row["g"], start=1):
        optimizer.apply([tf.constant(g, tf.float64)], [theta])
        got["m"].append(float(m.numpy()))
        got["v"].append(float(v.numpy()))
        got["m_hat"].append(got["m"][-1] / (1 - beta_1**t))
        got["v_hat"].append(got["v"][-1] / (1 - beta_2**t))
        got["theta"].append(float(theta.numpy()))
    for name, values in got.items():
        printed = row[name].split()
        for t, (value, text) in enumerate(zip(values, printed, strict=True), start=1):
            # Printed to three decimals: the value is within half a unit of the third, and a printed
            # sign is the value's sign (-0.000 is a small negative number).
            assert abs(value - float(text)) <= 0.0005 + 1e-12, f"{sequence} {name}_{t}: {value} vs {text}"
            assert (value < 0) == text.startswith("-"), f"{sequence} {name}_{t}: {value} vs {text}"


def small_model() -> keras.Model:
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)])


@pytest.mark.parametrize(
    ("mode", "pushes"),
    [
        ("async", [[0], [1], [1], [3], [0]]),
        ("global", [[0, 0], [1, 0], [0, 2], [2, 1], [1, 1]]),
        ("local", [[2], [2], [0], [1], [2]]),
        ("global_adasum", [[0, 0, 1], [1, 0, 0], [2, 0, 1], [0, 2, 1], [3, 1, 2]]),
    ],
)
def test_each_push_is_the_gradient_of_the_weights_it_was_pulled_at(
    mode: str, pushes: list[list[int]]
) -> None:
    """Plain SGD, so the weights after update t are w_t - lr * combine_j grad(w_(t - s_j), batch j):
    computed here with an independent model and tape, from the weights' own history. Adasum's tree
    depends on the order of the pushes, so it also checks that mixed ages keep them in order."""
    spec = staleness.modes(len(pushes[0]) if mode != "local" else 2)[mode]
    rng = np.random.default_rng(0)
    per_update = spec.local * spec.accumulate
    x = rng.normal(size=(len(pushes), per_update, 8, 5)).astype(np.float32)
    y = rng.integers(0, 3, (len(pushes), per_update, 8)).astype(np.int32)
    keras.utils.set_random_seed(1)
    model, reference = small_model(), small_model()
    history = [model.get_weights()]
    server = staleness.Server(model, small_model(), keras.optimizers.SGD(0.5), spec, keep=3)
    for t, ages in enumerate(pushes):
        assert server.step(tf.constant(x[t]), tf.constant(y[t]), ages) == [min(a, t) for a in ages]
        grads = []
        for j, age in enumerate(ages):
            reference.set_weights(history[t - min(age, t)])
            for i in range(spec.local):
                with tf.GradientTape() as tape:
                    loss = convergence.LOSS(y[t, j * spec.local + i], reference(x[t, j * spec.local + i]))
                grads.append([g.numpy() for g in tape.gradient(loss, reference.trainable_variables)])
        if spec.combine == "adasum":
            update = [g.numpy() for g in tf_adasum.adasum_tree(grads)]
        else:
            update = [np.mean(g, 0) for g in zip(*grads, strict=True)]
        want = [w - 0.5 * u for w, u in zip(history[t], update, strict=True)]
        for got, expected in zip(model.get_weights(), want, strict=True):
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6, err_msg=f"update {t}")
        history.append(model.get_weights())
    assert not np.allclose(history[-1][0], history[0][0])


@pytest.mark.parametrize(
    ("mode", "method", "kind", "n"),
    [
        ("async", "average", "sgd", 1),
        ("global", "average", "sgd", 4),
        ("local", "average", "adam", 4),
        ("global_adasum", "adasum_before", "sgd", 4),
        ("global_adasum", "adasum_before", "adam", 4),
    ],
)
def test_with_no_staleness_each_mode_is_its_synchronous_counterpart_exactly(
    mode: str, method: str, kind: str, n: int
) -> None:
    """Against benchmarks/studies/convergence.py's replicas, bit for bit: their average (which
    tests/test_convergence.py checks against MirroredStrategy) and their Adasum of the raw gradients
    (adasum_before, the tree over the gradients, then one optimizer step)."""
    steps = 3
    rng = np.random.default_rng(n)
    x = rng.random((steps, n, convergence.LOCAL_BATCH, 16, 16, 1), dtype=np.float32)
    y = rng.integers(0, 10, (steps, n, convergence.LOCAL_BATCH)).astype(np.int32)

    def optimizer() -> keras.optimizers.Optimizer:
        return convergence.make_optimizer(kind, convergence.WarmupLinearDecay(convergence.PEAK[kind] * 4, 10))

    keras.utils.set_random_seed(0)
    synchronous = convergence.make_model()
    start = synchronous.get_weights()
    replicas = convergence.Replicas(synchronous, method, n, optimizer)
    model = convergence.make_model()
    model.set_weights(start)
    server = staleness.Server(model, convergence.make_model(), optimizer(), staleness.modes(n)[mode], keep=0)
    for step in range(steps):
        replicas.step(tf.constant(x[step]), tf.constant(y[step]))
        server.step(tf.constant(x[step]), tf.constant(y[step]), [0] * server.mode.accumulate)
        for got, want in zip(model.get_weights(), synchronous.get_weights(), strict=True):
            np.testing.assert_array_equal(got, want, err_msg=f"step {step + 1}")
    assert not np.allclose(model.get_weights()[0], start[0])


@pytest.mark.slow
def test_the_smoke_run_goes_end_to_end_and_resumes(tmp_path: Path) -> None:
    # The Transformer's experiment: the CNN's differs only in its model and data, which the
    # convergence smoke run and the tests above use.
    done = smoke(tmp_path / "out", "staleness.py", "--experiments", "transformer")
    out = tmp_path / "out_smoke"
    rows = convergence.read_rows(out / "results.csv")
    # Every mode at drawn staleness 1; at constant 0 and 2, local is global's run.
    # ... and global and global_adasum with k = 4 workers in turn.
    assert len(rows) == 3 + 3 + 4 + 2, [staleness.key(r) for r in rows]
    assert {r["mode"] for r in rows} == set(staleness.modes())
    assert {(r["staleness"], r["draw"]) for r in rows} == {
        ("0", "constant"),
        ("2", "constant"),
        ("1", "uniform"),
        ("3", "round_robin"),
    }
    for row in rows:  # the staleness the pushes really had: none, and up to s once there are versions
        if row["staleness"] == "0":
            assert float(row["mean_staleness"]) == 0, row
        elif row["draw"] == "round_robin":  # 3 of every 4 pushes 1 stale, none in the first update
            assert 0 < float(row["mean_staleness"]) < 0.75, row
        else:
            assert 0 < float(row["mean_staleness"]) <= 2, row
    assert (out / "accuracy_vs_staleness.png").stat().st_size > 0
    assert (out / "accuracy_vs_learning_rate.png").stat().st_size > 0
    assert "global_adasum" in done.stdout and "12 runs, 0 already in" in done.stdout, done.stdout

    again = smoke(tmp_path / "out", "staleness.py", "--experiments", "transformer")
    assert "12 runs, 12 already in" in again.stdout and "[1/" not in again.stdout, again.stdout


@pytest.mark.slow
def test_a_real_parameter_server_run_on_localhost_trains_asynchronously(tmp_path: Path) -> None:
    """benchmarks/studies/parameter_server.py: one parameter server and two workers, real processes on
    127.0.0.1, Keras 3 under ParameterServerStrategy with a ClusterCoordinator."""
    command = [
        sys.executable,
        str(ROOT / "benchmarks" / "studies" / "parameter_server.py"),
        "--smoke",
        "--timeout",
        "150",
        "--out",
        str(tmp_path / "out"),
    ]
    # Its own deadline is 150 s (and its servers die with it); this one only guards against the worst.
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    row = json.loads(done.stdout.strip().splitlines()[-1])
    assert row["workers"] == 2 and row["steps"] > 0
    assert row["counted_steps"] == row["steps"]  # every scheduled step ran and was counted once
    # Asynchronous: some step's gradient came from weights another step had moved on from.
    assert 1 <= row["max_staleness"] < row["steps"] and 0 < row["mean_staleness"] <= row["max_staleness"]
    assert row["keras_iterations"] <= row["steps"]
