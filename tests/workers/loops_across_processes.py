"""The worker of tests/test_loops_across_processes.py: custom training loops across processes, under
mpirun, `python -m tf_adasum.run` or horovodrun:
`python -m tests.workers.loops_across_processes OUT MODE[,MODE...]` (tests/workers/dispatch.py); every
process writes what it saw into OUT.

Modes:
    tutorial       TensorFlow's tutorial loop under AdasumStrategy (strategy.run, compute_average_loss,
                   strategy.reduce), on the linear problem, SGD with momentum and Adam
    tape           Horovod's TF2 loop: DistributedGradientTape (Average, and Adasum of the gradients) and
                   the first-batch broadcast; and the paper's form, AdasumOptimizer.apply_gradients
    examples       examples/tensorflow2_gradient_tape.py (every --op) and examples/custom_training_loop.py
    engine         which engine the launcher started: its name, size, workers, horovodrun's rendezvous
    ordering       20 fresh steps that all-reduce the gradients, step, and broadcast model and optimizer
                   variables in one tf.function, and 20 fresh functions of all-reduces and broadcasts with
                   no data between them: the collectives must run in program order on every rank
    reducescatter  Horovod's reducescatter, Sum eagerly and Average compiled
    groups         Horovod's `groups` and $TF_ADASUM_BUCKET_MB on an MLP's tape loop (Adasum of the
                   gradients, Average) and DistributedOptimizer(op=Average, groups=...); and, in the traced
                   gradient, which local gradients each group's result waits for
    mismatch       rank 0 all-reduces then broadcasts, the others the reverse: every rank must raise; and,
                   under MPI, a compiled tf.cond on the rank that parts them only when it runs
"""

from __future__ import annotations

import os
import runpy
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import keras
import numpy as np
import tensorflow as tf

import tf_adasum  # under tf_adasum.run and horovodrun this starts the TF engine
import tf_adasum.keras
import tf_adasum.tensorflow as hvd
from tests.workers.data import BATCH, FEATURES, OUTPUTS, REPETITIONS, ROWS_PER_RANK, initial_weights, shard
from tests.workers.dispatch import main
from tests.workers.existing_scripts import make_optimizer, save
from tf_adasum.distributed import allreduce_replicas

ROOT = Path(__file__).resolve().parents[2]
tf.get_logger().setLevel("ERROR")  # the loops make fresh tf.functions on purpose: no retracing warnings


def linear(weights: list[np.ndarray]) -> keras.Model:
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(OUTPUTS)])
    model.set_weights(weights)
    return model


def tutorial(out: Path) -> None:
    from tests.support.custom_loops import dataset, tutorial_model, tutorial_steps

    tf_adasum.init()
    for kind in ("sgd_momentum", "adam"):
        strategy = tf_adasum.AdasumStrategy()
        global_batch = 4 * strategy.num_replicas_in_sync  # the tutorial's rule: every replica of the job
        model, optimizer = tutorial_model(strategy, kind)
        train_step = tutorial_steps(strategy, model, optimizer, global_batch)

        @tf.function
        def distributed_train_step(
            inputs: Any, strategy: Any = strategy, train_step: Any = train_step
        ) -> Any:
            per_replica_losses = strategy.run(train_step, args=(inputs,))
            return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica_losses, axis=None)

        losses = [
            float(distributed_train_step(x))
            for x in strategy.experimental_distribute_dataset(dataset(global_batch))
        ]
        info = {
            "replicas": strategy.num_replicas_in_sync,
            "losses": losses,
            "steps": int(optimizer.iterations.numpy()),
        }
        save(out, f"tutorial_{kind}_", info, model.get_weights())


