"""What tests/workers/keras2.py's modes must have written, against numpy: shared by tests/test_keras2.py
(under tf_adasum.run and horovodrun) and the release matrix (tests/test_matrix.py, each release's
tf_keras)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from tests.support import oracle
from tests.support.training import OUTERS, Outer, Replica, mse_grads, simulate, simulate_replicas


def callback_reference(
    ranks: list[Any], sync_every: int, outer: Outer | None = None, combine: str = "adasum"
) -> tuple[list[np.ndarray], list[float]]:
    """numpy's AdasumCallback(sync_every, outer_optimizer, combine) on the worker's script: rank 0's
    start, each process's own SGD with momentum on its own batches, the tree over the deltas (or their
    mean) every sync_every steps, stepped by `outer` where given; each epoch's loss, the mean over its
    batches and processes, each at the process's own weights."""
    batches = [
        [
            (r["x"][16 * b : 16 * (b + 1)], r["y"][16 * b : 16 * (b + 1)])
            for _epoch in range(2)
            for b in range(2)
        ]
        for r in ranks
    ]
    losses: list[float] = []
    params = simulate_replicas(
        "sgd_momentum",
        [ranks[0]["start"], ranks[0]["start_bias"]],
        batches,
        sync_every,
        losses,
        outer=outer,
        combine=combine,
    )
    return params, [float(np.mean(losses[:4])), float(np.mean(losses[4:]))]


def fit_reference(ranks: list[Any], op: str, passes: int = 1) -> tuple[list[np.ndarray], list[float]]:
    """numpy's fit of the worker's linear model: rank 0's start, SGD with momentum, 2 epochs of 2 batches;
    Adasum of the processes' steps (each with its own momentum), or their gradients' mean (with `passes`
    > 1, Horovod's accumulation: each process's gradients summed over that many passes, then their
    mean over processes stepped on at every passes-th pass). Also each epoch's loss, the mean over
    batches and processes, as fit with MetricAverageCallback logs it."""
    summed = [[np.zeros((3, 2)), np.zeros(2)] for _ in ranks]
    passed = 0
    params = [ranks[0]["start"].astype(np.float64), ranks[0]["start_bias"].astype(np.float64)]
    replicas = [Replica("sgd_momentum", params) for _ in ranks]
    shared = Replica("sgd_momentum", params)
    losses = []
    for _epoch in range(2):
        epoch = []
        for batch in range(2):
            rows = slice(16 * batch, 16 * (batch + 1))
            data = [(r["x"][rows].astype(np.float64), r["y"][rows].astype(np.float64)) for r in ranks]
            epoch += [float(np.mean((x @ params[0] + params[1] - y) ** 2)) for x, y in data]
            grads = [mse_grads(params, x, y) for x, y in data]
            if op == "adasum":
                deltas = [
                    [after - before for after, before in zip(rep.step(params, g, 0), params, strict=True)]
                    for rep, g in zip(replicas, grads, strict=True)
                ]
                params = [p + d for p, d in zip(params, oracle.tree(deltas), strict=True)]
            else:
                summed = [
                    [s + g for s, g in zip(sums, gs, strict=True)]
                    for sums, gs in zip(summed, grads, strict=True)
                ]
                passed += 1
                if passed % passes == 0:
                    mean = [np.mean(parts, axis=0) for parts in zip(*summed, strict=True)]
                    params = shared.step(params, mean, 0)
                    summed = [[np.zeros((3, 2)), np.zeros(2)] for _ in ranks]
        losses.append(float(np.mean(epoch)))
    return params, losses


def check_mode(out: Path, mode: str) -> np.ndarray:
    """Asserts that both ranks of `mode` ended bitwise alike and as numpy says; returns rank 0's kernel."""
    ranks = [np.load(out / f"{mode}{r}.npz") for r in range(2)]
    for name in ("w", "b"):
        np.testing.assert_array_equal(ranks[0][name], ranks[1][name], err_msg=f"{mode}: {name}")
    atol, rtol = 1e-6, 1e-5
    if mode.startswith("keras2_strategy"):  # keras2_strategy_{kind}_{sync_every}
        _, _, kind, every = mode.split("_")
        kind = "sgd_momentum" if kind == "sgd" else kind
        losses: list[float] = []
        params = simulate(kind, 2, int(every), 4, 16, losses)
        atol = 2e-5 if kind == "adam" else atol  # float32 Adam, as the Keras 3 tests take it
        np.testing.assert_array_equal(ranks[0]["loss"], ranks[1]["loss"], err_msg=mode)
        np.testing.assert_allclose(ranks[0]["loss"], [np.mean(losses)], rtol=1e-5, err_msg=mode)
    elif mode.startswith(("keras2_fit", "keras2_callback")):
        assert str(ranks[0]["optimizer"]).startswith("tf_keras."), ranks[0]["optimizer"]
        if mode == "keras2_fit_adasum_k2":  # the same windows as AdasumCallback(sync_every=2)
            params, losses = callback_reference(ranks, 2)
        elif mode == "keras2_fit_average_k2":
            params, losses = fit_reference(ranks, "average", passes=2)
        elif mode.startswith("keras2_fit"):
            params, losses = fit_reference(ranks, mode.rsplit("_", 1)[1])
        else:  # keras2_callback[_outer|_mean|_bf16]_{sync_every}
            outer = Outer(*OUTERS["nesterov"]) if "_outer_" in mode else None
            combine = "mean" if "_mean_" in mode else "adasum"
            params, losses = callback_reference(ranks, int(mode.rsplit("_", 1)[1]), outer, combine)
        if "_bf16_" in mode:  # the deltas narrowed on the wire: within bfloat16's rounding of numpy's
            atol = rtol = 1e-2
        np.testing.assert_array_equal(ranks[0]["loss"], ranks[1]["loss"], err_msg=mode)
        np.testing.assert_allclose(ranks[0]["loss"], losses, rtol=rtol, err_msg=mode)
        assert (out / f"{mode}.weights.h5").exists(), "rank 0's checkpoint"
    else:  # keras2, keras3: SGD on the Adasum of the ranks' gradients
        params = [ranks[0]["start"].astype(np.float64), ranks[0]["start_bias"].astype(np.float64)]
        for _ in range(3):
            grads = [mse_grads(params, r["x"].astype(np.float64), r["y"].astype(np.float64)) for r in ranks]
            params = [p - 0.1 * g for p, g in zip(params, oracle.tree(grads), strict=True)]
    np.testing.assert_allclose(ranks[0]["w"], params[0], rtol=rtol, atol=atol, err_msg=mode)
    np.testing.assert_allclose(ranks[0]["b"], params[1], rtol=rtol, atol=atol, err_msg=mode)
    return ranks[0]["w"]
