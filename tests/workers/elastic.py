"""The worker of tests/test_elastic.py (and of test_cluster.py's elastic job), started by
`python -m tf_adasum.run --elastic ... -m tests.workers.elastic OUT MODE` (tests/workers/dispatch.py).

Modes:
    strategy       model.fit under AdasumStrategy(), Horovod's elastic callbacks
    strategy_outer as strategy, with sync_every=2 and an outer optimizer (SGD with momentum): the
                   processes change between two syncs
    callback       a plain model.fit with AdasumCallback, each process its share
    callback_outer as callback, with AdasumCallback(sync_every=2, outer_optimizer=...) and the same outer
                   optimizer given to KerasState
    loop           a GradientTape loop: tf_adasum.tensorflow's DistributedOptimizer (Adasum) and
                   TensorFlowKerasState, a commit per batch
    keras2_horovod Horovod's elastic tf.keras script under tf_keras (the test sets TF_USE_LEGACY_KERAS=1):
                   DistributedOptimizer(Adam, op=Adasum), KerasState and the elastic callbacks, each
                   process its share
    horovod_state  Horovod's test_elastic_state, on 2 ranks: sync takes rank 0's state, restore and
                   commit as Horovod's (under the plain launcher)

The global batch is GLOBAL_BATCH rows whatever the number of processes: each process trains on its
contiguous share of every global batch, so a new group reshards the data by itself.

$FAULT injects failures, `group:rank:batch:kind` entries joined by commas, in the group and rank named,
when that batch (of any epoch, counted from 0 in the epoch) starts:
    kill     SIGKILL 50 ms into the batch (inside the step; a late timer is waited for at the next batch's
             start, never later), its time in OUT/killed-group{g}-rank{r}.json
    stop     SIGSTOP at the batch's start (a hang)
    commit   SIGKILL inside the commit after that batch, after its copy, before the ranks meet
    exit     exit(3) at the batch's start, after printing an error line (a worker's own error)
    grow     write $GROW_TO (default "127.0.0.1:3") to $SLOTS_FILE, the discovery script's answer, at the
             batch's start
    start    exit(3) as the process starts (the batch is ignored)
    leaveN   write "127.0.0.1:N" to $SLOTS_FILE, then as kill (a host preempted and delisted)
    slotsN   write "127.0.0.1:N" to $SLOTS_FILE (a host listed again)
    killfirst  as kill, at the first batch this process runs (the batch is ignored): a change right
             after the last one
    lostdisk delete, as the process starts, the file of commits it would resume from: its host lost
             its disk (the batch is ignored); it resumes from the launcher's copy
$RESET_LR=X registers a reset callback that sets the learning rate to X * size() (fit modes).
$PRELUDE=1 makes one all-reduce before the training function, as Horovod's examples do (a one-step fit).
$SLOW_BATCH (seconds) sleeps at every batch's start, so that the launcher's notices arrive mid-epoch.
$BATCHES_PER_COMMIT: the fit modes' CommitStateCallback's (default 1). $EPOCHS: how many (default 2).

Each process of strategy, callback and loop writes OUT/final-rank{r}.npz (the weights) and .json (its
group, size, where it resumed), and OUT/resumed-group{g}-rank{r}.json when its training function starts.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np

import tf_adasum  # under tf_adasum.run this starts the TF engine

# isort: split
import keras
import tensorflow as tf

from tests.workers.dispatch import main
from tf_adasum import elastic
from tf_adasum.launch.elastic.pool import ENV_STANDBY
from tf_adasum.launch.protocol import ENV_RESUME_FILE

GLOBAL_BATCH = 12
ROWS = 96  # 8 global batches an epoch
EPOCHS = int(os.environ.get("EPOCHS", "2"))
BATCHES_PER_COMMIT = int(os.environ.get("BATCHES_PER_COMMIT", "1"))


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((ROWS, 3)).astype(np.float32)
    w = rng.standard_normal((3, 2)).astype(np.float32)
    y = (x @ w + 0.1 * rng.standard_normal((ROWS, 2))).astype(np.float32)
    return x, y


def my_share(array: np.ndarray, rank: int, size: int) -> np.ndarray:
    """This process's contiguous share of every global batch (AdasumStrategy's split)."""
    batches = array.reshape(ROWS // GLOBAL_BATCH, GLOBAL_BATCH, *array.shape[1:])
    first, last = GLOBAL_BATCH * rank // size, GLOBAL_BATCH * (rank + 1) // size
    return batches[:, first:last].reshape(-1, *array.shape[1:])


def _keras() -> Any:
    """Keras 3, or tf_keras where `tf.keras` names it (TF_USE_LEGACY_KERAS=1: the keras2_* modes)."""
    return tf.keras if tf.keras.__name__.startswith("tf_keras") else keras


def model_in(scope: tf.distribute.Strategy | None) -> keras.Model:
    k = _keras()
    with scope.scope() if scope is not None else _nothing():
        model = k.Sequential([k.Input((3,)), k.layers.Dense(2)])
        model.set_weights([np.full((3, 2), 0.1, np.float32), np.zeros(2, np.float32)])
    return model


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *args: object) -> None:
        return None


def faults() -> list[tuple[int, int, int, str]]:
    entries = [e for e in os.environ.get("FAULT", "").split(",") if e]
    return [(int(g), int(r), int(b), k) for g, r, b, k in (e.split(":") for e in entries)]


def my_faults(kind: str | None = None) -> dict[int, str]:
    """{batch: kind} of this process's faults in this group."""
    group, rank = elastic.generation(), tf_adasum.rank()
    return {b: k for g, r, b, k in faults() if g == group and r == rank and (kind is None or k == kind)}


