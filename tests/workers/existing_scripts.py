"""The worker of tests/test_existing_scripts.py (and, for its plain Keras and Horovod modes, of
tests/workers/cluster.py): plain Keras scripts under AdasumCallback, Horovod scripts under
tf_adasum.keras, and what happens when a rank fails. Started by mpirun, `python -m tf_adasum.run` or
horovodrun: `python -m tests.workers.existing_scripts OUT MODE[,MODE...]` (tests/workers/dispatch.py);
every process writes what it saw into OUT.

Modes:
    callback            AdasumCallback on data.CASES: {SGD momentum, Adam} x sync_every {1, 2}, roots,
                        steps_per_execution 2
    mixed_precision     mixed_float16 with rank 1's first batch overflowing, under AdasumCallback
                        (sync_every 1, 2) and DistributedOptimizer(op=Adasum, backward_passes_per_step=2)
    orthogonality       OrthogonalityMonitor under AdasumCallback
    example             the Horovod example port (examples/horovod_keras_digits.py), 4 epochs
    average             DistributedOptimizer(op=Average): one step on each rank's batch
    accumulate          gradient accumulation, data.ACCUMULATION (backward_passes_per_step)
    lazy                a model Keras builds in its first step, under BroadcastGlobalVariablesCallback
    local_variables     PartialDistributedOptimizer and local variables (Average, Adasum)
    sparse              DistributedOptimizer(sparse_as_dense=True) on an Embedding
    resume_on_rank_0    Horovod's resume: rank 0 loads its checkpoint, the callback broadcasts it
    nan                 a NaN in rank 1's third batch under AdasumCallback
    uneven_known        rank 1 has one batch fewer, the length known
    uneven_unknown      rank 1 runs out of a generator's batches first
    uneven_buckets      the same, with the model's sync in buckets ($TF_ADASUM_BUCKET_MB)
    killed              rank 1 dies mid-epoch (SIGKILL); BackupAndRestore saves every 2 batches
    hung                rank 1 hangs mid-epoch instead
    resume_from_backup  the killed job's fit again: it resumes from the backup
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras
import numpy as np
import tensorflow as tf

import tf_adasum  # under tf_adasum.run and horovodrun this starts the TF engine
from tests.workers.data import (
    ACCUMULATION,
    BATCH,
    CASES,
    FEATURES,
    OUTPUTS,
    ROWS_PER_RANK,
    initial_weights,
    shard,
)
from tests.workers.dispatch import main

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def make_optimizer(kind: str) -> keras.optimizers.Optimizer:
    if kind == "sgd_momentum":
        return keras.optimizers.SGD(0.1, momentum=0.9)
    return keras.optimizers.Adam(0.1, beta_1=0.9, beta_2=0.999, epsilon=1e-7)


def linear_model(rank: int, optimizer: Any, steps_per_execution: int = 1) -> keras.Model:
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(OUTPUTS)])
    model.set_weights(initial_weights(rank))  # every rank starts elsewhere: the callback must broadcast
    model.compile(optimizer=optimizer, loss="mse", steps_per_execution=steps_per_execution)
    return model


def save(out: Path, name: str, info: dict[str, Any], arrays: list[np.ndarray] | None = None) -> None:
    rank = tf_adasum.rank()
    (out / f"{name}{rank}.json").write_text(json.dumps(info))
    if arrays is not None:
        np.savez(out / f"{name}{rank}.npz", *arrays)


def callback(out: Path) -> None:
    tf_adasum.init()
    x, y = shard(tf_adasum.rank())
    for i, (kind, sync_every, root, steps_per_execution) in enumerate(CASES):
        user_optimizer = make_optimizer(kind)
        model = linear_model(tf_adasum.rank(), user_optimizer, steps_per_execution)
        model.fit(
            x,
            y,
            batch_size=BATCH,
            shuffle=False,
            verbose=0,
            callbacks=[tf_adasum.AdasumCallback(sync_every=sync_every, root=root % tf_adasum.size())],
        )
        # After fit the model holds the user's optimizer, plain: it saves and loads without tf_adasum.
        plain = model.optimizer is user_optimizer and "apply" not in vars(user_optimizer)
        comm = tf_adasum.init()
        info = {
            "plain_optimizer": plain,
            "engine": comm.engine,
            "size": comm.size,
            "rendezvous": os.environ.get("HOROVOD_GLOO_RENDEZVOUS_ADDR"),
            "workers": getattr(comm, "workers", None),
        }
        save(out, f"callback_case{i}_", info, model.get_weights())


def orthogonality(out: Path) -> None:
    """OrthogonalityMonitor under AdasumCallback: rank r's step moves one kernel along (r + 1) e_r, the
    other along e_0 (as tests/test_monitor.py does with replicas)."""
    tf_adasum.init()
    rank, size = tf_adasum.rank(), tf_adasum.size()
    orthogonal, parallel = keras.Input((size,)), keras.Input((size,))
    zeros = {"use_bias": False, "kernel_initializer": "zeros"}
    branches = [
        keras.layers.Dense(1, name="orthogonal", **zeros)(orthogonal),
        keras.layers.Dense(1, name="parallel", **zeros)(parallel),
    ]
    model = keras.Model([orthogonal, parallel], keras.layers.Add()(branches))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    x = [np.eye(size, dtype=np.float32)[rank : rank + 1] * (rank + 1), np.eye(size, dtype=np.float32)[:1]]
    monitor = tf_adasum.callbacks.OrthogonalityMonitor(every=1)
    model.fit(x, np.ones((1, 1), np.float32), verbose=0, callbacks=[tf_adasum.AdasumCallback(), monitor])
    save(out, "orthogonality", monitor.values())


def mixed_precision(out: Path) -> None:
    """mixed_float16 with rank 1's first batch overflowing: every process skips that step."""
    import tf_adasum.keras as hvd

    tf_adasum.init()
    x, y = (a / 10 for a in shard(tf_adasum.rank()))  # small enough for float16 at a loss scale of 2^15
    if tf_adasum.rank() == 1:
        x[:BATCH] *= 3e4
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        for name, sync_every in (("callback", 1), ("callback", 2), ("distributed_optimizer", 2)):
            callbacks: list[Any] = []
            optimizer: Any = make_optimizer("sgd_momentum")
            if name == "callback":
                callbacks = [tf_adasum.AdasumCallback(sync_every=sync_every)]
            else:
                optimizer = hvd.DistributedOptimizer(
                    optimizer, op=hvd.Adasum, backward_passes_per_step=sync_every
                )
            model = linear_model(tf_adasum.rank(), optimizer)
            assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
            model.fit(x[:BATCH], y[:BATCH], batch_size=BATCH, shuffle=False, verbose=0, callbacks=callbacks)
            skipped = {
                "scale": float(model.optimizer.dynamic_scale.numpy()),
                "iterations": int(model.optimizer.iterations.numpy()),
                "unchanged": all(
                    np.array_equal(a, b) for a, b in zip(model.get_weights(), initial_weights(0), strict=True)
                ),
            }
            steps = BATCH * (1 + sync_every)
            model.fit(
                x[BATCH:steps],
                y[BATCH:steps],
                batch_size=BATCH,
                shuffle=False,
                verbose=0,
                callbacks=callbacks,
            )
            info = {"skipped": skipped, "iterations": int(model.optimizer.iterations.numpy())}
            save(out, f"mixed_{name}{sync_every}_", info, model.get_weights())
    finally:
        keras.mixed_precision.set_global_policy("float32")


