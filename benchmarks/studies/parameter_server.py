"""A real asynchronous engine: Keras 3 with TensorFlow's ParameterServerStrategy, on 127.0.0.1.

Keras 3's model.fit has no parameter-server support (keras.src never mentions the strategy), but a
custom loop works: the model and its Keras optimizer are built under
tf.distribute.experimental.ParameterServerStrategy, so their variables live on the parameter server,
and a tf.distribute.coordinator.ClusterCoordinator schedules train steps onto whichever worker is
free. Each step reads the weights from the server, computes a gradient on the worker, and applies the
optimizer to the server's variables (Adam's moments live there, as in the paper); nothing waits for
the other workers, so gradients are stale by the updates that landed in between. Unlike the paper's
server, this one does not apply updates one at a time: Keras 3's assign_add is assign(self + value),
a read and a write, so steps that apply at once lose some of each other's updates to the weights and
to Adam's moments, and Keras's own step counter (which drives the learning-rate schedule and Adam's
bias correction) falls behind the steps taken.

This launches one parameter server and `--workers` workers as separate processes (tf.distribute.Server
on free 127.0.0.1 ports), trains one of benchmarks/studies/staleness.py's experiments for `--epochs`, and
reports the accuracy, the staleness the steps measured, and how many steps Keras's own counter kept.
Staleness is measured with an atomic counter, read when a step begins and incremented after its
writes: the steps counted in between. That is an approximation: the weights are not read as one
snapshot, and a step that lands while this one writes is counted too.

Everything is bounded by `--timeout`: a worker that dies makes the coordinator wait for it to come
back, so the deadline is what ends that; a watchdog thread ends the run 30 s later if TensorFlow does
not return to Python, and the servers die with this process (PR_SET_PDEATHSIG).

Usage:
    python benchmarks/studies/parameter_server.py                        # the transformer, 2 workers
    python benchmarks/studies/parameter_server.py --experiment cnn --workers 3
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve(cluster: dict[str, list[str]], job: str, index: int) -> None:
    """A parameter server or worker: a TensorFlow server that runs what the coordinator sends it,
    until the coordinator's process ends (then the kernel kills it: no orphans)."""
    import ctypes

    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:  # the parent died before the line above
        return
    import tensorflow as tf

    tf.distribute.Server(
        tf.train.ClusterSpec(cluster), job_name=job, task_index=index, protocol="grpc"
    ).join()


def train(args: argparse.Namespace, cluster: dict[str, list[str]]) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT / "benchmarks" / "studies"))
    import convergence
    import staleness

    # isort: split
    import keras
    import tensorflow as tf

    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(cluster), task_type="chief", task_id=0, rpc_layer="grpc"
    )
    strategy = tf.distribute.experimental.ParameterServerStrategy(resolver)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    spec = staleness.EXPERIMENTS[args.experiment]
    x, y, x_val, y_val = staleness.load_data(args.experiment, args.out, args.smoke)
    steps = max(1, int(len(y) // staleness.BATCH * args.epochs))

    def dataset() -> tf.data.Dataset:
        return tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(y)).repeat().batch(staleness.BATCH)

    # Made before the global seed is set, so each worker's shuffle draws its own seed and the workers
    # read the data in different orders.
    batches = iter(coordinator.create_per_worker_dataset(dataset))
    keras.utils.set_random_seed(args.seed)
    with strategy.scope():
        model = spec.model()
        optimizer = spec.optimizer(convergence.WarmupLinearDecay(spec.peak * args.multiplier, steps))
        optimizer.build(model.trainable_variables)
        # Keras's own step counter is no clock here: Keras 3's assign_add is assign(self + value), a
        # read and a write, so concurrent steps lose increments (and updates); this one is atomic.
        clock = tf.Variable(0, dtype=tf.int64, trainable=False)

    @tf.function
    def step(iterator: Any) -> Any:
        def replica(features: tf.Tensor, labels: tf.Tensor) -> tf.Tensor:
            pulled = clock.read_value()
            with tf.control_dependencies([pulled]), tf.GradientTape() as tape:
                loss = convergence.LOSS(labels, model(features, training=True))
            optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
            # After this step's writes (a variable's read follows its write), count it: the steps
            # counted in between are the updates that landed after this one read the weights.
            with tf.control_dependencies([v.value.read_value() for v in model.trainable_variables]):
                return clock.assign_add(1) - pulled - 1

        return strategy.run(replica, args=next(iterator))

    start = time.perf_counter()
    results = [coordinator.schedule(step, args=(batches,)) for _ in range(steps)]
    coordinator.join()
    seconds = time.perf_counter() - start
    measured = np.array([int(r.fetch()) for r in results])
    # Model.predict would distribute itself over the strategy; a plain call reads the server's weights.
    logits = np.concatenate([model(x_val[i : i + 1024], training=False) for i in range(0, len(y_val), 1024)])
    return {
        "experiment": args.experiment,
        "workers": args.workers,
        "steps": steps,
        "counted_steps": int(clock.numpy()),
        "keras_iterations": int(optimizer.iterations.numpy()),
        "mean_staleness": round(float(measured.mean()), 3),
        "max_staleness": int(measured.max()),
        "accuracy": round(float(np.mean(np.argmax(logits, 1) == y_val)), 4),
        "seconds": round(seconds, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--experiment", default="transformer", choices=["cnn", "transformer"])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=float, default=3)
    parser.add_argument("--multiplier", type=float, default=1, help="times the experiment's base rate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600, help="seconds for the whole run")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "studies" / "staleness_output")
    parser.add_argument("--smoke", action="store_true", help="a sliver of the data, a fraction of an epoch")
    parser.add_argument("--serve", nargs=3, metavar=("CLUSTER", "JOB", "INDEX"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(json.loads(args.serve[0]), args.serve[1], int(args.serve[2]))
        return 0
    if args.smoke:
        args.epochs, args.out = 0.5, args.out.with_name(args.out.name + "_smoke")
    args.out.mkdir(parents=True, exist_ok=True)

    def address() -> str:
        return f"127.0.0.1:{free_port()}"

    cluster = {
        "chief": [address()],
        "ps": [address()],
        "worker": [address() for _ in range(args.workers)],
    }
    servers = [
        subprocess.Popen([sys.executable, __file__, "--serve", json.dumps(cluster), job, str(i)])
        for job in ("ps", "worker")
        for i in range(len(cluster[job]))
    ]

    def expire(*_: Any) -> None:
        raise TimeoutError(f"the parameter-server run took longer than --timeout {args.timeout:g} s")

    def stop(code: int) -> None:
        for server in servers:
            server.kill()
        for server in servers:
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        sys.stdout.flush()
        sys.stderr.flush()
        # TensorFlow's exit would now retry RPCs to the servers just stopped and log a page of errors.
        os._exit(code)

    def watchdog() -> None:
        print(
            f"the parameter-server run did not return within --timeout {args.timeout:g} s + 30 s",
            file=sys.stderr,
        )
        stop(124)

    signal.signal(signal.SIGALRM, expire)
    signal.alarm(int(args.timeout))
    backstop = threading.Timer(args.timeout + 30, watchdog)
    backstop.daemon = True
    backstop.start()
    code = 1
    try:
        print(json.dumps(train(args, cluster)), flush=True)
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        signal.alarm(0)
        stop(code)


if __name__ == "__main__":
    sys.exit(main())