# With $FAULT_BATCHES=relative a fault's batch counts the batches this process has begun in its group
# (from 0), not the batch's place in its epoch.
RELATIVE = os.environ.get("FAULT_BATCHES") == "relative"
_begun = 0  # batches this process has begun
_dying = False  # a kill is on its timer: this process begins no other batch


def at_batch_start(batch: int, out: Path) -> None:
    global _begun
    if _dying:
        # The kill's timer has not fired within the last batch (a loaded machine can hold a thread back
        # for several steps): wait for it here, so that the process dies before this batch, never later.
        time.sleep(60)
        print(f"worker error: rank {tf_adasum.rank()} was not killed within 60 s of its kill fault")
        sys.stdout.flush()
        os._exit(4)
    time.sleep(float(os.environ.get("SLOW_BATCH", "0")))
    _begun += 1
    if _begun == 1 and "killfirst" in my_faults().values():
        kill_soon(batch, out)
        return
    kind = my_faults().get(_begun - 1 if RELATIVE else batch, "")
    if kind.startswith("leave"):  # the host leaves the discovery's list, and its process dies
        Path(os.environ["SLOTS_FILE"]).write_text(f"127.0.0.1:{kind[5:]}\n")
        kill_soon(batch, out)
    elif kind.startswith("slots"):
        Path(os.environ["SLOTS_FILE"]).write_text(f"127.0.0.1:{kind[5:]}\n")
    elif kind == "kill":
        kill_soon(batch, out)
    elif kind == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif kind == "exit":
        print(f"worker error: rank {tf_adasum.rank()} of group {elastic.generation()} fails at batch {batch}")
        sys.stdout.flush()
        os._exit(3)
    elif kind == "grow":
        Path(os.environ["SLOTS_FILE"]).write_text(os.environ.get("GROW_TO", "127.0.0.1:3").replace(",", "\n"))


def kill_soon(batch: int, out: Path) -> None:
    """SIGKILL 50 ms from now, inside this batch's step, or at the next batch's start at the latest."""
    global _dying
    _dying = True
    threading.Timer(0.05, die, (batch, out)).start()


def die(batch: int, out: Path) -> None:
    """SIGKILL, having written when (OUT/killed-group{g}-rank{r}.json): the survivors' detection is timed
    from it."""
    stamp = {"time": time.time(), "batch": batch}
    (out / f"killed-group{elastic.generation()}-rank{tf_adasum.rank()}.json").write_text(json.dumps(stamp))
    os.kill(os.getpid(), signal.SIGKILL)


def kill_in_commit(state: elastic.State, batch_of_commit: callable) -> None:
    """Makes this process die inside the commit that follows a `commit` fault's batch."""
    batches = my_faults("commit")
    if not batches:
        return
    check = state.check_host_updates

    def dying_check() -> None:
        if (_begun - 1 if RELATIVE else batch_of_commit()) in batches:
            os.kill(os.getpid(), signal.SIGKILL)
        check()

    state.check_host_updates = dying_check


class Faults(tf_adasum._compat.Keras2CallbackProtocol, keras.callbacks.Callback):
    """The faults, at each batch trained: not at the `skip` batches a resumed epoch reads and drops."""

    def __init__(self, out: Path, skip: int = 0) -> None:
        super().__init__()
        self.out = out
        self.skip = skip

    def on_train_batch_begin(self, batch: int, logs: object = None) -> None:
        if batch >= self.skip:
            at_batch_start(batch, self.out)

    def on_epoch_end(self, epoch: int, logs: object = None) -> None:
        self.skip = 0


