"""Step time of model.fit under AdasumStrategy against MirroredStrategy, same model, same replicas.

Usage:
    python benchmarks/training/bench_fit.py [--replicas 2 4] [--steps 40]        # local logical CPUs
    python benchmarks/training/bench_fit.py --sync-every 1 2                     # local, each sync_every
    python -m tf_adasum.run -np 2 benchmarks/training/bench_fit.py --processes   # 2 processes, TF engine
    python -m tf_adasum.run -np 2 benchmarks/training/bench_fit.py --processes --sync-every 1 1000
                                                        # also the step with no sync in it: the
                                                        # sync's share of the step, by difference
    python -m tf_adasum.run -np 2 benchmarks/training/bench_fit.py --processes --devices-per-process 2
                                                        # 2 x 2: local_reduction adasum and mean
    mpirun -np 2 python benchmarks/training/bench_fit.py --scripts              # existing-script entry points
    python -m tf_adasum.run -np 2 benchmarks/training/bench_fit.py --scripts
    python benchmarks/training/bench_fit.py --loops [--replicas 2]               # custom training loops
    mpirun -np 2 python benchmarks/training/bench_fit.py --loops --processes
    python -m tf_adasum.run -np 2 benchmarks/training/bench_fit.py --processes --buckets 0 4 16
                                                        # gradient buckets in a tape loop
    python -m tf_adasum.run -np 2 benchmarks/training/bench_fit.py --processes --buckets 0 4 \
        --bucket-loop fit                               # delta buckets in model.fit's step

With --processes, each process holds one replica (or --devices-per-process): AdasumStrategy's fit
step; under the TF engine also MultiWorkerMirroredStrategy's step, the baseline, as a custom loop (its
fit is broken upstream), and the same custom loop under AdasumStrategy, so that the row tells what fit
costs beyond a loop (ratio against loop_ratio) from what the sync costs beyond the sum (loop_ratio).
Each is measured in --rounds alternating rounds; a row gives the rounds' mean.

With --loops, the same model's step as a custom training loop: locally, TensorFlow's tutorial loop
(strategy.run, a plain optimizer's apply_gradients) under AdasumStrategy against model.fit under it
(loop_vs_fit) and against the same loop under MirroredStrategy (loop_vs_mirrored_loop); across
processes, Horovod's TF2 loop on tf_adasum.tensorflow (a GradientTape, one tf.function per step) with
Adasum after the optimizer (AdasumOptimizer.apply_gradients) and with DistributedGradientTape's
gradient average, against model.fit with AdasumCallback (tape_adasum_vs_fit) and against the tape
average (tape_adasum_vs_average).

With --buckets MB..., across processes, Horovod's TF2 loop with DistributedGradientTape(op=Adasum) (Adasum
of the gradients before the optimizer, as Horovod's op=Adasum) with $TF_ADASUM_BUCKET_MB at each value:
0 is one fused call after the whole backward pass, the baseline; each other value cuts the gradients
into buckets of that size from the last layer back, each all-reduced as soon as its gradients exist
while the backward pass goes on. The sizes are measured in alternating rounds (--rounds); each row
gives the mean of the rounds' medians and its ratio to one call. With --bucket-loop fit, the same for
model.fit's step under AdasumStrategy: Adasum of the optimizer's deltas, whose buckets each wait
for their own variables' updates only.

With --scripts, every process runs a plain Keras fit (one replica per process, no strategy) three ways
in the same run: alone, with no communication at all (the single-process baseline); with
tf_adasum.AdasumCallback(); and with tf_adasum.keras.DistributedOptimizer(op=Average), the gradient
average that Horovod scripts use; and a fourth, that average with Horovod's gradient accumulation
(backward_passes_per_step=4: one all-reduce every 4 passes; the median of 4-pass means, so that each
holds its all-reduce). It prints each median, the callback's ratio to the first and third, and the
accumulation's to the average and to the plain fit.

Prints JSON lines with the median step time (ms) of each strategy, measured by a callback over the
steps after warm-up, and their ratio adasum/baseline. Models: an MLP (784-512-512-10), a small CNN
(28x28x1, two conv layers) and a ResNet-like network of 2.8M parameters (16x16x3, three stages of
two residual blocks, batch norm). Locally the baseline is MirroredStrategy over the same logical CPUs.
Across processes it is MultiWorkerMirroredStrategy; Keras 3's fit under it is broken upstream
(keras-team/keras#20585), so here, and only here, its step is a custom strategy.run loop doing what
fit does (forward, loss, gradients all-reduced, optimizer update).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np


def resnet() -> Any:
    """ResNet-like, 2.8M parameters: a 64-wide stem, then stages of 64, 128 and 256 channels with two
    basic residual blocks each (3x3 convolutions, batch norm), on 16x16x3 images."""
    import keras

    inputs = keras.Input((16, 16, 3))
    h = keras.layers.ReLU()(
        keras.layers.BatchNormalization()(keras.layers.Conv2D(64, 3, padding="same")(inputs))
    )
    for stage, width in enumerate((64, 128, 256)):
        for block in range(2):
            stride = 2 if stage and not block else 1
            shortcut = h
            if stride != 1 or h.shape[-1] != width:
                shortcut = keras.layers.Conv2D(width, 1, strides=stride)(h)
            y = keras.layers.Conv2D(width, 3, strides=stride, padding="same")(h)
            y = keras.layers.ReLU()(keras.layers.BatchNormalization()(y))
            y = keras.layers.BatchNormalization()(keras.layers.Conv2D(width, 3, padding="same")(y))
            h = keras.layers.ReLU()(y + shortcut)
    outputs = keras.layers.Dense(10)(keras.layers.GlobalAveragePooling2D()(h))
    return keras.Model(inputs, outputs)


def make_model(kind: str) -> Any:
    import keras

    if kind == "resnet":
        return resnet()
    if kind == "mlp":
        layers = [
            keras.Input((784,)),
            keras.layers.Dense(512, activation="relu"),
            keras.layers.Dense(512, activation="relu"),
        ]
    else:
        layers = [
            keras.Input((28, 28, 1)),
            keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(64, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
        ]
    return keras.Sequential([*layers, keras.layers.Dense(10)])


def data(kind: str, n: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    shape = {"mlp": (n, 784), "cnn": (n, 28, 28, 1), "resnet": (n, 16, 16, 3)}[kind]
    return rng.standard_normal(shape).astype(np.float32), rng.integers(0, 10, n).astype(np.int32)


def fit_step_ms(
    strategy: Any,
    kind: str,
    global_batch: int,
    steps: int,
    warmup: int = 5,
    wrap: Any = None,
    callbacks: list[Any] | None = None,
    memory: dict[str, float] | None = None,
    cycle: int = 1,
) -> float:
    """The median step time (ms); with `memory`, also the optimizer's state in MB, every replica's.

    With `cycle` > 1, the median over consecutive runs of `cycle` steps of their mean step time: each
    run holds one all-reduce of gradient accumulation (backward_passes_per_step=cycle), which a plain
    median over steps would leave out."""
    import keras

    x, y = data(kind, global_batch * (steps + warmup))
    with strategy.scope():
        model = make_model(kind)
        optimizer = keras.optimizers.SGD(0.01, momentum=0.9)
        model.compile(
            optimizer=wrap(optimizer) if wrap else optimizer,
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    times: list[float] = []

    class Timer(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            self.start = time.perf_counter()

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            if batch >= warmup:
                times.append(time.perf_counter() - self.start)

    model.fit(
        x,
        y,
        batch_size=global_batch,
        epochs=1,
        shuffle=False,
        verbose=0,
        callbacks=[*(callbacks or []), Timer()],
    )
    if memory is not None:
        components = [c for v in model.optimizer.variables for c in getattr(v.value, "values", (v.value,))]
        memory["optimizer_mb"] = sum(c.shape.num_elements() * c.dtype.size for c in components) / 1e6
    runs = [statistics.mean(times[i : i + cycle]) for i in range(0, len(times) - cycle + 1, cycle)]
    return 1e3 * statistics.median(runs)


def scripts(kind: str, local_batch: int, steps: int) -> None:
    """One process per worker, no strategy: alone, with AdasumCallback, and with a gradient average."""
    import tensorflow as tf

    import tf_adasum
    import tf_adasum.keras as hvd

    comm = tf_adasum.init()
    default = tf.distribute.get_strategy()
    alone = fit_step_ms(default, kind, local_batch, steps)  # plain Keras: no collective at all
    callback = fit_step_ms(default, kind, local_batch, steps, callbacks=[tf_adasum.AdasumCallback()])
    average = fit_step_ms(default, kind, local_batch, steps, wrap=lambda o: hvd.DistributedOptimizer(o))
    # Horovod's gradient accumulation: 4 passes summed locally, then one all-reduce and one step.
    accumulated = fit_step_ms(
        default, kind, local_batch, steps,
        wrap=lambda o: hvd.DistributedOptimizer(o, backward_passes_per_step=4), cycle=4,
    )  # fmt: skip
    row = {
        "model": kind,
        "processes": comm.size,
        "engine": comm.engine,
        "plain_ms": round(alone, 2),
        "adasum_callback_ms": round(callback, 2),
        "average_ms": round(average, 2),
        "callback_vs_plain": round(callback / alone, 2),
        "callback_vs_average": round(callback / average, 2),
        "average_k4_ms": round(accumulated, 2),
        "k4_vs_average": round(accumulated / average, 2),
        "k4_vs_plain": round(accumulated / alone, 2),
    }
    if comm.rank == 0:
        print(json.dumps(row), flush=True)


def custom_loop_step_ms(
    strategy: Any, kind: str, global_batch: int, steps: int, warmup: int = 5, build_first: bool = False
) -> float:
    """What fit does per step, written as a strategy.run loop (MultiWorkerMirroredStrategy's baseline,
    and TensorFlow's tutorial loop). build_first builds the optimizer before the loop, which Keras 3
    needs under MirroredStrategy for a stateful optimizer (keras-team/keras#23085)."""
    import keras
    import tensorflow as tf

    x, y = data(kind, global_batch * (steps + warmup))
    dataset = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch)
    )
    with strategy.scope():
        model = make_model(kind)
        optimizer = keras.optimizers.SGD(0.01, momentum=0.9)
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
        if build_first:
            optimizer.build(model.trainable_variables)

    def replica_step(batch: Any) -> Any:
        features, labels = batch
        with tf.GradientTape() as tape:
            per_example = loss_fn(labels, model(features, training=True))
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    @tf.function
    def step(batch: Any) -> Any:
        return strategy.reduce("SUM", strategy.run(replica_step, args=(batch,)), axis=None)

    times = []
    for i, batch in enumerate(dataset):
        start = time.perf_counter()
        step(batch).numpy()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def tape_loop_step_ms(kind: str, local_batch: int, steps: int, how: str, warmup: int = 5) -> float:
    """Horovod's TF2 loop, one process per worker: "adasum" steps AdasumOptimizer(SGD) on this process's
    own gradients (the paper's Adasum after the optimizer); "average" reduces them with
    DistributedGradientTape first, as Horovod's examples do."""
    import keras
    import tensorflow as tf

    import tf_adasum
    import tf_adasum.tensorflow as hvd

    x, y = data(kind, local_batch * (steps + warmup))
    keras.utils.set_random_seed(0)  # the same weights on every process: no broadcast in the timed loop
    model = make_model(kind)
    inner = keras.optimizers.SGD(0.01, momentum=0.9)
    optimizer = tf_adasum.AdasumOptimizer(inner) if how == "adasum" else inner
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def step(features: Any, labels: Any) -> Any:
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(features, training=True))
        if how == "average":
            tape = hvd.DistributedGradientTape(tape)
        elif how == "adasum_gradients":
            tape = hvd.DistributedGradientTape(tape, op=hvd.Adasum)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    times = []
    for i in range(steps + warmup):
        rows = slice(i * local_batch, (i + 1) * local_batch)
        start = time.perf_counter()
        step(x[rows], y[rows]).numpy()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def buckets(kind: str, local_batch: int, steps: int, sizes: list[float], rounds: int, loop: str) -> None:
    """The --buckets rows, one call against buckets: the tape loop's step with Adasum of the gradients
    (loop "tape"), or model.fit's step under AdasumStrategy, with Adasum of the optimizer's deltas
    (loop "fit")."""
    import tf_adasum

    comm = tf_adasum.init()

    def step_ms() -> float:
        if loop == "tape":
            return tape_loop_step_ms(kind, local_batch, steps, "adasum_gradients")
        strategy = tf_adasum.AdasumStrategy(devices=own_cpus(comm, 1))
        return fit_step_ms(strategy, kind, local_batch * comm.size, steps)

    medians: dict[float, list[float]] = {size: [] for size in sizes}
    for _ in range(rounds):
        for size in sizes:
            os.environ["TF_ADASUM_BUCKET_MB"] = str(size)  # read when the step is traced
            medians[size].append(step_ms())
    one = statistics.mean(medians[sizes[0]])
    for size in sizes:
        ms = statistics.mean(medians[size])
        row = {"model": kind, "processes": comm.size, "engine": comm.engine, "loop": loop, "bucket_mb": size}
        row |= {"step_ms": round(ms, 2), "rounds_ms": [round(m, 2) for m in medians[size]]}
        row |= {"vs_first": round(ms / one, 3)}
        if comm.rank == 0:
            print(json.dumps(row), flush=True)


