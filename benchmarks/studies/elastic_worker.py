"""One process of benchmarks/studies/elastic.py, started by `python -m tf_adasum.run --elastic`.

Horovod's elastic Keras recipe on tf_adasum: `import tf_adasum.keras as hvd`, a plain model.fit per
process on its own share, hvd.DistributedOptimizer(SGD(lr, momentum=0.9), op=Adasum or Average),
elastic.KerasState, @elastic.run and the three elastic callbacks. The model and the data are
convergence.py's (make_model, augmented_digits).

--model transformer: the LAMB study's 2-layer Transformer encoder on its pointer task (convergence.py's
make_transformer, pointer_data: 20,000 sequences, 2,000 held out), with Keras's LAMB at --lr.

Data: a global stream of training examples (one permutation per pass, from --seed). A global step of a
group of n processes consumes the next 32 * n examples of the stream, rank r the r-th 32; `state.seen`
(committed) says where the stream stands. So whatever the membership, each pass reads every example
once, and a group that resumes from a commit reads the same examples the lost steps read (when its size
is the same).

A fit "epoch" is --eval-every global steps; rank 0 evaluates on the held-out digits at each epoch's end.
UpdateBatchStateCallback resumes mid-epoch by reading and dropping the batches done; this script puts
that many placeholder batches in front of its data, so that the skip lands on `state.seen`.

Modes:
    train         the training run (--kill-step / --grow-step inject the membership changes)
    commit_cost   one fit in phases of --phase-steps steps: without commits, then a commit every 1, 10,
                  100 batches; every state.commit() timed with time.perf_counter

Every measurement is a line `@ev {json}` on stdout (the launcher prefixes `[rank] `), with time.time().
"""

from __future__ import annotations

import time

T_START = time.time()  # before any import: the process's start, give or take the interpreter's

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks" / "studies"))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

T_TENSORFLOW = time.time()

import tf_adasum  # noqa: E402, F401  (under the launcher this starts the collective engine)

T_ENGINE = time.time()

# isort: split
import keras  # noqa: E402
from convergence import LOCAL_BATCH, LOSS, make_model, make_transformer, pointer_data  # noqa: E402

import tf_adasum.keras as hvd  # noqa: E402
from tf_adasum import elastic  # noqa: E402
from tf_adasum.demo import augmented_digits  # noqa: E402

T_IMPORTED = time.time()


def event(kind: str, **fields: Any) -> None:
    line = {
        "ev": kind,
        "t": time.time(),
        "group": elastic.generation(),
        "rank": hvd.rank(),
        "size": hvd.size(),
    }
    line.update(fields)
    print("@ev " + json.dumps(line), flush=True)


def stream_indices(start: int, steps: int, size: int, rank: int, count: int, seed: int) -> np.ndarray:
    """[steps, LOCAL_BATCH] indices of this rank's examples for the next `steps` global steps from
    stream position `start`."""
    offsets = (
        start + LOCAL_BATCH * size * np.arange(steps)[:, None] + LOCAL_BATCH * rank + np.arange(LOCAL_BATCH)
    )
    passes = offsets // count
    out = np.empty_like(offsets)
    for p in np.unique(passes):
        order = np.random.default_rng([seed, int(p)]).permutation(count)
        where = passes == p
        out[where] = order[offsets[where] % count]
    return out


class Measure(keras.callbacks.Callback):
    """Counts global steps (not the batches UpdateBatchStateCallback drops on a resume: their logs are
    empty), logs the group's first step, evaluates on rank 0 at every epoch's end, and injects the
    membership changes. Must come before CommitStateCallback, so that a commit holds its counts."""

    def __init__(
        self, state: Any, args: argparse.Namespace, validation: tuple[np.ndarray, np.ndarray]
    ) -> None:
        super().__init__()
        self.state, self.args, self.validation = state, args, validation
        self.first = True
        self.batch_started = 0.0
        self.step_seconds: list[float] = []

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        args, step = self.args, int(self.state.step)
        if elastic.generation() == 0 and step == args.kill_step and hvd.rank() in args.kill_ranks:
            if hvd.rank() == min(args.kill_ranks):
                Path(args.discovery_file).write_text(f"127.0.0.1:{args.np - len(args.kill_ranks)}\n")
            event("kill", step=step)
            os.kill(os.getpid(), signal.SIGKILL)
        if (
            hvd.rank() == 0
            and args.grow_step >= 0
            and step >= args.grow_step
            and hvd.size() < args.np
            and Path(args.discovery_file).read_text().strip() != f"127.0.0.1:{args.np}"
        ):
            Path(args.discovery_file).write_text(f"127.0.0.1:{args.np}\n")
            event("grow", step=step)
        self.batch_started = time.perf_counter()

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if not logs:  # a batch UpdateBatchStateCallback read and dropped
            return
        self.step_seconds.append(time.perf_counter() - self.batch_started)
        self.state.step += 1
        self.state.seen += LOCAL_BATCH * hvd.size()
        if self.first:
            self.first = False
            event("first_step", step=int(self.state.step), cpu=time.process_time())

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        times, self.step_seconds = self.step_seconds, []
        if hvd.rank() != 0:
            return
        x_val, y_val = self.validation
        logits = self.model.predict(x_val, batch_size=1024, verbose=0)
        loss = float(np.mean(LOSS(y_val, logits)))
        event(
            "eval",
            step=int(self.state.step),
            epoch=epoch + 1,
            seen=int(self.state.seen),
            accuracy=float(np.mean(np.argmax(logits, 1) == y_val)),
            loss=loss,
            lr=float(np.asarray(self.model.optimizer.learning_rate)),
            step_ms=1e3 * statistics.median(times) if times else None,
        )