def record(out: Path, state: elastic.State, name: str) -> None:
    rank = tf_adasum.rank()
    info = {
        "group": elastic.generation(),
        "size": tf_adasum.size(),
        "epoch": int(state.epoch),
        "batch": int(state.batch),
        "commit": state._commits,
        "host": socket.gethostname(),
        "warm": ENV_STANDBY in os.environ,  # a process of the launcher's pool
        "forwarded": "FORWARDED_SECRET" in os.environ,  # a secret the launcher's environment held
        "learning_rate": float(tf.convert_to_tensor(state.optimizer.learning_rate)),
        # Each process's own optimizer state (Adam's moments differ by process under Adasum).
        "optimizer": [
            float(np.sum(np.abs(v.numpy()))) for v in tf_adasum._compat.optimizer_variables(state.optimizer)
        ],
        # The outer optimizer's state (strategy_outer, callback_outer): one and the same everywhere.
        "outer": [
            v.numpy().tolist()
            for v in getattr(
                getattr(state.optimizer, "outer_optimizer", None) or getattr(state, "outer_optimizer", None),
                "variables",
                [],
            )
        ],
    }
    (out / f"{name}-rank{rank}.json").write_text(json.dumps(info))


def prelude() -> None:
    if "lostdisk" in my_faults().values():  # this host lost the commits this process would resume from
        Path(os.environ[ENV_RESUME_FILE]).unlink()
    if "start" in my_faults().values():
        print(f"worker error: rank {tf_adasum.rank()} of group {elastic.generation()} fails as it starts")
        sys.stdout.flush()
        os._exit(3)
    if os.environ.get("PRELUDE") == "1":
        tf_adasum.allreduce(tf.ones([4]), op=tf_adasum.Sum)


def strategy(out: Path) -> None:
    """model.fit under AdasumStrategy(): every process is given the global batches."""
    tf_adasum.init()
    prelude()
    x, y = data()
    adasum = tf_adasum.AdasumStrategy()
    model = model_in(adasum)
    with adasum.scope():
        model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
    fit(out, model, x, y, GLOBAL_BATCH, [])


def strategy_outer(out: Path) -> None:
    """model.fit under AdasumStrategy(sync_every=2, outer_optimizer=...): the outer state is committed."""
    tf_adasum.init()
    prelude()
    x, y = data()
    outer = keras.optimizers.SGD(0.5, momentum=0.5)
    adasum = tf_adasum.AdasumStrategy(sync_every=2, outer_optimizer=outer)
    model = model_in(adasum)
    with adasum.scope():
        model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
    fit(out, model, x, y, GLOBAL_BATCH, [])


def callback(out: Path, outer: Any = None) -> None:
    """A plain model.fit with AdasumCallback: each process is given its share of every global batch.
    With an outer optimizer, windows of 2 steps, and the elastic state is given it too."""
    comm = tf_adasum.init()
    prelude()
    x, y = data()
    model = model_in(None)
    model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
    fit_x, fit_y = my_share(x, comm.rank, comm.size), my_share(y, comm.rank, comm.size)
    batch = len(fit_x) // (ROWS // GLOBAL_BATCH)
    adasum = (
        tf_adasum.AdasumCallback() if outer is None else tf_adasum.AdasumCallback(2, outer_optimizer=outer)
    )
    fit(out, model, fit_x, fit_y, batch, [adasum], outer=outer)


def callback_outer(out: Path) -> None:
    """callback with an outer optimizer (SGD with momentum)."""
    callback(out, keras.optimizers.SGD(0.5, momentum=0.5))


