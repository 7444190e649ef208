"""What the launcher's forwarding of a rank's output costs: a process that writes MEGABYTES of a Keras-like
progress bar (frames rewritten with "\\r", a newline every --frames-per-line frames), run alone with its
stdout drained by a plain reader, and under `python -m tf_adasum.run -np 1` (its stdout a log, as in a
batch job, and with --output-filename as well). The writer blocks on its pipe while the launcher is
behind, so its time is the forwarding's.

Usage:
    python benchmarks/micro/bench_launch_output.py [--megabytes 8 33] [--frames-per-line 0 200] [--repeats 3]

One JSON line per size and line length: the median seconds alone, through the launcher, through the
launcher with per-rank files, and each ratio to the time alone, measured in this run. No TensorFlow.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

WRITER = """
import sys
megabytes, per_line = float(sys.argv[1]), int(sys.argv[2])
frame = ("\\r" + "=" * 60 + " 123/1000 - 0s 1ms/step - loss: 0.5000").encode()
out, left, frames = sys.stdout.buffer, int(megabytes * (1 << 20)), 0
while left > 0:
    chunk = frame * 64
    frames += 64
    if per_line and frames % per_line < 64:
        chunk += b"\\n"
    out.write(chunk)
    left -= len(chunk)
out.write(b"\\n")
out.flush()
"""


def seconds(command: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{command[:4]} exited with {done.returncode}: {done.stderr.decode()[-2000:]}")
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--megabytes", type=float, nargs="+", default=[8.0, 33.0])
    parser.add_argument(
        "--frames-per-line", type=int, nargs="+", default=[0, 200], help="0: one line for the whole run"
    )
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root)
    with tempfile.TemporaryDirectory() as folder:
        writer = os.path.join(folder, "writer.py")
        with open(writer, "w") as f:
            f.write(WRITER)
        launcher = [sys.executable, "-m", "tf_adasum.run", "-np", "1"]
        for megabytes in args.megabytes:
            for per_line in args.frames_per_line:
                task = [writer, str(megabytes), str(per_line)]
                runs = {
                    "alone": [sys.executable, *task],
                    "launcher": [*launcher, *task],
                    "launcher_files": [*launcher, "--output-filename", os.path.join(folder, "out"), *task],
                }
                seconds(runs["alone"], env)  # warm-up: the page cache, Python's start
                times: dict[str, list[float]] = {name: [] for name in runs}
                for _ in range(args.repeats):  # interleaved, so that the machine's load falls on each alike
                    for name, command in runs.items():
                        times[name].append(seconds(command, env))
                median = {name: statistics.median(ts) for name, ts in times.items()}
                print(
                    json.dumps(
                        {
                            "megabytes": megabytes,
                            "frames_per_line": per_line,
                            **{f"{name}_s": round(t, 3) for name, t in median.items()},
                            "launcher_x_alone": round(median["launcher"] / median["alone"], 2),
                            "launcher_files_x_alone": round(median["launcher_files"] / median["alone"], 2),
                        }
                    ),
                    flush=True,
                )


if __name__ == "__main__":
    main()
