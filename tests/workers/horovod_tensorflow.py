"""The worker of tests/test_horovod_tensorflow.py's test across processes, under mpirun or
`python -m tf_adasum.run`: `python -m tests.workers.horovod_tensorflow OUT MODE[,MODE...]`
(tests/workers/dispatch.py). Every new collective of tf_adasum.tensorflow, eagerly and inside
tf.function, on data that differs by rank (tests/workers/data.py); and bad input on one rank only. Each
mode writes what every process got into OUT/{mode}{rank}.json; the test checks it against numpy.

Modes:
    engine           the engine the launcher started
    collectives      Min / Max / Product all-reduces, grouped_allreduce, alltoall (with splits and even),
                     grouped_allgather, grouped_reducescatter, broadcast_ in place, the rank and size ops
    objects          broadcast_object, allgather_object, broadcast_object_fn, is_homogeneous
    sync_batch_norm  SyncBatchNormalization's output, gradients and moving statistics, against Keras's
                     BatchNormalization on the global batch
    partial_tape     PartialDistributedGradientTape: shared layers averaged, local ones this rank's own
    bad_input        bad input on the last rank only: every rank raises; the collectives meet afterwards
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras
import numpy as np
import tensorflow as tf

import tf_adasum  # under tf_adasum.run this starts the TF engine
import tf_adasum.tensorflow as hvd
from tests.workers.data import allgather_inputs, alltoall_input, batch, reduced_inputs, scatter_inputs
from tests.workers.dispatch import main

tf.get_logger().setLevel("ERROR")


def listed(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [listed(v) for v in value]
    array = np.asarray(value)
    return array.tolist() if array.dtype != np.uint64 else [int(v) for v in array.reshape(-1)]


def caught(fn: Callable[[], Any]) -> dict[str, str]:
    try:
        fn()
    except Exception as error:  # the test reads which error every rank got
        message = error.message if isinstance(error, tf.errors.OpError) else str(error)
        return {"error": type(error).__name__, "message": message}
    return {"error": "none", "message": ""}


def collectives(rank: int, p: int) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for how in ("eager", "compiled"):

        def run(fn: Callable[..., Any], *args: Any, how: str = how) -> Any:
            return fn(*args) if how == "eager" else tf.function(fn, autograph=False)(*args)

        inputs = {k: tf.constant(v) for k, v in reduced_inputs(rank).items()}
        for op in ("Min", "Max", "Product"):
            chosen = getattr(hvd, op)
            names = [k for k in inputs if not (k == "uint64" and op == "Product")]
            seen[f"{how}_{op}"] = {
                k: listed(run(lambda t, o=chosen: hvd.allreduce(t, op=o), inputs[k])) for k in names
            }
        grouped = run(
            lambda a, b: hvd.grouped_allreduce([a, b], op=hvd.Max), inputs["float32"], inputs["int32"]
        )
        seen[f"{how}_grouped_max"] = listed(grouped)

        tensor, splits = alltoall_input(rank, p)
        received, counts = run(lambda t, s=splits: hvd.alltoall(t, splits=s), tf.constant(tensor))
        seen[f"{how}_alltoall"] = {
            "received": listed(received),
            "splits": listed(counts),
            "dtype": counts.dtype.name,
        }
        even = tf.constant(tensor[: 2 * p])
        seen[f"{how}_alltoall_even"] = listed(run(lambda t: hvd.alltoall(t), even))

        a, b = allgather_inputs(rank)
        seen[f"{how}_grouped_allgather"] = listed(run(lambda x, y: hvd.grouped_allgather([x, y]), a, b))

        f, g = scatter_inputs(rank)
        seen[f"{how}_grouped_reducescatter"] = {
            "sum": listed(run(lambda x, y: hvd.grouped_reducescatter([x, y], op=hvd.Sum), f, g)),
            "average": listed(run(lambda x: hvd.grouped_reducescatter([x]), f)),
        }

        seen[f"{how}_broadcast_"] = in_place(rank, p, run)
        seen[f"{how}_ids"] = listed(
            run(lambda: [hvd.rank_op(), hvd.size_op(), hvd.local_rank_op(), hvd.local_size_op()])
        )
        seen[f"{how}_included"] = int(run(lambda: hvd.process_set_included_op()))
    return seen


def in_place(rank: int, p: int, run: Callable[..., Any]) -> dict[str, Any]:
    """broadcast_ from the last rank, of a tf.Variable and a Keras variable (tf.function captures them)."""
    variable = tf.Variable(np.full(3, rank, np.float32))
    keras_variable = keras.Variable(np.full((2, 2), 10.0 * rank))
    returned = run(lambda: hvd.broadcast_([variable, keras_variable], root_rank=p - 1))
    return {
        "returned": listed(returned),
        "variables": listed([variable.numpy(), keras.ops.convert_to_numpy(keras_variable)]),
    }


def objects(rank: int, p: int) -> dict[str, Any]:
    mine = {"rank": rank, "rows": np.arange(rank + 1), "text": "é" * rank}
    got = hvd.broadcast_object(mine, root_rank=p - 1)
    gathered = hvd.allgather_object((rank, [rank] * rank))
    from_zero = hvd.broadcast_object_fn(root_rank=0)(f"from rank {rank}")
    return {
        "broadcast": {"rank": got["rank"], "rows": got["rows"].tolist(), "text": got["text"]},
        "broadcast_is_own": got is mine,
        "allgather": [[r, list(v)] for r, v in gathered],
        "broadcast_fn": from_zero,
        "homogeneous": hvd.is_homogeneous(),
    }


def sync_batch_norm(rank: int, p: int) -> dict[str, Any]:
    """One training call of SyncBatchNormalization per mode, and the gradient of every rank's weighted
    output sum, against plain BatchNormalization on every rank's rows at once (computed here, alone)."""
    batches = [batch(r) for r in range(p)]
    weights = [
        np.random.default_rng(400 + r).standard_normal(b.shape).astype(np.float32)
        for r, b in enumerate(batches)
    ]
    seen: dict[str, Any] = {}
    for how in ("eager", "compiled"):
        layer = hvd.SyncBatchNormalization(momentum=0.5)
        layer.build((None, 3))

        def step(x: tf.Tensor, w: tf.Tensor, layer: Any = layer) -> Any:
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = layer(x, training=True)
                loss = tf.reduce_sum(y * w)
            dx, dgamma = tape.gradient(loss, [x, layer.gamma])
            return y, dx, dgamma

        run = step if how == "eager" else tf.function(step)
        y, dx, dgamma = run(tf.constant(batches[rank]), tf.constant(weights[rank]))
        seen[how] = {
            "output": listed(y),
            "dx": listed(dx),
            "dgamma": listed(dgamma),
            "moving_mean": listed(layer.moving_mean.numpy()),
            "moving_variance": listed(layer.moving_variance.numpy()),
            "name": layer.name,
        }
    # The oracle: Keras's own layer on the global batch, one process's work.
    plain = keras.layers.BatchNormalization(momentum=0.5)
    plain.build((None, 3))
    everything = tf.constant(np.concatenate(batches))
    with tf.GradientTape() as tape:
        tape.watch(everything)
        y = plain(everything, training=True)
        loss = tf.reduce_sum(y * tf.constant(np.concatenate(weights)))
    dx, dgamma = tape.gradient(loss, [everything, plain.gamma])
    start = sum(b.shape[0] for b in batches[:rank])
    seen["oracle"] = {
        "output": listed(y[start : start + batches[rank].shape[0]]),
        "dx": listed(dx[start : start + batches[rank].shape[0]]),
        "dgamma": listed(dgamma),
        "moving_mean": listed(plain.moving_mean.numpy()),
        "moving_variance": listed(plain.moving_variance.numpy()),
    }
    return seen