def own_cpus(comm: Any, count: int) -> list[str]:
    """This process's first `count` logical CPUs (the TF engine lists every process's; keep its own)."""
    import tensorflow as tf

    return [
        d.name
        for d in tf.config.list_logical_devices("CPU")
        if "/task:" not in d.name or f"/task:{comm.rank}/" in d.name
    ][:count]


def loops(kind: str, replicas: list[int], local_batch: int, steps: int, processes: bool) -> None:
    """The --loops rows: custom loops against fit, each measured in this run."""
    import tensorflow as tf

    import tf_adasum

    if processes:
        comm = tf_adasum.init()
        default = tf.distribute.get_strategy()
        fit = fit_step_ms(default, kind, local_batch, steps, callbacks=[tf_adasum.AdasumCallback()])
        adasum = tape_loop_step_ms(kind, local_batch, steps, "adasum")
        average = tape_loop_step_ms(kind, local_batch, steps, "average")
        row = {"model": kind, "processes": comm.size, "engine": comm.engine, "fit_callback_ms": round(fit, 2)}
        row |= {"tape_adasum_ms": round(adasum, 2), "tape_average_ms": round(average, 2)}
        row |= {
            "tape_adasum_vs_fit": round(adasum / fit, 2),
            "tape_adasum_vs_average": round(adasum / average, 2),
        }
        if comm.rank == 0:
            print(json.dumps(row), flush=True)
        return
    for p in replicas:
        devices = [d.name for d in tf.config.list_logical_devices("CPU")[:p]]
        global_batch = local_batch * p
        fit = fit_step_ms(tf_adasum.AdasumStrategy(devices), kind, global_batch, steps)
        loop = custom_loop_step_ms(tf_adasum.AdasumStrategy(devices), kind, global_batch, steps)
        mirrored = tf.distribute.MirroredStrategy(
            devices, cross_device_ops=tf.distribute.ReductionToOneDevice()
        )
        mirrored_loop = custom_loop_step_ms(mirrored, kind, global_batch, steps, build_first=True)
        row = {"model": kind, "replicas": p, "adasum_fit_ms": round(fit, 2), "adasum_loop_ms": round(loop, 2)}
        row |= {"mirrored_loop_ms": round(mirrored_loop, 2), "loop_vs_fit": round(loop / fit, 2)}
        row |= {"loop_vs_mirrored_loop": round(loop / mirrored_loop, 2)}
        print(json.dumps(row), flush=True)


