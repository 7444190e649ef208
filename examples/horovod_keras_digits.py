"""A Horovod-style Keras script on tf_adasum: `import tf_adasum.keras as hvd`, and the rest is how Horovod
users write their training scripts (one process per GPU or CPU, the learning rate scaled by the number
of workers and warmed up, metrics averaged, checkpoints on rank 0).

Adasum is one argument: `op=hvd.Adasum` in DistributedOptimizer applies it after the optimizer, as the
Adasum paper does; leave it out for Horovod's gradient average.

It is written with `tf.keras`, as Horovod's examples are: Keras 3, or with TF_USE_LEGACY_KERAS=1 the
Keras 2 of `tf_keras` (pip install tf-keras of the TensorFlow's minor release), unchanged.

Run it with any of:
    horovodrun -np 2 -H localhost:2 python examples/horovod_keras_digits.py
    mpirun -np 2 python examples/horovod_keras_digits.py
    python -m tf_adasum.run -np 2 examples/horovod_keras_digits.py
    TF_USE_LEGACY_KERAS=1 python -m tf_adasum.run -np 2 examples/horovod_keras_digits.py
"""

# First, before TensorFlow: tf_adasum then imports TensorFlow without its C++ start-up log, and under
# horovodrun's Gloo mode or tf_adasum.run starts TensorFlow's collective runtime before any op.
import tf_adasum.keras as hvd

# isort: split
import os

import numpy as np
import tensorflow as tf

keras = tf.keras  # Keras 3, or tf_keras under TF_USE_LEGACY_KERAS=1

EPOCHS = int(os.environ.get("EPOCHS", "24"))  # the schedule; the tests run a shorter one
STEPS = int(os.environ.get("STEPS", "500"))  # global batches per epoch, shared among the workers


def digits() -> tf.data.Dataset:
    """scikit-learn's 8x8 digits (nothing to download), scaled to [0, 1], repeated and shuffled."""
    from sklearn.datasets import load_digits

    data = load_digits()
    images = (data.images[..., np.newaxis] / 16.0).astype(np.float32)
    return tf.data.Dataset.from_tensor_slices((images, data.target)).repeat().shuffle(10000).batch(128)


def make_model() -> tf.keras.Model:
    return keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.Conv2D(64, 3, activation="relu"),
            keras.layers.MaxPooling2D(2),
            keras.layers.Dropout(0.25),
            keras.layers.Flatten(),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dropout(0.5),
            keras.layers.Dense(10, activation="softmax"),
        ]
    )


def train() -> tf.keras.Model:
    hvd.init()
    # One GPU per process, where there are GPUs.
    gpus = tf.config.list_physical_devices("GPU")
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)
    if gpus:
        tf.config.set_visible_devices(gpus[hvd.local_rank()], "GPU")

    model = make_model()
    # The learning rate scaled by the number of workers, as Horovod scripts do; with Adasum the
    # one-worker rate usually works as it is.
    scaled_lr = 0.001 * hvd.size()
    optimizer = hvd.DistributedOptimizer(keras.optimizers.Adam(scaled_lr), op=hvd.Adasum)
    model.compile(loss="sparse_categorical_crossentropy", optimizer=optimizer, metrics=["accuracy"])

    callbacks = [
        # Every worker starts from rank 0's weights (random, or restored from a checkpoint).
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        # Epoch logs averaged over workers; before any callback that reads them.
        hvd.callbacks.MetricAverageCallback(),
        # From scaled_lr / size up to scaled_lr over the first three epochs (arXiv 1706.02677).
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=3, verbose=1),
    ]
    if hvd.rank() == 0:  # one writer, so that workers do not overwrite each other's checkpoints
        callbacks.append(keras.callbacks.ModelCheckpoint("./checkpoint-{epoch}.keras"))

    model.fit(
        digits(),
        steps_per_epoch=STEPS // hvd.size(),  # each worker's share of the epoch
        epochs=EPOCHS,
        callbacks=callbacks,
        verbose=1 if hvd.rank() == 0 else 0,
    )
    return model


if __name__ == "__main__":
    train()