def partial_tape(rank: int, p: int) -> dict[str, Any]:
    """PartialDistributedGradientTape: the shared layer's gradients averaged, the local layer's this
    rank's own (divided by p, or not with scale_local_gradients=False)."""
    rng = np.random.default_rng(500 + rank)
    x, target = rng.standard_normal((4, 3)).astype(np.float32), rng.standard_normal((4, 2)).astype(np.float32)
    shared, local = keras.layers.Dense(4, name="shared"), keras.layers.Dense(2, name="local")
    model = keras.Sequential([keras.Input((3,)), shared, local])
    model.set_weights([np.full_like(w, 0.1 * (i + 1)) for i, w in enumerate(model.get_weights())])
    seen: dict[str, Any] = {}
    for how in ("eager", "compiled"):
        for scale in (True, False):

            def grads(scale: bool = scale) -> Any:
                with tf.GradientTape() as tape:
                    loss = tf.reduce_mean((model(x) - target) ** 2)
                plain = tape.gradient(loss, model.trainable_variables)
                with tf.GradientTape() as tape:
                    loss = tf.reduce_mean((model(x) - target) ** 2)
                wrapped = hvd.PartialDistributedGradientTape(
                    tape, local_layers=local, scale_local_gradients=scale
                )
                reduced = wrapped.gradient(loss, model.trainable_variables)
                return plain, reduced

            plain, reduced = grads() if how == "eager" else tf.function(grads)()
            seen[f"{how}_{scale}"] = {"plain": listed(plain), "reduced": listed(reduced)}
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean((model(x) - target) ** 2)
    wrapped = hvd.PartialDistributedGradientTape(tape, local_layers=[local])
    local_pairs, global_pairs = wrapped.get_local_and_global_gradients(loss, model.trainable_variables)
    seen["split"] = [[v.path for v, _ in local_pairs], [v.path for v, _ in global_pairs]]
    return seen


