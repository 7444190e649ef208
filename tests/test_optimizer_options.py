"""Every Keras optimizer option under the three ways in (training/optimizer_options.py): AdasumStrategy on
two logical CPUs here, AdasumCallback and the Horovod face on two processes. For each option, every
replica and process holds the same weights and moving averages, bitwise, at every batch and evaluation,
and the run ends where the documented rule says (tests/support/optimizer_options.py: one worker's Keras
SGD per replica, in numpy, combined with the contract tree). What cannot keep its meaning is refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest

import tf_adasum
import tf_adasum.keras as hvd
from tests.support import processes
from tests.support.optimizer_options import (
    Recorder,
    averages,
    linear_model,
    make_sgd,
    mse,
    replica_batches,
    simulate,
    validation,
)
from tests.support.processes import log_tail
from tests.support.training import cpus, problem
from tests.workers.data import (
    OPTION_CASES,
    OPTION_EPOCHS,
    OPTION_LOCAL,
    OPTION_SECOND_LR,
    OPTION_STEPS,
    Case,
)
from tf_adasum.callbacks import OrthogonalityMonitor

P = 2
WORKER = ["-m", "tests.workers.optimizer_options"]


def check_against_the_reference(
    case: Case,
    weights: list[np.ndarray],
    averages: list[np.ndarray],
    evaluated: list[list[np.ndarray]],
    val_losses: list[float],
) -> None:
    """A run's results against the rule's numpy reference on P replicas (or processes)."""
    want = simulate(case, replica_batches(P))
    close = {"rtol": 2e-5, "atol": 2e-6}
    for got, w in zip(weights, want.weights, strict=True):
        np.testing.assert_allclose(got, w, **close, err_msg="the weights after fit")
    assert len(averages) == len(want.averages)
    for got, w in zip(averages, want.averages, strict=True):
        np.testing.assert_allclose(got, w, **close, err_msg="the moving averages after fit")
    if case.swap:  # SwapEMAWeights: each evaluation sees the moving averages
        assert len(evaluated) == len(val_losses) == OPTION_EPOCHS
        x, y = validation()
        for seen, loss, w in zip(evaluated, val_losses, want.evaluated, strict=True):
            for got, expected in zip(seen, w, strict=True):
                np.testing.assert_allclose(got, expected, **close, err_msg="the weights evaluated")
            assert loss == pytest.approx(mse(w, x, y), rel=1e-5)


def agreed(case: Case, points: int) -> list[int]:
    """The points of a fit's record where every replica must agree: all of them with a sync every
    update; with sync_every > 1, the batch ends that sync (local steps in between differ)."""
    if case.sync_every == 1:
        return list(range(points))
    period = case.sync_every * case.accumulation
    return [i for i in range(points) if (i + 1) % period == 0]


def check_copies_agree(snapshots: list[list[list[np.ndarray]]], where: str) -> None:
    """Every snapshot's copies (of each weight and each moving average) bitwise equal to the first."""
    assert snapshots, "nothing was recorded"
    for i, snapshot in enumerate(snapshots):
        for j, copies in enumerate(snapshot):
            for k, copy in enumerate(copies[1:], 1):
                np.testing.assert_array_equal(
                    copy, copies[0], err_msg=f"{where}: point {i}, variable {j}: copy {k} differs from copy 0"
                )


def fit_under_adasum_strategy(
    case: Case, strategy: tf_adasum.AdasumStrategy
) -> tuple[keras.Model, Recorder, Any]:
    with strategy.scope():
        optimizer: Any = make_sgd(case)
        if case.loss_scale:
            optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
        second = keras.optimizers.SGD(OPTION_SECOND_LR) if case.two_optimizers else None
        model = linear_model(case, optimizer, second)
    recorder = Recorder()
    callbacks = [keras.callbacks.SwapEMAWeights(), recorder] if case.swap else [recorder]
    x, y, _, _ = problem()
    rows = OPTION_STEPS * P * OPTION_LOCAL
    history = model.fit(
        x[:rows],
        y[:rows],
        batch_size=P * OPTION_LOCAL,
        epochs=OPTION_EPOCHS,
        shuffle=False,
        verbose=0,
        callbacks=callbacks,
        validation_data=validation() if case.swap else None,
    )
    return model, recorder, history


