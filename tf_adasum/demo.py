"""MirroredStrategy against AdasumStrategy with 8 replicas and the single-replica learning rate.

Usage:
    python -m tf_adasum.demo [--replicas 8] [--epochs 4] [--out demo_output]

The setting of the paper's experiment: a fixed budget of epochs, so 8 replicas take 8 times fewer
steps than one, and an aggressive warm-up and decay schedule tuned for one replica, left unchanged.
MirroredStrategy averages the replicas' gradients: with the same learning rate, 8 times fewer steps
cover much less ground. AdasumStrategy lets every replica take its own step and adds the parts of
the steps that are orthogonal, so it keeps more of the progress.

The data are scikit-learn's digits, grown to ~20k 16x16 images with random shifts, rotations and
noise (generated in seconds, cached under --out); the validation images are copies of originals held
out before augmenting, so none of them has a copy in the training set. Prints a table (final
validation accuracy, steps to reach the target) and saves a plot of validation accuracy per step.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import numpy as np

SIZE = 16
COPIES, VALIDATION_COPIES, HELD_OUT = 14, 4, 0.2


def augmented_digits(
    cache: Path, seed: int = 0, copies: int = COPIES, validation_copies: int = VALIDATION_COPIES
) -> tuple[np.ndarray, ...]:
    """~20k training and ~1.4k validation 16x16 digits, none of the validation ones seen in training.

    The 1,797 originals are split first: 20% are held out. Each training original, upscaled, gives
    `copies` randomly moved, noisy copies (14); each held-out original gives `validation_copies` (4).
    So validation accuracy measures digits the model has never seen in any form, not copies of its
    training images.
    """
    if cache.exists():
        data = np.load(cache)
        return tuple(data[k] for k in ("x", "y", "x_val", "y_val"))
    from scipy import ndimage
    from sklearn.datasets import load_digits

    digits = load_digits()
    rng = np.random.default_rng(seed)
    base = np.kron(digits.images / 16.0, np.ones((2, 2)))  # 8x8 -> 16x16
    order = rng.permutation(len(base))
    held_out = int(len(base) * HELD_OUT)

    def moved_copies(indices: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]:
        images, labels = [], []
        for i in indices:
            for _ in range(count):
                moved = ndimage.rotate(base[i], rng.uniform(-20, 20), reshape=False, order=1)
                moved = ndimage.shift(moved, rng.uniform(-2, 2, size=2), order=1)
                images.append(np.clip(moved + rng.normal(0, 0.15, moved.shape), 0, 1))
                labels.append(digits.target[i])
        mixed = rng.permutation(len(labels))
        return np.asarray(images, np.float32)[mixed, ..., None], np.asarray(labels, np.int32)[mixed]

    x, y = moved_copies(order[held_out:], copies)
    x_val, y_val = moved_copies(order[:held_out], validation_copies)
    cache.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(cache, x=x, y=y, x_val=x_val, y_val=y_val)
    return x, y, x_val, y_val


def make_model() -> Any:
    import keras

    return keras.Sequential(
        [
            keras.Input((SIZE, SIZE, 1)),
            keras.layers.Conv2D(16, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10),
        ]
    )


def schedule(total_steps: int, peak: float) -> Any:
    """Linear warm-up over the first 10% of the steps, then cosine decay to zero."""
    import keras

    warmup = max(1, total_steps // 10)
    return keras.optimizers.schedules.CosineDecay(
        0.0, decay_steps=total_steps - warmup, warmup_target=peak, warmup_steps=warmup
    )


def train(
    strategy: Any, data: tuple[np.ndarray, ...], args: argparse.Namespace
) -> tuple[list[int], list[float]]:
    """Trains for args.epochs; returns (steps, validation accuracy) measured every few steps."""
    import keras

    x, y, x_val, y_val = data
    global_batch = args.local_batch * strategy.num_replicas_in_sync
    # Whole global batches only: a ragged last batch, split unevenly over the replicas, makes Keras
    # trace its train function again, which costs more than the few images it holds.
    whole = len(y) // global_batch * global_batch
    x, y = x[:whole], y[:whole]
    total = whole // global_batch * args.epochs
    keras.utils.set_random_seed(args.seed)
    with strategy.scope():
        model = make_model()
        # The one-replica schedule, unchanged: the same peak rate, warm-up and decay over the epochs.
        optimizer = keras.optimizers.SGD(schedule(total, args.lr), momentum=0.9)
        model.compile(
            optimizer=optimizer,
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    points: list[int] = []
    accuracy: list[float] = []
    every = max(1, total // 24)

    # At a probe every replica holds the same weights, so one forward pass of the model gives the
    # validation accuracy; Keras's evaluate() would distribute the validation set anew each time.
    import tensorflow as tf

    logits_of = tf.function(lambda images: model(images, training=False))
    val_images = tf.constant(x_val)

    class Probe(keras.callbacks.Callback):
        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            step = int(self.model.optimizer.iterations.numpy())
            if step % every == 0 or step == total:
                predicted = np.argmax(logits_of(val_images).numpy(), axis=1)
                points.append(step)
                accuracy.append(float(np.mean(predicted == y_val)))

    model.fit(x, y, batch_size=global_batch, epochs=args.epochs, verbose=0, callbacks=[Probe()])
    return points, accuracy


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--local-batch", type=int, default=32)
    parser.add_argument(
        "--lr", type=float, default=0.05, help="peak learning rate of the one-replica schedule"
    )
    parser.add_argument("--target", type=float, default=0.9, help="validation accuracy to reach")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("demo_output"))
    args = parser.parse_args()

    import tensorflow as tf

    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * args.replicas
    )
    import tf_adasum

    start = time.perf_counter()
    data = augmented_digits(args.out / "digits16_held_out.npz")
    print(
        f"data: {len(data[1])} training and {len(data[3])} validation images, {SIZE}x{SIZE} "
        f"({time.perf_counter() - start:.1f} s)"
    )
    devices = [d.name for d in tf.config.list_logical_devices("CPU")]
    runs = {
        "MirroredStrategy (mean)": tf.distribute.MirroredStrategy(
            devices, cross_device_ops=tf.distribute.ReductionToOneDevice()
        ),
        "AdasumStrategy": tf_adasum.AdasumStrategy(devices),
    }
    curves = {}
    for name, strategy in runs.items():
        start = time.perf_counter()
        curves[name] = train(strategy, data, args)
        print(f"{name}: trained in {time.perf_counter() - start:.0f} s")

    print(
        f"\n{args.replicas} replicas x batch {args.local_batch}, {args.epochs} epochs, one-replica "
        f"learning-rate schedule (peak {args.lr}), unchanged"
    )
    print(f"{'strategy':<26} {'final val. accuracy':>20} {f'steps to {args.target:.0%}':>16}")
    for name, (steps, accuracy) in curves.items():
        reached = next((s for s, a in zip(steps, accuracy, strict=True) if a >= args.target), None)
        print(f"{name:<26} {accuracy[-1]:>20.3f} {reached if reached is not None else 'not reached':>16}")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for name, (steps, accuracy) in curves.items():
        axes.plot(steps, accuracy, marker="o", markersize=3, label=name)
    axes.axhline(args.target, color="grey", linestyle=":", linewidth=1, label=f"target {args.target:.0%}")
    axes.set_xlabel("optimizer step")
    axes.set_ylabel("validation accuracy")
    axes.set_title(f"{args.replicas} replicas, single-replica learning rate, {args.epochs} epochs")
    axes.set_ylim(0, 1)
    axes.legend(loc="lower right")
    figure.tight_layout()
    plot = args.out / "validation_accuracy.png"
    figure.savefig(plot, dpi=120)
    print(f"\nplot: {plot}")


if __name__ == "__main__":
    main()