def example(out: Path) -> None:
    """The Horovod example port, 4 epochs of 120 steps; it writes its checkpoints into OUT."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))  # the example's module
    import horovod_keras_digits as digits

    import tf_adasum.keras as hvd

    hvd.init()
    digits.EPOCHS, digits.STEPS = 4, 120
    os.chdir(out)  # the example writes its checkpoints into the working directory
    model = digits.train()
    history = model.history.history
    rate = float(keras.ops.convert_to_numpy(model.optimizer.learning_rate))
    info = {"history": history, "learning_rate": rate, "size": hvd.size()}
    save(out, "example", info, model.get_weights())


def average(out: Path) -> None:
    """DistributedOptimizer(op=Average): one step on each rank's batch = one step on both batches."""
    import tf_adasum.keras as hvd

    hvd.init()
    x, y = shard(hvd.rank())
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), op=hvd.Average)
    model = linear_model(0, optimizer)
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    save(out, "average", {}, model.get_weights())


def accumulate(out: Path) -> None:
    """Gradient accumulation: k passes summed on each rank, then one all-reduce (two epochs: 8 passes)."""
    import tf_adasum.keras as hvd

    hvd.init()
    x, y = shard(hvd.rank())
    for name, (op, kind, k, averaged) in ACCUMULATION.items():
        optimizer = hvd.DistributedOptimizer(
            make_optimizer(kind),
            op=getattr(hvd, op),
            backward_passes_per_step=k,
            average_aggregated_gradients=averaged,
        )
        model = linear_model(0, optimizer)
        model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
        save(out, name, {"iterations": int(optimizer.iterations.numpy())}, model.get_weights())


