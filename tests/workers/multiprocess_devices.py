"""The worker of tests/test_multiprocess.py's several-devices test: AdasumStrategy over this process's
logical CPUs, across processes, under `mpirun` or `python -m tf_adasum.run`:
`python -m tests.workers.multiprocess_devices OUT MODE[,MODE...]` (tests/workers/dispatch.py), with
$TF_ADASUM_TEST_REPLICA_COUNTS (data.REPLICA_COUNTS) each rank's number of replicas, e.g. "2,3".

Modes:
    refused            AdasumStrategy given every device TensorFlow lists: under the TF engine it lists
                       other processes' too, and the strategy refuses them by name (devices_refused{r}.txt;
                       under MPI there are none, and no file)
    fit                each of data.DEVICE_CASES: model.fit and evaluate from ranks that start elsewhere,
                       every replica's weights and every replica's whole state (weights and optimizer
                       variables) saved
    resume             each of data.RESUMED: half the steps, each process's own checkpoint, a fresh model
                       restored from it, the other half; every replica's whole state saved, for the test
                       to hold against fit's
    batchnorm          BatchNormalization's moving statistics over every replica of every process
    synced_batchnorm   BatchNormalization(synchronized=True): the global batch's moments every step
    reductions         ReplicaContext.all_reduce and strategy.reduce by the enum's names, eagerly and
                       compiled; under the TF engine also MultiWorkerMirroredStrategy's own sum

The logical CPUs are configured before tf_adasum is imported: under tf_adasum.run the import starts
TensorFlow's collective runtime, after which the devices can no longer change.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np
import tensorflow as tf

from tests.workers.data import DEVICE_CASES, LOCAL, REPLICA_COUNTS, RESUMED, STEPS
from tests.workers.dispatch import main

# The strategy of the batchnorm, synced_batchnorm and reductions modes (DEVICE_CASES' last): each
# process's replicas averaged, then Adasum over processes.
LAST_CASE = {"sync_every": 1, "local_reduction": "mean"}


def counts() -> list[int]:
    return [int(c) for c in os.environ[REPLICA_COUNTS].split(",")]


def configure_devices() -> None:
    """This rank's logical CPUs, counts()[rank] of them; the rank from the launcher's environment."""
    if "TF_CONFIG" in os.environ:
        rank = int(json.loads(os.environ["TF_CONFIG"])["task"]["index"])
    else:
        rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * counts()[rank]
    )


def own_devices() -> list[str]:
    """This process's logical CPUs: under the TF engine TensorFlow lists every process's (this one's
    first), and only its own are kept."""
    import tf_adasum

    comm = tf_adasum.init()
    devices = [
        d.name
        for d in tf.config.list_logical_devices("CPU")
        if "/task:" not in d.name or f"/task:{comm.rank}/" in d.name
    ]
    assert len(devices) == counts()[comm.rank], devices
    return devices


def replicas_of(strategy: Any, model: Any) -> list[np.ndarray]:
    """Every local replica's copy of every weight and optimizer variable, stacked."""
    from tf_adasum.common.variables import tf_variable

    return [np.stack([c.numpy() for c in strategy.experimental_local_results(tf_variable(v))])
            for v in [*model.weights, *model.optimizer.variables]]  # fmt: skip


def refused(out: Path) -> None:
    import tf_adasum

    comm = tf_adasum.init()
    devices = own_devices()
    everyone = [d.name for d in tf.config.list_logical_devices("CPU")]
    if everyone != devices:  # TF engine: another process's device is refused, by name
        try:
            tf_adasum.AdasumStrategy(devices=everyone)
            message = ""
        except ValueError as error:
            message = str(error)
        (out / f"devices_refused{comm.rank}.txt").write_text(message)


def fit(out: Path) -> None:
    import tf_adasum
    from tests.support.training import build_linear, make_inner, problem

    comm = tf_adasum.init()
    devices = own_devices()
    x, y, _, _ = problem()
    total = sum(counts())
    rows = LOCAL * total * STEPS
    for kind, sync_every, local_reduction in DEVICE_CASES:
        strategy = tf_adasum.AdasumStrategy(
            devices=devices, sync_every=sync_every, local_reduction=local_reduction
        )
        model = build_linear(strategy, lambda: make_inner(kind))  # noqa: B023
        # Every rank starts elsewhere: the strategy must start all from rank 0's weights.
        model.set_weights([w + comm.rank for w in model.get_weights()])
        # The same global batches everywhere: the strategy hands each process its replicas' share.
        history = model.fit(x[:rows], y[:rows], batch_size=LOCAL * total, shuffle=False, verbose=0)
        evaluated = model.evaluate(x[:rows], y[:rows], batch_size=LOCAL * total, verbose=0)
        state = replicas_of(strategy, model)
        name = f"devices_{kind}_{local_reduction}"
        np.savez(out / f"{name}{comm.rank}.npz", *state[: len(model.weights)])
        np.savez(out / f"{name}_state{comm.rank}.npz", *state)
        info = {
            "loss": float(history.history["loss"][-1]),
            "evaluate": float(evaluated),
            "replicas": strategy.num_replicas_in_sync,
            "counts": strategy.replica_counts,
        }
        (out / f"{name}{comm.rank}.json").write_text(json.dumps(info))