def setup(args: argparse.Namespace) -> tuple[Any, ...]:
    hvd.init()
    if args.model == "transformer":  # the LAMB study's pointer task: 20k sequences, 2k held out
        x, y, x_val, y_val = pointer_data(20_000)
    else:
        x, y, x_val, y_val = augmented_digits(Path(args.data))
    if args.train_examples:
        x, y = x[: args.train_examples], y[: args.train_examples]
    keras.utils.set_random_seed(args.seed)
    model = make_transformer() if args.model == "transformer" else make_model()
    op = hvd.Adasum if args.op == "adasum" else hvd.Average
    lr = args.lr * (hvd.size() if args.lr_rule == "size" else 1)
    if args.model == "transformer":
        inner = keras.optimizers.Lamb(lr)
    else:
        inner = keras.optimizers.SGD(lr, momentum=0.9)
    model.compile(optimizer=hvd.DistributedOptimizer(inner, op=op), loss=LOSS)
    state = elastic.KerasState(model, epoch=0, batch=0, step=0, seen=0)
    return x, y, x_val, y_val, model, state


def train(args: argparse.Namespace) -> None:
    x, y, x_val, y_val, model, state = setup(args)
    event("ready", start=T_START, tensorflow=T_TENSORFLOW, engine=T_ENGINE, imported=T_IMPORTED)

    def rescale() -> None:  # Horovod's rule: the learning rate follows the group's size
        lr = args.lr * hvd.size()
        model.optimizer.learning_rate = lr
        event("reset_callback", lr=lr)

    if args.lr_rule == "size":
        state.register_reset_callbacks([rescale])

    @elastic.run
    def fit(state: Any) -> None:
        lr_after_sync = float(np.asarray(model.optimizer.learning_rate))
        event(
            "synced",
            step=int(state.step),
            epoch=int(state.epoch),
            batch=int(state.batch),
            lr=lr_after_sync,
            cpu=time.process_time(),
        )
        if args.lr_rule == "size" and abs(lr_after_sync - args.lr * hvd.size()) > 1e-6 * args.lr * hvd.size():
            # Before 767f3fe the sync restored the committed learning rate over the reset callback's (see
            # the README's elastic section): counted, and set again here, where Horovod's recipe has it.
            model.optimizer.learning_rate = args.lr * hvd.size()
            event("lr_overwritten_by_sync", lr=lr_after_sync, set_to=args.lr * hvd.size())
        total = args.steps - int(state.step)
        skip = int(state.batch)
        idx = stream_indices(int(state.seen), total, hvd.size(), hvd.rank(), len(y), args.seed)
        idx = np.concatenate([idx[:skip] if skip <= len(idx) else np.zeros((skip, LOCAL_BATCH), int), idx])
        flat = idx.reshape(-1)
        data = tf.data.Dataset.from_tensor_slices((x[flat], y[flat])).batch(LOCAL_BATCH)
        model.fit(
            data,
            steps_per_epoch=args.eval_every,
            epochs=args.steps // args.eval_every,
            initial_epoch=int(state.epoch),
            shuffle=False,
            verbose=0,
            callbacks=[
                elastic.UpdateEpochStateCallback(state),
                elastic.UpdateBatchStateCallback(state),
                Measure(state, args, (x_val, y_val)),
                elastic.CommitStateCallback(state, batches_per_commit=args.batches_per_commit),
            ],
        )

    fit(state)
    event("done", step=int(state.step))


WARMUP_STEPS = 10  # untimed: tracing and the first steps