def lazy(out: Path) -> None:
    """A model Keras builds only in its first step (no Input): the broadcast comes after the first batch."""
    import tf_adasum.keras as hvd

    hvd.init()
    x, y = shard(hvd.rank())
    keras.utils.set_random_seed(hvd.rank())
    model = keras.Sequential([keras.layers.Dense(4), keras.layers.Dense(OUTPUTS)])
    # A metric, whose variables exist before the layers' do.
    model.compile(
        optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)), loss="mse", metrics=["mae"]
    )
    model.fit(
        x,
        y,
        batch_size=BATCH,
        shuffle=False,
        verbose=0,
        callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)],
    )
    save(out, "lazy", {}, model.get_weights())


def local_variables(out: Path) -> None:
    """Local variables: the second layer is each worker's own (Horovod's PartialDistributedOptimizer
    and BroadcastGlobalVariablesCallback(local_variables=...)); every rank starts elsewhere."""
    import tf_adasum.keras as hvd

    hvd.init()
    x, y = shard(hvd.rank())
    for op in ("Average", "Adasum"):
        keras.utils.set_random_seed(hvd.rank())
        model = keras.Sequential(
            [keras.Input((FEATURES,)), keras.layers.Dense(4), keras.layers.Dense(OUTPUTS)]
        )
        local = model.layers[1]
        optimizer = hvd.PartialDistributedOptimizer(
            keras.optimizers.SGD(0.05), op=getattr(hvd, op), local_layers=local
        )
        model.compile(optimizer=optimizer, loss="mse")
        broadcast = hvd.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=local.variables)
        model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[broadcast])
        save(out, f"local_{op}", {}, model.get_weights())


def sparse(out: Path) -> None:
    """sparse_as_dense: an Embedding's IndexedSlices gradients, averaged over processes, are the gradient
    of the whole global batch, so the model steps as one plain model on every rank's rows at once."""
    import tf_adasum.keras as hvd

    hvd.init()

    def embedding_model() -> keras.Model:
        keras.utils.set_random_seed(7)  # the same weights on every rank
        return keras.Sequential(
            [keras.Input((5,), dtype="int32"), keras.layers.Embedding(50, 4), keras.layers.Flatten(),
             keras.layers.Dense(OUTPUTS)]
        )  # fmt: skip

    ids = [np.random.default_rng(3000 + r).integers(0, 50, (BATCH, 5)) for r in range(hvd.size())]
    targets = [np.random.default_rng(4000 + r).standard_normal((BATCH, OUTPUTS)) for r in range(hvd.size())]
    model, reference = embedding_model(), embedding_model()
    # SGD: linear in the gradient, so a sparse step equals a dense one (RMSprop squares each slice of a
    # repeated row before summing them, in Keras itself, and would not).
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(0.5), sparse_as_dense=True)
    model.compile(optimizer=optimizer, loss="mse")
    reference.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
    start = model.get_weights()[0]
    for _ in range(3):
        model.train_on_batch(ids[hvd.rank()], targets[hvd.rank()].astype(np.float32))
        reference.train_on_batch(np.concatenate(ids), np.concatenate(targets).astype(np.float32))
    moved = float(np.max(np.abs(model.get_weights()[0] - start)))
    save(out, "sparse", {"moved": moved}, model.get_weights() + reference.get_weights())


