"""Soak: the MultiDeviceIterator crash AdasumStrategy holds its latest iterators against, counted.

Destroying TensorFlow's MultiDeviceIterator while its background thread reads kills the process
(SIGSEGV; see tf_adasum/training/strategy.py, _keeping_iterators). AdasumStrategy holds its KEPT_ITERATORS
latest distributed iterators, a mitigation by count. This runs R jobs of 2 processes (the TF engine,
`python -m tf_adasum.run`), each of N rounds of fit + evaluate (on numpy arrays, or a tf.data dataset),
and counts the jobs that crashed: a TensorFlow upgrade or a change to the input path shows here at once.

Usage:
    python benchmarks/training/soak_iterators.py [--runs 3] [--rounds 40] [--kept 4] [--data arrays|dataset]

--kept sets strategy.KEPT_ITERATORS in the workers (0: hold none, the state before the mitigation).
Prints one JSON line: runs, rounds, kept, crashed (jobs with a rank killed by a signal or a
"Fatal Python error"), failed (other non-zero exits), seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def worker(rounds: int, kept: int, data: str) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    sys.path.insert(0, str(ROOT))
    import keras
    import numpy as np
    import tensorflow as tf

    import tf_adasum
    from tf_adasum.training import strategy as strategy_module

    strategy_module.KEPT_ITERATORS = kept
    strategy = tf_adasum.AdasumStrategy()
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, "relu"), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((256, 8)).astype("float32"), rng.standard_normal((256, 1)).astype("float32")
    for _ in range(rounds):
        if data == "dataset":
            batches = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)
            model.fit(batches, epochs=1, verbose=0)
            model.evaluate(batches, verbose=0)
        else:  # numpy arrays, through Keras's own adapter
            model.fit(x, y, batch_size=32, epochs=1, verbose=0)
            model.evaluate(x, y, batch_size=32, verbose=0)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--kept", type=int, default=4, help="strategy.KEPT_ITERATORS in the workers")
    parser.add_argument("--data", choices=["arrays", "dataset"], default="arrays", help="what fit reads")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.rounds, args.kept, args.data)
        return
    env = dict(os.environ, PYTHONFAULTHANDLER="1", TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=str(ROOT))
    crashed = failed = 0
    begin = time.monotonic()
    for _ in range(args.runs):
        command = [
            sys.executable,
            "-m",
            "tf_adasum.run",
            "-np",
            "2",
            "--timeout",
            "900",
            __file__,
            "--worker",
        ]
        command += ["--rounds", str(args.rounds), "--kept", str(args.kept), "--data", args.data]
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1000, check=False)
        output = done.stdout + done.stderr
        if "Fatal Python error" in output or done.returncode < 0 or done.returncode > 128:
            crashed += 1
        elif done.returncode != 0:
            failed += 1
            print(output[-3000:], file=sys.stderr)
    result = {
        "runs": args.runs,
        "rounds": args.rounds,
        "kept": args.kept,
        "data": args.data,
        "crashed": crashed,
        "failed": failed,
        "seconds": round(time.monotonic() - begin, 1),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
