"""The worker of tests/test_optimizer_options.py, under `mpirun`:
`python -m tests.workers.optimizer_options OUT MODE[,MODE...]` (tests/workers/dispatch.py).

Modes:
    callback    every case of data.OPTION_CASES under AdasumCallback
    horovod     every case under tf_adasum.keras's DistributedOptimizer(op=Adasum)

Each process fits its rows (process_rows) and writes, per case, OUT/{mode}_{case}{rank}.npz: its copy of
the weights and moving averages at every batch end and evaluation start ("point{i}_{j}"), the weights
after fit ("weight{j}"), the moving averages after fit ("average{j}") and the weights each evaluation saw
("evaluated{e}_{j}"); and OUT/{mode}_{case}{rank}.json: the counts, the validation losses, and whether
the model kept the optimizer it was compiled with, with nothing left installed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras
import numpy as np

import tf_adasum
import tf_adasum.keras as hvd
from tests.support.optimizer_options import (
    Recorder,
    averages,
    linear_model,
    make_sgd,
    process_rows,
    validation,
)
from tests.workers.data import OPTION_CASES, OPTION_EPOCHS, OPTION_LOCAL, OPTION_SECOND_LR, Case
from tests.workers.dispatch import main


def optimizers(way: str, case: Case) -> tuple[Any, Any, list[keras.callbacks.Callback]]:
    """The compiled optimizer, the second one (two_optimizers) and the callbacks, as each way has them."""
    if way == "callback":
        optimizer: Any = make_sgd(case)
        second = tf_adasum.AdasumOptimizer(keras.optimizers.SGD(OPTION_SECOND_LR))  # a plain one is refused
        callbacks: list[keras.callbacks.Callback] = [tf_adasum.AdasumCallback(sync_every=case.sync_every)]
    elif way == "horovod":
        optimizer = hvd.DistributedOptimizer(
            make_sgd(case), op=hvd.Adasum, backward_passes_per_step=case.sync_every
        )
        second = hvd.DistributedOptimizer(keras.optimizers.SGD(OPTION_SECOND_LR), op=hvd.Adasum)
        callbacks = []
    else:
        raise ValueError(f"unknown way in {way!r}")
    if case.loss_scale:
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    return optimizer, second if case.two_optimizers else None, callbacks


def run_cases(out: Path, way: str) -> None:
    rank, size = tf_adasum.init().rank, tf_adasum.size()
    x, y = process_rows(rank, size)
    for name, case in OPTION_CASES.items():
        optimizer, second, callbacks = optimizers(way, case)
        model = linear_model(case, optimizer, second)
        recorder = Recorder()
        callbacks += [keras.callbacks.SwapEMAWeights(), recorder] if case.swap else [recorder]
        history = model.fit(
            x,
            y,
            batch_size=OPTION_LOCAL,
            epochs=OPTION_EPOCHS,
            shuffle=False,
            verbose=0,
            callbacks=callbacks,
            validation_data=validation() if case.swap else None,
        )
        arrays = {
            f"point{i}_{j}": copies[0]
            for i, snapshot in enumerate(recorder.snapshots)
            for j, copies in enumerate(snapshot)
        }
        arrays |= {f"weight{j}": w for j, w in enumerate(model.get_weights())}
        arrays |= {f"average{j}": v.numpy() for j, v in enumerate(averages(model.optimizer))}
        arrays |= {
            f"evaluated{e}_{j}": w for e, seen in enumerate(recorder.evaluated) for j, w in enumerate(seen)
        }
        np.savez(out / f"{way}_{name}{rank}.npz", **arrays)
        stepping = optimizer.inner_optimizer if case.loss_scale else optimizer
        info = {
            "points": len(recorder.snapshots),
            "variables": len(recorder.snapshots[0]),
            "evaluations": len(recorder.evaluated),
            "val_loss": history.history.get("val_loss", []),
            # After fit the model holds the optimizer it was compiled with, with nothing left installed.
            "plain": model.optimizer is optimizer and "apply" not in vars(stepping),
        }
        (out / f"{way}_{name}{rank}.json").write_text(json.dumps(info))


def callback(out: Path) -> None:
    run_cases(out, "callback")


def horovod(out: Path) -> None:
    run_cases(out, "horovod")


MODES = {"callback": callback, "horovod": horovod}

if __name__ == "__main__":
    main(MODES)