def resume_on_rank_0(out: Path) -> None:
    """Horovod's resume, under op Average and Adasum: rank 0 loads the checkpoint it wrote, the others
    build new models, and BroadcastGlobalVariablesCallback gives them its weights and optimizer state.
    Saved: the run that went on (one epoch, then another), and the runs resumed after the first epoch from
    rank 0's file (`rank0`), from rank 0's file on every rank (`all`), and from each rank's own file
    (`own`, Adasum only)."""
    import tf_adasum.keras as hvd

    hvd.init()
    for op in ("Average", "Adasum"):
        resume_under(out, op)


def resume_under(out: Path, op: str) -> None:
    import tf_adasum.keras as hvd

    x, y = shard(hvd.rank())

    def fit(model: keras.Model, epoch: int, checkpoints: list[str]) -> keras.Model:
        callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0)]
        callbacks += [keras.callbacks.ModelCheckpoint(path) for path in checkpoints]
        model.fit(
            x, y, batch_size=BATCH, epochs=epoch + 1, initial_epoch=epoch, shuffle=False, verbose=0,
            callbacks=callbacks,
        )  # fmt: skip
        return model

    def state(model: keras.Model) -> list[np.ndarray]:
        return [np.asarray(v) for v in model.get_weights() + model.optimizer.variables]

    def new_model() -> keras.Model:  # every rank starts elsewhere: the callback must broadcast
        return linear_model(hvd.rank(), hvd.DistributedOptimizer(make_optimizer("adam"), op=getattr(hvd, op)))

    first, own = str(out / f"resume_{op}.keras"), str(out / f"resume_{op}_{hvd.rank()}.keras")
    model = fit(new_model(), 0, [first, own] if hvd.rank() == 0 else [own])
    save(out, f"went_on_{op}", {}, state(fit(model, 1, [])))
    loads = {"rank0": hvd.rank() == 0, "all": True}
    if op == "Adasum":
        loads["own"] = True
    for how, loads_file in loads.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = hvd.load_model(own if how == "own" else first) if loads_file else new_model()
            model = fit(model, 1, [])
        warned = [str(w.message) for w in caught if "resumes from rank 0's checkpoint" in str(w.message)]
        info = {"class": type(model.optimizer).__name__, "warned": warned}
        save(out, f"resumed_{how}_{op}", info, state(model))


def outcome(fn: Any) -> dict[str, Any]:
    """What fn raised (type and message) and how long it took."""
    start = time.monotonic()
    try:
        fn()
        error, message = "none", ""
    except Exception as caught:  # the test asserts the exact type
        error, message = type(caught).__name__, str(caught)
    return {"error": error, "message": message, "seconds": time.monotonic() - start}


def nan(out: Path) -> None:
    """A NaN in rank 1's third batch: its update goes NaN at step 3, and every rank raises."""
    rank = tf_adasum.init().rank
    x, y = shard(rank)
    if rank == 1:
        x = x.copy()
        x[2 * BATCH + 1, 0] = np.nan
    model = linear_model(rank, make_optimizer("sgd_momentum"))
    seen = outcome(
        lambda: model.fit(
            x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[tf_adasum.AdasumCallback()]
        )
    )
    save(out, "nan", seen)


def uneven_known(out: Path) -> None:
    """Known length: rank 1 has one batch fewer; every rank refuses before the first step."""
    rank = tf_adasum.init().rank
    x, y = shard(rank)
    rows = ROWS_PER_RANK - BATCH if rank == 1 else ROWS_PER_RANK
    model = linear_model(rank, make_optimizer("sgd_momentum"))
    seen = outcome(
        lambda: model.fit(
            x[:rows], y[:rows], batch_size=BATCH, verbose=0, callbacks=[tf_adasum.AdasumCallback()]
        )
    )
    save(out, "uneven_known", seen)