def commit_cost(args: argparse.Namespace) -> None:
    """One fit of WARMUP_STEPS + 5 phases of --phase-steps global steps: without commits (the baseline),
    a commit every 1, 10 and 100 batches, as CommitStateCallback makes them (state.commit() after the
    batch), and without commits again (the baseline's second half, against drift on a shared machine).
    Each commit is timed on its own, and the ranks' meeting inside it (check_host_updates: rank 0's
    notice, one collective) on its own; each step from its batch's begin to its end.

    One fit, not one per phase: in 8-process jobs here fit took up to 40 s to return on some ranks after
    its last batch (in C++, below keras's error_handler: fit's frame torn down), and the next collective
    timed out (see the README)."""
    x, y, _, _, model, state = setup(args)
    event("ready", start=T_START, tensorflow=T_TENSORFLOW, engine=T_ENGINE, imported=T_IMPORTED)
    phases = [0, 1, 10, 100, 0]
    steps = args.phase_steps
    commit, check = state.commit, state.check_host_updates
    check_seconds: list[float] = []

    def timed_check() -> None:
        started = time.perf_counter()
        check()
        check_seconds.append(time.perf_counter() - started)

    state.check_host_updates = timed_check

    class Phases(keras.callbacks.Callback):
        def __init__(self) -> None:
            super().__init__()
            self.step_seconds: list[list[float]] = [[] for _ in phases]
            self.commit_seconds: list[list[float]] = [[] for _ in phases]
            self.meeting_seconds: list[list[float]] = [[] for _ in phases]
            # Per phase: its first batch's end, its last batch's end (after the commit, if any).
            self.spans = [[0.0, 0.0] for _ in phases]
            self.begin = 0.0

        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            self.begin = time.perf_counter()

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            end = time.perf_counter()
            if batch < WARMUP_STEPS:
                return
            phase, i = divmod(batch - WARMUP_STEPS, steps)
            self.step_seconds[phase].append(end - self.begin)
            every = phases[phase]
            if every and (i + 1) % every == 0:
                check_seconds.clear()
                commit()
                done = time.perf_counter()
                self.commit_seconds[phase].append(done - end)
                self.meeting_seconds[phase].extend(check_seconds)
                end = done
            if i == 0:
                self.spans[phase][0] = end
            self.spans[phase][1] = end

    timer = Phases()

    @elastic.run
    def run_phases(state: Any) -> None:
        total = WARMUP_STEPS + len(phases) * steps
        idx = stream_indices(0, total, hvd.size(), hvd.rank(), len(y), args.seed).reshape(-1)
        data = tf.data.Dataset.from_tensor_slices((x[idx], y[idx])).batch(LOCAL_BATCH)
        model.fit(data, steps_per_epoch=total, epochs=1, shuffle=False, verbose=0, callbacks=[timer])

    run_phases(state)
    for p, every in enumerate(phases):
        commits, meetings = timer.commit_seconds[p], timer.meeting_seconds[p]
        event(
            "commit_phase",
            phase=p,
            batches_per_commit=every,
            steps=steps,
            step_ms=1e3 * statistics.median(timer.step_seconds[p]),
            mean_step_ms=1e3 * statistics.mean(timer.step_seconds[p]),
            per_step_ms=1e3 * (timer.spans[p][1] - timer.spans[p][0]) / (steps - 1),
            commits=len(commits),
            commit_ms=1e3 * statistics.median(commits) if commits else 0.0,
            commit_max_ms=1e3 * max(commits) if commits else 0.0,
            meeting_ms=1e3 * statistics.median(meetings) if meetings else 0.0,
        )
    event("done")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("mode", choices=["train", "commit_cost"])
    parser.add_argument("--data", required=True, help="augmented_digits' cache file")
    parser.add_argument("--train-examples", type=int, default=0, help="the first N training images (0: all)")
    parser.add_argument("--op", choices=["adasum", "average"], default="adasum")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--model", choices=["cnn", "transformer"], default="cnn")
    parser.add_argument("--lr-rule", choices=["fixed", "size"], default="fixed", help="size: lr * hvd.size()")
    parser.add_argument("--steps", type=int, default=300, help="global steps in all")
    parser.add_argument("--eval-every", type=int, default=20, help="global steps per fit epoch")
    parser.add_argument("--batches-per-commit", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--np", type=int, default=8, help="the full group's size")
    parser.add_argument("--kill-step", type=int, default=-1, help="group 0's --kill-ranks die at this step")
    parser.add_argument("--kill-ranks", type=int, nargs="*", default=[])
    parser.add_argument("--grow-step", type=int, default=-1, help="rank 0 re-adds the slots at this step")
    parser.add_argument("--discovery-file", default="")
    parser.add_argument("--phase-steps", type=int, default=100, help="commit_cost: steps per phase")
    args = parser.parse_args()
    if args.steps % args.eval_every:
        parser.error("--steps must be a multiple of --eval-every")
    if args.mode == "train":
        train(args)
    else:
        commit_cost(args)


if __name__ == "__main__":
    main()