@pytest.mark.parametrize("name", [name for name, case in OPTION_CASES.items() if case.under_a_strategy])
def test_each_option_under_adasum_strategy_keeps_its_rule_on_every_replica(name: str) -> None:
    case = OPTION_CASES[name]
    strategy = tf_adasum.AdasumStrategy(devices=cpus(P), sync_every=case.sync_every)
    model, recorder, history = fit_under_adasum_strategy(case, strategy)
    stepping = model.optimizer.inner_optimizer if case.loss_scale else model.optimizer
    assert isinstance(stepping, tf_adasum.AdasumOptimizer)
    assert len(recorder.snapshots) == OPTION_EPOCHS * OPTION_STEPS + (OPTION_EPOCHS if case.swap else 0)
    check_copies_agree([recorder.snapshots[i] for i in agreed(case, len(recorder.snapshots))], name)
    final = [
        [c.numpy() for c in strategy.experimental_local_results(v.value)]
        for v in [*model.weights, *averages(model.optimizer)]
    ]
    check_copies_agree([final], f"{name}, after fit")
    check_against_the_reference(
        case,
        model.get_weights(),
        [copies[0] for copies in final[len(model.weights) :]],
        recorder.evaluated,
        history.history.get("val_loss", []),
    )


def test_the_reference_tells_each_option_and_an_average_before_the_sync_apart() -> None:
    # The checks above can fail: each case's reference ends elsewhere than plain SGD's, and a moving
    # average each replica takes of its own weights before the sync ends elsewhere than the rule's.
    batches = replica_batches(P)
    plain = simulate(Case(), batches).weights
    for name, case in OPTION_CASES.items():
        if case.loss_scale and not case.ema:
            continue  # a loss scale of a power of two changes no bit
        ends = simulate(case, batches).weights
        assert not np.allclose(ends[0], plain[0], rtol=1e-3, atol=1e-4), name
    for name in ("ema", "ema_accumulation"):
        rule, broken = (simulate(OPTION_CASES[name], batches, before) for before in (False, True))
        assert not np.allclose(rule.averages[0], broken.averages[0], rtol=1e-3, atol=1e-4), name
    # Accumulation's sync with every update, or every other: the reference tells them apart.
    every, every_2 = (
        simulate(OPTION_CASES[n], batches).weights for n in ("accumulation", "accumulation_sync_every_2")
    )
    assert not np.allclose(every[0], every_2[0], rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("ema_overwrite", "ema_overwrite_frequency=2, which Keras cannot run under a tf.distribute strategy"),
        (
            "accumulation",
            "gradient_accumulation_steps=2, which Keras cannot run under a tf.distribute strategy",
        ),
        ("ema_sync_every_2", "has use_ema=True, with sync_every=2"),
    ],
)
def test_adasum_strategy_refuses_at_compile_what_cannot_keep_its_meaning(name: str, says: str) -> None:
    case = OPTION_CASES.get(name) or Case(OPTION_CASES["ema"].sgd, sync_every=2)
    strategy = tf_adasum.AdasumStrategy(devices=cpus(P), sync_every=case.sync_every)
    with strategy.scope(), pytest.raises(ValueError, match=says) as raised:
        linear_model(case, make_sgd(case))
    assert "(SGD)" in str(raised.value)  # names the optimizer, and says what to do instead
    assert "Use sync_every=1" in str(raised.value) or "Leave" in str(raised.value)