def uneven_unknown(out: Path, name: str = "uneven_unknown") -> None:
    """Unknown length (a generator): rank 1 runs out after 2 batches, the others have 4."""
    rank = tf_adasum.init().rank
    x, y = shard(rank)
    rows = ROWS_PER_RANK - BATCH if rank == 1 else ROWS_PER_RANK

    def batches() -> Any:
        for i in range(rows // BATCH if rank != 1 else 2):
            yield x[i * BATCH : (i + 1) * BATCH], y[i * BATCH : (i + 1) * BATCH]

    spec = (tf.TensorSpec([None, FEATURES], tf.float32), tf.TensorSpec([None, OUTPUTS], tf.float32))
    data = tf.data.Dataset.from_generator(batches, output_signature=spec)
    model = linear_model(rank, make_optimizer("sgd_momentum"))
    seen = outcome(lambda: model.fit(data, epochs=2, verbose=0, callbacks=[tf_adasum.AdasumCallback()]))
    save(out, name, seen)


def uneven_buckets(out: Path) -> None:
    """uneven_unknown with the sync in buckets, one per variable: the bias's sync goes first, and the
    rank at its epoch end must meet the others there, not at the kernel's."""
    os.environ["TF_ADASUM_BUCKET_MB"] = "1e-6"  # 1 byte; read when the train step is traced
    try:
        uneven_unknown(out, "uneven_buckets")
    finally:
        del os.environ["TF_ADASUM_BUCKET_MB"]


class DieAt(keras.callbacks.Callback):
    """At the start of a batch, kills this process without a word, as a crash would, or hangs it."""

    def __init__(self, epoch: int, batch: int, hang: bool = False) -> None:
        super().__init__()
        self.epoch, self.batch, self.current, self.hang = epoch, batch, -1, hang

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self.current = epoch

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        if (self.current, batch) == (self.epoch, self.batch):
            if self.hang:  # alive, but never comes to the sync: the others must not wait forever
                time.sleep(float(os.environ["TF_ADASUM_TIMEOUT_SECONDS"]) + 30)
            os.kill(os.getpid(), 9)


class Record(keras.callbacks.Callback):
    """Writes the weights and the step count each time a batch ends, and at train begin."""

    def __init__(self, out: Path, name: str) -> None:
        super().__init__()
        self.out, self.name = out, name

    def _write(self, label: str) -> None:
        optimizer = self.model.optimizer
        state = [v.numpy() for v in optimizer.variables if "momentum" in v.path]
        info = {"iterations": int(optimizer.iterations.numpy()), "weights": len(self.model.get_weights())}
        save(self.out, f"{self.name}_{label}_", info, self.model.get_weights() + state)

    def on_train_begin(self, logs: Any = None) -> None:
        self._write("begin")

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self._write(f"batch{int(self.model.optimizer.iterations.numpy())}")


def killed_or_resumed(out: Path, name: str, resume: bool, hang: bool = False) -> None:
    rank = tf_adasum.init().rank
    x, y = shard(rank)
    model = linear_model(rank, make_optimizer("sgd_momentum"))
    backup = keras.callbacks.BackupAndRestore(str(out / f"backup{rank}"), save_freq=2)
    callbacks: list[Any] = [tf_adasum.AdasumCallback(), backup, Record(out, "resume" if resume else name)]
    if not resume and rank == 1:
        callbacks.append(DieAt(epoch=1, batch=1, hang=hang))  # after 5 steps: the backup holds step 4
    result = outcome(
        lambda: model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=callbacks)
    )
    save(out, "resumed" if resume else name, result, model.get_weights())
    sys.stdout.flush()
    if result["error"] != "none":
        os._exit(3)  # the job failed; do not wait in MPI_Finalize for the rank that died


def killed(out: Path) -> None:
    killed_or_resumed(out, "killed", resume=False)


def hung(out: Path) -> None:
    killed_or_resumed(out, "hung", resume=False, hang=True)


def resume_from_backup(out: Path) -> None:
    killed_or_resumed(out, "resumed", resume=True)


MODES = {
    "callback": callback,
    "mixed_precision": mixed_precision,
    "orthogonality": orthogonality,
    "example": example,
    "average": average,
    "accumulate": accumulate,
    "lazy": lazy,
    "local_variables": local_variables,
    "sparse": sparse,
    "resume_on_rank_0": resume_on_rank_0,
    "nan": nan,
    "uneven_known": uneven_known,
    "uneven_unknown": uneven_unknown,
    "uneven_buckets": uneven_buckets,
    "killed": killed,
    "hung": hung,
    "resume_from_backup": resume_from_backup,
}

if __name__ == "__main__":
    main(MODES)
