"""One process of the several-devices tests: AdasumStrategy over this process's logical CPUs, across
processes, under `mpirun` or `python -m tf_adasum.run`.

Usage:
    devices_worker.py OUT_DIR COUNTS    # COUNTS: each rank's number of replicas, e.g. 2,3

The logical CPUs are configured before tf_adasum is imported: under tf_adasum.run the import starts
TensorFlow's collective runtime, after which the devices can no longer change.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import tensorflow as tf

# (optimizer, sync_every, local_reduction); each replica takes LOCAL rows of every global batch, for
# STEPS steps.
CASES = (("sgd_momentum", 1, "adasum"), ("adam", 2, "adasum"), ("adam", 1, "mean"))
LOCAL, STEPS = 2, 4
# Resumed from each process's own checkpoint after STEPS // 2 steps (a sync), then the rest: as CASES'
# run of the same case, bitwise, every replica's optimizer state included.
RESUMED = (("adam", 2, "adasum"), ("adam", 1, "mean"))


def configure_devices(counts: list[int]) -> None:
    """This rank's logical CPUs, counts[rank] of them; the rank from the launcher's environment."""
    if "TF_CONFIG" in os.environ:
        rank = int(json.loads(os.environ["TF_CONFIG"])["task"]["index"])
    else:
        rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * counts[rank]
    )


def main(out: Path, counts: list[int]) -> None:
    import keras

    import tf_adasum
    from tests.test_training import build_linear, make_inner, problem
    from tf_adasum.variables import tf_variable

    comm = tf_adasum.init()
    # Under the TF engine TensorFlow lists every process's devices (this one's first): keep its own.
    devices = [
        d.name
        for d in tf.config.list_logical_devices("CPU")
        if "/task:" not in d.name or f"/task:{comm.rank}/" in d.name
    ]
    assert len(devices) == counts[comm.rank], devices
    everyone = [d.name for d in tf.config.list_logical_devices("CPU")]
    if everyone != devices:  # TF engine: another process's device is refused, by name
        try:
            tf_adasum.AdasumStrategy(devices=everyone)
            refused = ""
        except ValueError as error:
            refused = str(error)
        (out / f"devices_refused{comm.rank}.txt").write_text(refused)
    x, y, _, _ = problem()
    total = sum(counts)
    rows = LOCAL * total * STEPS

    def replicas_of(strategy: Any, model: Any) -> list[np.ndarray]:
        """Every local replica's copy of every weight and optimizer variable, stacked."""
        return [np.stack([c.numpy() for c in strategy.experimental_local_results(tf_variable(v))])
                for v in [*model.weights, *model.optimizer.variables]]  # fmt: skip

    for kind, sync_every, local_reduction in CASES:
        strategy = tf_adasum.AdasumStrategy(
            devices=devices, sync_every=sync_every, local_reduction=local_reduction
        )
        model = build_linear(strategy, lambda: make_inner(kind))  # noqa: B023
        # Every rank starts elsewhere: the strategy must start all from rank 0's weights.
        model.set_weights([w + comm.rank for w in model.get_weights()])
        # The same global batches everywhere: the strategy hands each process its replicas' share.
        history = model.fit(x[:rows], y[:rows], batch_size=LOCAL * total, shuffle=False, verbose=0)
        evaluated = model.evaluate(x[:rows], y[:rows], batch_size=LOCAL * total, verbose=0)
        components = replicas_of(strategy, model)[: len(model.weights)]
        np.savez(out / f"devices_{kind}_{local_reduction}{comm.rank}.npz", *components)
        if (kind, sync_every, local_reduction) in RESUMED:
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
            resumed, went_on = replicas_of(strategy, after), replicas_of(strategy, model)
            (out / f"resumed_{kind}_{local_reduction}{comm.rank}.json").write_text(
                json.dumps([bool(np.array_equal(a, b)) for a, b in zip(resumed, went_on, strict=True)])
            )
        info = {
            "loss": float(history.history["loss"][-1]),
            "evaluate": float(evaluated),
            "replicas": strategy.num_replicas_in_sync,
            "counts": strategy.replica_counts,
        }
        (out / f"devices_{kind}_{local_reduction}{comm.rank}.json").write_text(json.dumps(info))

    # BatchNorm: each replica's batch moments, averaged over every replica of every process.
    with strategy.scope():
        bn = keras.Sequential([keras.Input((3,)), keras.layers.BatchNormalization(), keras.layers.Dense(2)])
        bn.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    bn.fit(x[:rows] * (1 + comm.rank), y[:rows], batch_size=LOCAL * total, shuffle=False, verbose=0)
    np.savez(out / f"devices_batchnorm{comm.rank}.npz", *bn.get_weights())

    # BatchNormalization(synchronized=True): the global batch's moments, through ReplicaContext.all_reduce.
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

    # ReplicaContext.all_reduce and strategy.reduce by the enum's names in any case, as under
    # MultiWorkerMirroredStrategy: over every replica of every process. Global replica g holds g + 1.
    first = sum(counts[: comm.rank])

    def replica_step() -> Any:
        context = tf.distribute.get_replica_context()
        value = tf.cast(first + context.replica_id_in_sync_group + 1, tf.float32)
        return context.all_reduce("sum", value), context.all_reduce("MEAN", [value, 2 * value])

    reductions = {}
    for how, step in (("eager", replica_step), ("compiled", tf.function(replica_step))):
        total_sum, (mean, twice) = strategy.run(step)
        reductions[how] = [float(strategy.experimental_local_results(t)[0]) for t in (total_sum, mean, twice)]
    per_replica = strategy.run(
        lambda: tf.cast(first + tf.distribute.get_replica_context().replica_id_in_sync_group + 1, tf.float32)
    )
    reductions["reduce"] = [
        float(strategy.reduce("sum", per_replica, axis=None)),
        float(strategy.reduce("Mean", per_replica, axis=None)),
    ]
    if comm.engine == "tf":
        # MultiWorkerMirroredStrategy's own all_reduce (one device a process), each process's first + 1.
        mwms = comm.strategy
        step = tf.function(
            lambda: tf.distribute.get_replica_context().all_reduce("sum", tf.constant(first + 1.0))
        )
        reductions["mwms_sum"] = float(mwms.experimental_local_results(mwms.run(step))[0])
    (out / f"devices_reductions{comm.rank}.json").write_text(json.dumps(reductions))


if __name__ == "__main__":
    replica_counts = [int(c) for c in sys.argv[2].split(",")]
    configure_devices(replica_counts)  # before tf_adasum, which under tf_adasum.run starts TensorFlow
    main(Path(sys.argv[1]), replica_counts)
