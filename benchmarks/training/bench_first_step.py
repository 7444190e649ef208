"""The first step of model.fit: how long it takes, its processor time, and how often Keras traced the train
step, with tf_adasum's optimizer wrappers against the same Keras optimizer unwrapped, measured in the same
run.

Horovod's recipe (`import tf_adasum.keras as hvd`, `hvd.DistributedOptimizer`) runs fit without a
strategy. There Keras builds an optimizer in the first trace of the train step, and TensorFlow traces a
function whose first trace made variables a second time. The first step is what every process of a new
elastic group, and every job's start, waits for.

Each measurement is a process of its own (a second fit in one process would find TensorFlow's caches
warm), one process at a time, the configurations in a rotating order over --rounds rounds; the table
gives each configuration's median and its ratio to the unwrapped optimizer's median. With --processes,
jobs of N processes on this machine too (`tf_adasum.run -np N`), as an elastic group's are: each row is
then the median over the job's processes.

    python benchmarks/training/bench_first_step.py --rounds 5       # 3 minutes here
    python benchmarks/training/bench_first_step.py --rounds 3 --processes 1 2 6 --models cnn
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ["keras", "average", "adasum"]  # the optimizer unwrapped; DistributedOptimizer(op=Average, Adasum)


def child(model_name: str, config: str) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks" / "studies")]  # convergence.py
    import keras
    import numpy as np
    import tensorflow as tf
    from convergence import LOCAL_BATCH, LOSS, make_model, make_transformer, pointer_data

    import tf_adasum.keras as hvd

    hvd.init()
    keras.utils.set_random_seed(0)
    if (
        model_name == "transformer"
    ):  # the LAMB study's pointer task, with LAMB (benchmarks/studies/elastic_worker.py)
        x, y, _, _ = pointer_data(2_000)
        model, inner = make_transformer(), keras.optimizers.Lamb(1e-3)
    else:  # convergence.py's CNN on 16x16 digits, with SGD and momentum
        x = np.random.default_rng(0).random((640, 16, 16, 1), np.float32)
        y = np.random.default_rng(1).integers(0, 10, 640)
        model, inner = make_model(), keras.optimizers.SGD(0.01, momentum=0.9)
    op = {"average": hvd.Average, "adasum": hvd.Adasum}.get(config)
    model.compile(optimizer=inner if op is None else hvd.DistributedOptimizer(inner, op=op), loss=LOSS)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(LOCAL_BATCH)
    traces = []
    train_step = model.train_step

    def counted(batch: Any) -> Any:
        traces.append(1)
        return train_step(batch)

    model.train_step = counted

    class FirstStep(keras.callbacks.Callback):
        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            self.model.stop_training = True

    wall, cpu = time.perf_counter(), time.process_time()
    model.fit(data, epochs=1, verbose=0, callbacks=[FirstStep()])
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    print("@first " + json.dumps({"wall": wall, "cpu": cpu, "traces": len(traces)}), flush=True)


def measure(model_name: str, config: str, processes: int, timeout: float) -> dict[str, float]:
    """One job's first step: its processes' median wall and processor time, and their traces."""
    child_command = [__file__, "--child", model_name, config]
    if processes > 1:  # a job of several processes on this machine, as elastic.py's groups are
        command = [sys.executable, "-m", "tf_adasum.run", "-np", str(processes), *child_command]
    else:
        command = [sys.executable, *child_command]
    out = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=True).stdout
    ranks = [json.loads(line.split("@first ", 1)[1]) for line in out.splitlines() if "@first " in line]
    if len(ranks) != processes:
        raise RuntimeError(f"expected {processes} first steps from {command}, got {len(ranks)}:\n{out}")
    return {key: statistics.median(r[key] for r in ranks) for key in ("wall", "cpu", "traces")}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--models", nargs="+", choices=["cnn", "transformer"], default=["cnn", "transformer"])
    parser.add_argument(
        "--processes", type=int, nargs="+", default=[1], help="processes per job (tf_adasum.run -np N)"
    )
    parser.add_argument("--timeout", type=float, default=300, help="seconds per job")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    rows: dict[tuple[int, str, str], list[dict[str, float]]] = {}
    for r in range(args.rounds):
        for processes in args.processes:
            for model_name in args.models:
                order = CONFIGS[r % len(CONFIGS) :] + CONFIGS[: r % len(CONFIGS)]
                for config in order:
                    measured = measure(model_name, config, processes, args.timeout)
                    rows.setdefault((processes, model_name, config), []).append(measured)
    print(
        f"first fit step, median over each job's processes, then over {args.rounds} jobs "
        "(ratio: / the same optimizer unwrapped, at the same number of processes)"
    )
    print(
        f"{'processes':>9} {'model':<12} {'optimizer':<28} {'wall s':>7} {'ratio':>6} "
        f"{'cpu s':>6} {'ratio':>6} {'traces':>6}"
    )
    names = {
        "keras": "unwrapped",
        "average": "DistributedOptimizer Average",
        "adasum": "DistributedOptimizer Adasum",
    }
    for processes in args.processes:
        for model_name in args.models:
            base = rows[(processes, model_name, "keras")]
            base_wall = statistics.median(m["wall"] for m in base)
            base_cpu = statistics.median(m["cpu"] for m in base)
            for config in CONFIGS:
                runs = rows[(processes, model_name, config)]
                wall = statistics.median(m["wall"] for m in runs)
                cpu = statistics.median(m["cpu"] for m in runs)
                traces = "/".join(sorted({f"{m['traces']:g}" for m in runs}))
                print(
                    f"{processes:>9} {model_name:<12} {names[config]:<28} {wall:>7.3f} "
                    f"{wall / base_wall:>6.2f} {cpu:>6.3f} {cpu / base_cpu:>6.2f} {traces:>6}"
                )


if __name__ == "__main__":
    main()