def bad_input(rank: int, p: int) -> dict[str, Any]:
    """Bad input on the last rank only: every rank must raise, well within the peer timeout."""
    last = rank == p - 1
    good, splits = alltoall_input(rank, p)
    too_many = [s + 100 for s in splits] if last else splits
    wide = np.ones((2, 4 if last else 3), np.float32)

    class Local:  # a class defined in a function does not pickle
        pass

    seen = {
        "alltoall_splits": caught(lambda: hvd.alltoall(good, splits=too_many)),
        "alltoall_shape": caught(lambda: hvd.alltoall(wide)),
        "alltoall_uneven": caught(lambda: hvd.alltoall(good[: 2 * p + (1 if last else 0)])),
        "grouped_allgather_shape": caught(lambda: hvd.grouped_allgather([np.ones((1, 3)), wide])),
        "allgather_object": caught(lambda: hvd.allgather_object(Local() if last else 1)),
        "broadcast_object_root": caught(lambda: hvd.broadcast_object(Local(), root_rank=p - 1)),
        "reducescatter_min": caught(lambda: hvd.grouped_reducescatter([np.ones(4)], op=hvd.Min)),
        "broadcast_object_compiled": caught(lambda: tf.function(lambda: hvd.broadcast_object(1))()),
        "broadcast_tensor": caught(lambda: hvd.broadcast_([tf.ones(2)], root_rank=0)),
    }
    # Last: inside a tf.function the splits are checked when it runs, after the gather of every rank's.
    compiled = tf.function(lambda t, s: hvd.alltoall(t, splits=s))
    seen["alltoall_splits_compiled"] = caught(lambda: compiled(tf.constant(good), tf.constant(too_many)))
    # And the collectives still meet afterwards.
    seen["after"] = listed(hvd.allreduce(tf.constant([float(rank)]), op=hvd.Max))
    return seen


def engine(rank: int, p: int) -> dict[str, Any]:
    return {"engine": tf_adasum.init().engine, "size": p}


def mode(fn: Callable[[int, int], Any]) -> Callable[[Path], None]:
    """fn(rank, size)'s result, written to OUT/{fn's name}{rank}.json."""

    def run(out: Path) -> None:
        hvd.init()
        (out / f"{fn.__name__}{hvd.rank()}.json").write_text(json.dumps(fn(hvd.rank(), hvd.size())))

    return run


MODES = {
    fn.__name__: mode(fn) for fn in (engine, collectives, objects, sync_batch_norm, partial_tape, bad_input)
}

if __name__ == "__main__":
    main(MODES)