def process_steps(comm: Any, kind: str, mine: list[str], global_batch: int, args: Any) -> dict[str, float]:
    """One round of --processes: AdasumStrategy's fit step (per local_reduction where several devices),
    with each other sync_every, and under the TF engine MultiWorkerMirroredStrategy's custom loop (its
    fit is broken upstream, keras-team/keras#20585) and the same custom loop under AdasumStrategy, so
    that fit's own cost per step and the sync's are told apart."""
    import tf_adasum

    steps: dict[str, float] = {}
    per_process = args.devices_per_process
    for mode in ("adasum", "mean") if per_process > 1 else ("adasum",):
        strategy = tf_adasum.AdasumStrategy(devices=mine, local_reduction=mode)
        steps[mode] = fit_step_ms(strategy, kind, global_batch, args.steps)
    for every in (k for k in args.sync_every if k != 1):  # sync_every=k across processes
        strategy = tf_adasum.AdasumStrategy(devices=mine, sync_every=every)
        steps[f"adasum_sync_every_{every}"] = fit_step_ms(strategy, kind, global_batch, args.steps)
    if comm.engine == "tf":
        # MultiWorkerMirroredStrategy holds one CPU device per worker: the same global batch over one
        # replica per process.
        steps["baseline"] = custom_loop_step_ms(comm.strategy, kind, global_batch, args.steps)
        strategy = tf_adasum.AdasumStrategy(devices=mine)
        steps["adasum_loop"] = custom_loop_step_ms(strategy, kind, global_batch, args.steps)
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 4])
    parser.add_argument(
        "--models", nargs="+", default=["mlp", "cnn", "resnet"], choices=["mlp", "cnn", "resnet"]
    )
    parser.add_argument(
        "--sync-every", type=int, nargs="+", default=[1], help="AdasumStrategy(sync_every=...)"
    )
    parser.add_argument("--local-batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--processes", action="store_true", help="run under tf_adasum.run or mpirun")
    parser.add_argument(
        "--devices-per-process", type=int, default=1, help="with --processes: logical CPUs per process"
    )
    parser.add_argument("--scripts", action="store_true", help="AdasumCallback and op=Average, per process")
    parser.add_argument("--loops", action="store_true", help="custom training loops against fit")
    parser.add_argument(
        "--buckets",
        type=float,
        nargs="+",
        help="with --processes: $TF_ADASUM_BUCKET_MB values, the first the baseline",
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="with --buckets or --processes: alternating rounds"
    )
    parser.add_argument(
        "--bucket-loop",
        choices=["tape", "fit"],
        default="tape",
        help="with --buckets: a tape loop's gradients, or model.fit's deltas under AdasumStrategy",
    )
    args = parser.parse_args()

    import tensorflow as tf

    if args.loops:
        if not args.processes:
            tf.config.set_logical_device_configuration(
                tf.config.list_physical_devices("CPU")[0],
                [tf.config.LogicalDeviceConfiguration()] * max(args.replicas),
            )
        import tf_adasum  # under tf_adasum.run this starts the TF engine, before any op

        for kind in args.models:
            loops(kind, args.replicas, args.local_batch, args.steps, args.processes)
        return
    if args.buckets:
        import tf_adasum  # under tf_adasum.run this starts the TF engine, before any op

        for kind in args.models:
            buckets(kind, args.local_batch, args.steps, args.buckets, args.rounds, args.bucket_loop)
        return
    if args.scripts:
        import tf_adasum  # under tf_adasum.run this starts the TF engine, before any op

        for kind in args.models:
            scripts(kind, args.local_batch, args.steps)
        return
    if not args.processes or args.devices_per_process > 1:
        count = max(args.replicas) if not args.processes else args.devices_per_process
        tf.config.set_logical_device_configuration(
            tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * count
        )
    import tf_adasum

    for kind in args.models:
        if args.processes:
            comm = tf_adasum.init()
            per_process = args.devices_per_process
            mine = own_cpus(comm, per_process)
            global_batch = args.local_batch * comm.size * per_process
            row = {
                "model": kind,
                "processes": comm.size,
                "devices_per_process": per_process,
                "engine": comm.engine,
            }
            # Each step measured in every round, the rounds one after another (alternating, so that a
            # slow spell of this shared machine falls on all of them); a row holds the rounds' mean.
            rounds: dict[str, list[float]] = {}
            for _ in range(args.rounds):
                for name, step in process_steps(comm, kind, mine, global_batch, args).items():
                    rounds.setdefault(name, []).append(step)
            row |= {f"{name}_ms": round(statistics.mean(steps), 2) for name, steps in rounds.items()}
            if args.rounds > 1:
                row |= {f"{name}_rounds_ms": [round(s, 2) for s in steps] for name, steps in rounds.items()}
            if "baseline" in rounds:
                baseline = row.pop("baseline_ms")
                row |= {
                    "baseline": "MultiWorkerMirroredStrategy (custom loop)",
                    "baseline_ms": baseline,
                    "ratio": round(row["adasum_ms"] / baseline, 2),
                    "loop_ratio": round(row["adasum_loop_ms"] / baseline, 2),
                }
                if per_process > 1:
                    row["mean_ratio"] = round(row["mean_ms"] / baseline, 2)
            if comm.rank == 0:
                print(json.dumps(row), flush=True)
            continue
        for replicas in args.replicas:
            devices = [d.name for d in tf.config.list_logical_devices("CPU")[:replicas]]
            global_batch = args.local_batch * replicas
            mirrored = tf.distribute.MirroredStrategy(
                devices, cross_device_ops=tf.distribute.ReductionToOneDevice()
            )
            baseline = fit_step_ms(mirrored, kind, global_batch, args.steps)
            for every in args.sync_every:
                memory: dict[str, float] = {}
                adasum = fit_step_ms(
                    tf_adasum.AdasumStrategy(devices, sync_every=every), kind, global_batch, args.steps,
                    memory=memory,
                )  # fmt: skip
                row = {"model": kind, "replicas": replicas, "sync_every": every}
                row |= {"mirrored_ms": round(baseline, 2), "adasum_ms": round(adasum, 2)}
                row |= {
                    "ratio": round(adasum / baseline, 2),
                    "optimizer_mb": round(memory["optimizer_mb"], 1),
                }
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