def tape(out: Path) -> None:
    tf_adasum.init()
    x, y = shard(tf_adasum.rank())
    batches = [
        (x[s * BATCH : (s + 1) * BATCH], y[s * BATCH : (s + 1) * BATCH])
        for s in range(ROWS_PER_RANK // BATCH)
    ]
    for op in ("average", "adasum_gradients", "adasum_after", "adasum_after_unbuilt"):
        model = linear(initial_weights(tf_adasum.rank()))  # every rank elsewhere: the broadcast must fix it
        if op == "adasum_after_unbuilt":  # first called inside the step: its weights are made there
            w, b = initial_weights(tf_adasum.rank())
            dense = keras.layers.Dense(
                OUTPUTS,
                kernel_initializer=keras.initializers.Constant(w),
                bias_initializer=keras.initializers.Constant(b),
            )
            model = keras.Sequential([dense])
        if op.startswith("adasum_after"):  # the paper's Adasum after the optimizer, in a tape loop
            opt = tf_adasum.AdasumOptimizer(make_optimizer("sgd_momentum"))
        else:
            opt = make_optimizer("sgd_momentum")

        @tf.function
        def training_step(
            xb: tf.Tensor, yb: tf.Tensor, first_batch: bool, model: Any = model, opt: Any = opt, op: str = op
        ) -> tf.Tensor:
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((model(xb) - yb) ** 2)
            if not op.startswith("adasum_after"):
                tape = hvd.DistributedGradientTape(tape, op=hvd.Average if op == "average" else hvd.Adasum)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
            if first_batch and not op.startswith("adasum_after"):
                hvd.broadcast_variables(model.variables, root_rank=0)
                hvd.broadcast_variables(opt.variables, root_rank=0)
            return loss

        for step, (xb, yb) in enumerate(batches):
            training_step(xb, yb, step == 0)
        save(out, f"tape_{op}_", {"iterations": int(opt.iterations.numpy())}, model.get_weights())


def examples(out: Path) -> None:
    tf_adasum.init()
    for script, flags in (
        ("tensorflow2_gradient_tape.py", ["--op", "adasum"]),
        ("tensorflow2_gradient_tape.py", ["--op", "average"]),
        ("tensorflow2_gradient_tape.py", ["--op", "adasum-gradients"]),
        ("custom_training_loop.py", []),
    ):
        name = f"{Path(script).stem}_{flags[1] if flags else 'strategy'}"
        sys.argv = [script, "--epochs", "2", "--save", str(out / name), *flags]
        started = time.monotonic()
        runpy.run_path(str(ROOT / "examples" / script), run_name="__main__")
        save(out, f"example_{name}_", {"seconds": time.monotonic() - started})


def engine(out: Path) -> None:
    comm = tf_adasum.init()
    info = {
        "engine": comm.engine,
        "size": comm.size,
        "rendezvous": os.environ.get("HOROVOD_GLOO_RENDEZVOUS_ADDR"),
        "workers": getattr(comm, "workers", None),
    }
    save(out, "engine", info)


def ordering(out: Path) -> None:
    """The step of issue 19: all-reduced gradients, an optimizer step, and on the first batch a broadcast of
    the model's and the optimizer's variables, in one tf.function. Each repetition is a fresh function
    with fresh variables, so each traces and runs that first step anew; then collectives with no data
    between them. REPETITIONS of each."""
    tf_adasum.init()
    x, y = shard(tf_adasum.rank())
    digests = []
    for repetition in range(REPETITIONS):
        model = linear(initial_weights(tf_adasum.rank() + 10 * repetition))
        opt = keras.optimizers.Adam(0.01)

        @tf.function
        def step(xb: tf.Tensor, yb: tf.Tensor, first: bool, model: Any = model, opt: Any = opt) -> tf.Tensor:
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((model(xb) - yb) ** 2)
            grads = tape.gradient(loss, model.trainable_variables)
            grads = tf_adasum.allreduce(grads, op=tf_adasum.Average)
            opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
            if first:
                tf_adasum.keras.broadcast_variables(model.variables + list(opt.variables), root_rank=0)
            return loss

        for s in range(3):
            step(x[s * BATCH : (s + 1) * BATCH], y[s * BATCH : (s + 1) * BATCH], s == 0)
        digests.append([float(np.sum(w, dtype=np.float64)) for w in model.get_weights()])

    # Collectives with no data between them: only the engine's ordering keeps them in program order.
    for repetition in range(REPETITIONS):

        @tf.function
        def independent(a: tf.Tensor, b: tf.Tensor) -> list[tf.Tensor]:
            return [
                tf_adasum.allreduce(a, op=tf_adasum.Sum),
                tf_adasum.broadcast(b, root=0),
                tf_adasum.allreduce(a * 2, op=tf_adasum.Average),
                tf_adasum.broadcast(b + 1, root=0),
            ]

        a = tf.fill([3], float(repetition))
        results = independent(a, tf.fill([5], float(tf_adasum.rank())))
        digests.append([float(np.sum(r.numpy(), dtype=np.float64)) for r in results])
    save(out, "ordering", {"digests": digests})


def reducescatter(out: Path) -> None:
    """Horovod's reducescatter: rows 0..4 of the sum over ranks, split with the extra rows on lower ranks."""
    tf_adasum.init()
    rows = tf.reshape(tf.range(10, dtype=tf.float32), [5, 2]) * float(tf_adasum.rank() + 1)
    scattered = {
        "eager": tf_adasum.keras.reducescatter(rows, op=tf_adasum.keras.Sum).numpy().tolist(),
        "compiled": tf.function(lambda r: tf_adasum.keras.reducescatter(r, op=tf_adasum.keras.Average))(rows)
        .numpy()
        .tolist(),
    }
    save(out, "reducescatter", scattered)


def mlp(seed: int) -> keras.Model:
    rng = np.random.default_rng(seed)
    model = keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(6, activation="tanh"),
            keras.layers.Dense(5),
            keras.layers.Dense(OUTPUTS),
        ]
    )
    model.set_weights([rng.standard_normal(w.shape).astype(np.float32) for w in model.get_weights()])
    return model