def resume(out: Path) -> None:
    import tf_adasum
    from tests.support.training import build_linear, make_inner, problem

    comm = tf_adasum.init()
    devices = own_devices()
    x, y, _, _ = problem()
    total = sum(counts())
    rows = LOCAL * total * STEPS
    for kind, sync_every, local_reduction in RESUMED:
        strategy = tf_adasum.AdasumStrategy(
            devices=devices, sync_every=sync_every, local_reduction=local_reduction
        )
        before = build_linear(strategy, lambda: make_inner(kind))  # noqa: B023
        before.set_weights([w + comm.rank for w in before.get_weights()])
        half = rows // 2
        before.fit(x[:half], y[:half], batch_size=LOCAL * total, shuffle=False, verbose=0)
        saved = tf.train.Checkpoint(model=before, optimizer=before.optimizer).save(
            out / f"resume_{kind}_{local_reduction}_rank{comm.rank}"  # every process its own
        )
        after = build_linear(strategy, lambda: make_inner(kind))  # noqa: B023
        with strategy.scope():
            after.optimizer.build(after.trainable_variables)
        tf.train.Checkpoint(model=after, optimizer=after.optimizer).restore(saved)
        after.fit(x[half:rows], y[half:rows], batch_size=LOCAL * total, shuffle=False, verbose=0)
        np.savez(out / f"resumed_{kind}_{local_reduction}{comm.rank}.npz", *replicas_of(strategy, after))


def batchnorm(out: Path) -> None:
    """BatchNorm: each replica's batch moments, averaged over every replica of every process."""
    import keras

    import tf_adasum
    from tests.support.training import problem

    comm = tf_adasum.init()
    strategy = tf_adasum.AdasumStrategy(devices=own_devices(), **LAST_CASE)
    x, y, _, _ = problem()
    total = sum(counts())
    rows = LOCAL * total * STEPS
    with strategy.scope():
        bn = keras.Sequential([keras.Input((3,)), keras.layers.BatchNormalization(), keras.layers.Dense(2)])
        bn.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    bn.fit(x[:rows] * (1 + comm.rank), y[:rows], batch_size=LOCAL * total, shuffle=False, verbose=0)
    np.savez(out / f"devices_batchnorm{comm.rank}.npz", *bn.get_weights())


def synced_batchnorm(out: Path) -> None:
    """BatchNormalization(synchronized=True): the global batch's moments (ReplicaContext.all_reduce)."""
    import keras

    import tf_adasum
    from tests.support.training import problem

    comm = tf_adasum.init()
    strategy = tf_adasum.AdasumStrategy(devices=own_devices(), **LAST_CASE)
    x, y, _, _ = problem()
    total = sum(counts())
    rows = LOCAL * total * STEPS
    with strategy.scope():
        layers = [
            keras.Input((3,)),
            keras.layers.BatchNormalization(synchronized=True),
            keras.layers.Dense(2),
        ]
        synced = keras.Sequential(layers)
        synced.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    synced.fit(x[:rows] * (1 + comm.rank), y[:rows], batch_size=LOCAL * total, shuffle=False, verbose=0)
    np.savez(out / f"devices_synced{comm.rank}.npz", *synced.get_weights())


def reductions(out: Path) -> None:
    """ReplicaContext.all_reduce and strategy.reduce by the enum's names in any case, as under
    MultiWorkerMirroredStrategy: over every replica of every process. Global replica g holds g + 1."""
    import tf_adasum

    comm = tf_adasum.init()
    strategy = tf_adasum.AdasumStrategy(devices=own_devices(), **LAST_CASE)
    first = sum(counts()[: comm.rank])

    def replica_step() -> Any:
        context = tf.distribute.get_replica_context()
        value = tf.cast(first + context.replica_id_in_sync_group + 1, tf.float32)
        return context.all_reduce("sum", value), context.all_reduce("MEAN", [value, 2 * value])

    seen = {}
    for how, step in (("eager", replica_step), ("compiled", tf.function(replica_step))):
        total_sum, (mean, twice) = strategy.run(step)
        seen[how] = [float(strategy.experimental_local_results(t)[0]) for t in (total_sum, mean, twice)]
    per_replica = strategy.run(
        lambda: tf.cast(first + tf.distribute.get_replica_context().replica_id_in_sync_group + 1, tf.float32)
    )
    seen["reduce"] = [
        float(strategy.reduce("sum", per_replica, axis=None)),
        float(strategy.reduce("Mean", per_replica, axis=None)),
    ]
    if comm.engine == "tf":
        # MultiWorkerMirroredStrategy's own all_reduce (one device a process), each process's first + 1.
        mwms = comm.strategy
        step = tf.function(
            lambda: tf.distribute.get_replica_context().all_reduce("sum", tf.constant(first + 1.0))
        )
        seen["mwms_sum"] = float(mwms.experimental_local_results(mwms.run(step))[0])
    (out / f"devices_reductions{comm.rank}.json").write_text(json.dumps(seen))


MODES = {
    "refused": refused,
    "fit": fit,
    "resume": resume,
    "batchnorm": batchnorm,
    "synced_batchnorm": synced_batchnorm,
    "reductions": reductions,
}

if __name__ == "__main__":
    configure_devices()  # before tf_adasum, which under tf_adasum.run starts TensorFlow
    main(MODES)