def keras2_horovod(out: Path) -> None:
    """Horovod's elastic tf.keras script with its import changed, under tf_keras."""
    import tf_adasum.keras as hvd

    assert tf.keras.__name__.startswith("tf_keras"), tf.keras.__name__
    hvd.init()
    prelude()
    x, y = data()
    model = model_in(None)
    model.compile(
        optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.Adam(0.05), op=hvd.Adasum), loss="mse"
    )
    fit_x, fit_y = my_share(x, hvd.rank(), hvd.size()), my_share(y, hvd.rank(), hvd.size())
    fit(out, model, fit_x, fit_y, len(fit_x) // (ROWS // GLOBAL_BATCH), [])


def fit(
    out: Path,
    model: keras.Model,
    fit_x: np.ndarray,
    fit_y: np.ndarray,
    batch: int,
    extra: list,
    outer: Any = None,
) -> None:
    """The elastic fit the fit modes share: KerasState, Horovod's elastic callbacks, the faults."""
    state = elastic.KerasState(model, outer_optimizer=outer, epoch=0, batch=0)
    kill_in_commit(state, lambda: state.batch - 1)
    if os.environ.get("RESET_LR"):  # Horovod's rule for an average, in a reset callback
        rule = float(os.environ["RESET_LR"])
        state.register_reset_callbacks(
            [lambda: state.optimizer.learning_rate.assign(rule * tf_adasum.size())]
        )

    @elastic.run
    def train(state: elastic.State) -> None:
        record(out, state, f"resumed-group{elastic.generation()}")
        state.model.fit(
            fit_x,
            fit_y,
            batch_size=batch,
            epochs=EPOCHS,
            initial_epoch=state.epoch,
            shuffle=False,
            verbose=0,
            callbacks=[
                *extra,
                Faults(out, skip=int(state.batch)),
                elastic.UpdateEpochStateCallback(state),
                elastic.UpdateBatchStateCallback(state),
                elastic.CommitStateCallback(state, batches_per_commit=BATCHES_PER_COMMIT),
            ],
        )

    train(state)
    finish(out, state)


def loop(out: Path) -> None:
    import tf_adasum.tensorflow as hvd

    hvd.init()
    prelude()
    x, y = data()
    model = model_in(None)
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(0.05), op=hvd.Adasum)

    @tf.function
    def step(xb: tf.Tensor, yb: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(xb) - yb))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    opt.build(model.trainable_variables)
    state = hvd.elastic.TensorFlowKerasState(model, opt, epoch=0, batch=0)
    kill_in_commit(state, lambda: state.batch - 1)

    @hvd.elastic.run
    def train(state: elastic.State) -> None:
        record(out, state, f"resumed-group{elastic.generation()}")
        xs, ys = my_share(x, hvd.rank(), hvd.size()), my_share(y, hvd.rank(), hvd.size())
        per = len(xs) // (ROWS // GLOBAL_BATCH)
        while state.epoch < EPOCHS:
            for b in range(state.batch, ROWS // GLOBAL_BATCH):
                at_batch_start(b, out)
                step(xs[b * per : (b + 1) * per], ys[b * per : (b + 1) * per])
                state.batch = b + 1
                state.commit()
            state.epoch, state.batch = state.epoch + 1, 0
            state.commit()

    train(state)
    finish(out, state)


def finish(out: Path, state: elastic.State) -> None:
    np.savez(out / f"final-rank{tf_adasum.rank()}.npz", *state.model.get_weights())
    record(out, state, "final")


def horovod_state(out: Path) -> None:
    """Horovod 0.28.1's test_elastic_state (test_tensorflow2_keras.py), on tf_adasum.keras."""
    import tf_adasum.keras as hvd

    hvd.init()
    v = 1.0 if hvd.rank() == 0 else 2.0
    model1 = keras.Sequential([keras.layers.Dense(2, activation="softmax")])
    model1.build((2, 2))
    model1.set_weights([np.array([[v, v], [v, v]], dtype=np.float32), np.array([v, v], dtype=np.float32)])
    model2 = keras.Sequential([keras.layers.Dense(2, activation="softmax")])
    model2.build((2, 2))
    model2.set_weights(
        [np.array([[1.0, 2.0], [3.0, 4.0]], dtype=np.float32), np.array([0.0, 0.0], dtype=np.float32)]
    )
    optimizer = keras.optimizers.Adam(0.001 * hvd.size())
    state = hvd.elastic.KerasState(model1, optimizer, batch=20 + hvd.rank(), epoch=10 + hvd.rank())
    state.sync()
    model1_weights, model2_weights = model1.get_weights(), model2.get_weights()
    results = {"synced": all(np.allclose(w, np.ones_like(w)) for w in state.model.get_weights())}
    results["synced_objects"] = [state.batch, state.epoch]
    model1.set_weights(model2_weights)
    state.batch, state.epoch = 21, 11
    state.restore()
    results["restored"] = all(
        np.allclose(a, b) for a, b in zip(model1.get_weights(), model1_weights, strict=True)
    )
    results["restored_objects"] = [state.batch, state.epoch]
    model1.set_weights(model2_weights)
    state.batch, state.epoch = 21, 11
    state.commit()
    state.restore()
    results["committed"] = all(
        np.allclose(a, b) for a, b in zip(model1.get_weights(), model2_weights, strict=True)
    )
    results["committed_objects"] = [state.batch, state.epoch]
    (out / f"horovod_state-rank{hvd.rank()}.json").write_text(json.dumps(results))


MODES = {
    "strategy_outer": strategy_outer,
    "callback_outer": callback_outer,
    "strategy": strategy,
    "callback": callback,
    "loop": loop,
    "keras2_horovod": keras2_horovod,
    "horovod_state": horovod_state,
}

if __name__ == "__main__":
    main(MODES)