def test_adasum_callback_refuses_an_average_with_local_steps_and_a_second_plain_optimizer() -> None:
    # In a world of one process: the refusals come before any sync.
    x, y, _, _ = problem()
    model = linear_model(OPTION_CASES["ema"], make_sgd(OPTION_CASES["ema"]))
    with pytest.raises(ValueError, match=r"has use_ema=True, with sync_every=2: .* Use sync_every=1"):
        model.fit(x[:8], y[:8], batch_size=4, verbose=0, callbacks=[tf_adasum.AdasumCallback(sync_every=2)])
    two = OPTION_CASES["two_optimizers"]
    refused = r"optimizer 'second' \(SGD\) steps in this train step too"
    # Also where a callback after it traces the train function again, as OrthogonalityMonitor does.
    for callbacks in ([tf_adasum.AdasumCallback()], [tf_adasum.AdasumCallback(), OrthogonalityMonitor()]):
        model = linear_model(two, make_sgd(two), keras.optimizers.SGD(OPTION_SECOND_LR, name="second"))
        with pytest.raises(ValueError, match=refused) as raised:
            model.fit(x[:8], y[:8], batch_size=4, verbose=0, callbacks=callbacks)
        assert "tf_adasum.AdasumOptimizer(keras.optimizers.SGD(...))" in str(raised.value)
    # The same model with the second optimizer wrapped trains; after fit a plain one is no longer refused.
    model = linear_model(
        two, make_sgd(two), tf_adasum.AdasumOptimizer(keras.optimizers.SGD(OPTION_SECOND_LR))
    )
    model.fit(x[:8], y[:8], batch_size=4, verbose=0, callbacks=[tf_adasum.AdasumCallback()])
    model = linear_model(two, make_sgd(two), keras.optimizers.SGD(OPTION_SECOND_LR))
    model.fit(x[:8], y[:8], batch_size=4, verbose=0)


def test_the_horovod_face_refuses_what_cannot_keep_its_meaning() -> None:
    ema = make_sgd(OPTION_CASES["ema"])
    with pytest.raises(ValueError, match="has use_ema=True, with backward_passes_per_step=2"):
        hvd.DistributedOptimizer(ema, op=hvd.Adasum, backward_passes_per_step=2)
    scaled = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    with pytest.raises(ValueError, match=r"LossScaleOptimizer\(AdasumOptimizer\(optimizer\)\)"):
        hvd.DistributedOptimizer(scaled, op=hvd.Adasum)
    # op=Average's own accumulation beside Keras's: one of the two, not a crash at the first step.
    accumulating = keras.optimizers.SGD(0.1, gradient_accumulation_steps=2)
    with pytest.raises(ValueError, match="gradient_accumulation_steps=2 too: use one of the two"):
        hvd.DistributedOptimizer(accumulating, op=hvd.Average, backward_passes_per_step=2)


# --- AdasumCallback and the Horovod face, on two processes ---------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.parametrize("way", ["callback", "horovod"])
def test_each_option_on_two_processes_keeps_its_rule_on_every_process(way: str, tmp_path: Path) -> None:
    # One launch per way in runs every case in turn (tests/workers/optimizer_options.py).
    code = processes.launch("mpi", P, tmp_path, [*WORKER, str(tmp_path), way])
    assert code == 0, log_tail(tmp_path)
    for name, case in OPTION_CASES.items():
        runs = [np.load(tmp_path / f"{way}_{name}{r}.npz") for r in range(P)]
        infos = [json.loads((tmp_path / f"{way}_{name}{r}.json").read_text()) for r in range(P)]
        points, variables = infos[0]["points"], infos[0]["variables"]
        assert points == OPTION_EPOCHS * OPTION_STEPS + (OPTION_EPOCHS if case.swap else 0), (name, infos[0])
        snapshots = [
            [[runs[r][f"point{i}_{j}"] for r in range(P)] for j in range(variables)]
            for i in agreed(case, points)
        ]
        check_copies_agree(snapshots, f"{way}, {name}")
        weights = [runs[0][f"weight{j}"] for j in range(2)]
        for r in range(1, P):
            for j in range(2):
                np.testing.assert_array_equal(runs[r][f"weight{j}"], weights[j], err_msg=f"{way}, {name}")
        final = [runs[0][f"average{j}"] for j in range(variables - 2)]
        for r in range(1, P):
            for j in range(variables - 2):
                np.testing.assert_array_equal(runs[r][f"average{j}"], final[j], err_msg=f"{way}, {name}")
        evaluated = [[runs[0][f"evaluated{e}_{j}"] for j in range(2)] for e in range(infos[0]["evaluations"])]
        check_against_the_reference(case, weights, final, evaluated, infos[0]["val_loss"])
        assert all(info["plain"] for info in infos), name  # nothing left installed after fit