class RecordingTape:
    """A tape for DistributedGradientTape that keeps the local gradients it hands over."""

    def __init__(self, tape: tf.GradientTape) -> None:
        self.tape = tape
        self.local: list[Any] = []
        self.reduced: list[Any] = []

    def gradient(self, *args: Any) -> Any:
        self.local = self.tape.gradient(*args)
        return self.local


def ancestors(tensor: tf.Tensor) -> set[str]:
    seen, todo = set(), [tensor.op]
    while todo:
        op = todo.pop()
        if op.name not in seen:
            seen.add(op.name)
            todo += [t.op for t in op.inputs] + list(op.control_inputs)
    return seen


def groups(out: Path) -> None:
    """Each way of grouping trains the MLP 4 steps from the same weights; the traced check follows."""
    tf_adasum.init()
    x, y = shard(tf_adasum.rank())
    ways: list[tuple[str, Any, str]] = [
        ("one", None, "0"),
        ("two", 2, "0"),
        ("each", 99, "0"),
        ("bucket", None, "0.0001"),
    ]
    for op in ("adasum", "average", "optimizer"):
        for name, how, bucket in [*ways, ("listed", "listed", "0")]:
            os.environ["TF_ADASUM_BUCKET_MB"] = bucket
            model = mlp(tf_adasum.rank())
            variables = model.trainable_variables
            chosen = [[variables[0], variables[5]], [variables[2]]] if how == "listed" else how
            if op == "optimizer":
                opt = tf_adasum.keras.DistributedOptimizer(make_optimizer("sgd_momentum"), groups=chosen)
            else:
                opt = make_optimizer("sgd_momentum")

            @tf.function
            def step(
                xb: tf.Tensor,
                yb: tf.Tensor,
                model: Any = model,
                opt: Any = opt,
                op: str = op,
                chosen: Any = chosen,
            ) -> None:
                with tf.GradientTape() as tape:
                    loss = tf.reduce_mean((model(xb) - yb) ** 2)
                if op != "optimizer":
                    reduce = hvd.Adasum if op == "adasum" else hvd.Average
                    tape = hvd.DistributedGradientTape(tape, op=reduce, groups=chosen)
                grads = tape.gradient(loss, model.trainable_variables)
                opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))

            hvd.broadcast_variables(model.variables, root_rank=0)
            for s in range(ROWS_PER_RANK // BATCH):
                step(x[s * BATCH : (s + 1) * BATCH], y[s * BATCH : (s + 1) * BATCH])
            save(out, f"groups_{op}_{name}_", {}, model.get_weights())
    # Traced: which local gradients the last bias's result (the first group out) waits for.
    waits = {}
    for name, how, bucket in ways:
        os.environ["TF_ADASUM_BUCKET_MB"] = bucket
        model = mlp(0)
        recording = RecordingTape(tf.GradientTape())

        @tf.function
        def reduced(
            xb: tf.Tensor, yb: tf.Tensor, model: Any = model, how: Any = how, recording: Any = recording
        ) -> Any:
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((model(xb) - yb) ** 2)
            recording.tape = tape
            recording.reduced = hvd.DistributedGradientTape(recording, op=hvd.Adasum, groups=how).gradient(
                loss, model.trainable_variables
            )
            return recording.reduced

        reduced.get_concrete_function(tf.constant(x[:BATCH]), tf.constant(y[:BATCH]))
        # From the result inside the function: its outputs wait for every collective (tf.function runs
        # every stateful op before it returns), which says nothing of when each group's starts.
        last = ancestors(recording.reduced[-1])
        waits[name] = [g.op.name in last for g in recording.local]
    os.environ.pop("TF_ADASUM_BUCKET_MB")
    save(out, "groups_traced_", {"waits": waits})
    delta_buckets(out)


def delta_buckets(out: Path) -> None:
    """Adasum after the optimizer (AdasumOptimizer) in one sync and in buckets of deltas: the same bits,
    and in the traced step the first bucket's sync waits only for its own variables' gradients."""
    waits, syncs = {}, {}
    for name, bucket in (("one", "0"), ("bucket", "1e-6")):  # 1 byte: one bucket per variable
        os.environ["TF_ADASUM_BUCKET_MB"] = bucket
        model = mlp(tf_adasum.rank())
        opt = tf_adasum.AdasumOptimizer(make_optimizer("sgd_momentum"))
        recording = RecordingTape(tf.GradientTape())
        synced: list[Any] = []

        def recorded(*args: Any, synced: list[Any] = synced, **kwargs: Any) -> Any:
            synced.append(allreduce_replicas(*args, **kwargs))
            return synced[-1]

        @tf.function
        def step(
            xb: tf.Tensor, yb: tf.Tensor, model: Any = model, opt: Any = opt, recording: Any = recording
        ) -> None:
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((model(xb) - yb) ** 2)
            recording.tape = tape
            grads = recording.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))

        hvd.broadcast_variables(model.variables, root_rank=0)
        x, y = shard(tf_adasum.rank())
        tf_adasum.distributed.allreduce_replicas = recorded
        try:
            for s in range(ROWS_PER_RANK // BATCH):
                step(x[s * BATCH : (s + 1) * BATCH], y[s * BATCH : (s + 1) * BATCH])
        finally:
            tf_adasum.distributed.allreduce_replicas = allreduce_replicas
        save(out, f"delta_buckets_{name}_", {}, model.get_weights())
        # The first sync traced (the last bias's bucket under buckets): which local gradients it waits for.
        first = ancestors(synced[0][0])
        waits[name] = [g.op.name in first for g in recording.local]
        syncs[name] = len(synced)  # over every trace of the step (Keras may trace it twice)
    os.environ.pop("TF_ADASUM_BUCKET_MB")
    save(out, "delta_buckets_traced_", {"waits": waits, "syncs": syncs})


def mismatch(out: Path) -> None:
    rank = tf_adasum.init().rank
    seen = {}
    for how in ("eager", "compiled"):

        def both(a: tf.Tensor, b: tf.Tensor) -> None:
            if rank == 0:
                tf_adasum.allreduce(a, op=tf_adasum.Sum)
                tf_adasum.broadcast(b, root=0)
            else:
                tf_adasum.broadcast(b, root=0)
                tf_adasum.allreduce(a, op=tf_adasum.Sum)

        run = both if how == "eager" else tf.function(both)
        started = time.monotonic()
        try:
            run(tf.ones([4]), tf.ones([16]))
            seen[how] = {"error": "none", "message": "", "seconds": time.monotonic() - started}
        except Exception as error:  # the test reads which error every rank got
            seen[how] = {
                "error": type(error).__name__,
                "message": str(error),
                "seconds": time.monotonic() - started,
            }
    if tf_adasum.init().engine == "mpi":
        # Ranks that part only when the step runs: both branches trace alike everywhere, so the check at
        # trace time passes, and the announcement before each collective is what stops them.
        @tf.function
        def branch(a: tf.Tensor) -> tf.Tensor:
            return tf.cond(
                tf.equal(tf_adasum.rank(), 0),
                lambda: tf_adasum.allreduce(a, op=tf_adasum.Sum),
                lambda: tf_adasum.broadcast(a, root=0),
            )

        started = time.monotonic()
        try:
            branch(tf.ones([4]))
            seen["branch"] = {"error": "none", "message": "", "seconds": time.monotonic() - started}
        except tf.errors.OpError as error:
            seen["branch"] = {
                "error": type(error).__name__,
                "message": error.message,
                "seconds": time.monotonic() - started,
            }
    save(out, "mismatch", seen)


MODES = {
    "tutorial": tutorial,
    "tape": tape,
    "examples": examples,
    "engine": engine,
    "ordering": ordering,
    "reducescatter": reducescatter,
    "groups": groups,
    "mismatch": mismatch,
}

if __name__ == "__main__":
    main(MODES)
