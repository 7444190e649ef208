"""A strategy.run training loop, as TensorFlow's "Custom training with tf.distribute.Strategy" writes it,
with AdasumStrategy in place of MirroredStrategy: the one line that changes.

Usage:
    python examples/custom_training_loop.py                       # the local devices (or logical CPUs)
    mpirun -np 2 python examples/custom_training_loop.py          # one device per process
    python -m tf_adasum.run -np 2 examples/custom_training_loop.py
    horovodrun -np 2 -H localhost:2 python examples/custom_training_loop.py

The optimizer is a plain Keras optimizer: its apply_gradients inside strategy.run runs Adasum after
the optimizer (each replica steps with its own state, then the model deltas are combined), at the
one-replica learning rate. The loss is scaled by the global batch (tf.nn.compute_average_loss), the
epoch loss summed with strategy.reduce, and the model and optimizer checkpointed every two epochs.

--replicas N uses N logical CPUs in one process; --save DIR writes each process's final weights to
DIR/weights<rank>.npz (the same on every process) and its checkpoints under DIR/ckpt<rank>.
"""

from __future__ import annotations

import argparse
import os
import tempfile

# First: TensorFlow then starts without its C++ start-up log, and under tf_adasum.run or horovodrun the
# TF engine starts before TensorFlow runs an op.
import tf_adasum

# isort: split
import keras
import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--epochs", type=int, default=4)
parser.add_argument("--replicas", type=int, default=0, help="logical CPUs in one process")
parser.add_argument("--save", default="")
args = parser.parse_args()

devices = None
if args.replicas:
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * args.replicas)
    devices = [d.name for d in tf.config.list_logical_devices("CPU")]

strategy = tf_adasum.AdasumStrategy(devices)  # was: tf.distribute.MirroredStrategy(devices)
rank = tf_adasum.rank()

digits = load_digits()
images = (digits.images[..., None] / 16.0).astype(np.float32)
labels = digits.target.astype(np.int64)
held_out = 297
train_images, train_labels = images[held_out:], labels[held_out:]
test_images, test_labels = images[:held_out], labels[:held_out]

BATCH_SIZE_PER_REPLICA = 16
GLOBAL_BATCH_SIZE = BATCH_SIZE_PER_REPLICA * strategy.num_replicas_in_sync  # every replica of every process

# Every process reads the same data; each takes its share of every global batch.
train_dataset = (
    tf.data.Dataset.from_tensor_slices((train_images, train_labels))
    .shuffle(len(train_images), seed=0)
    .batch(GLOBAL_BATCH_SIZE, drop_remainder=True)
)
test_dataset = tf.data.Dataset.from_tensor_slices((test_images, test_labels)).batch(
    GLOBAL_BATCH_SIZE, drop_remainder=True
)
train_dist_dataset = strategy.experimental_distribute_dataset(train_dataset)
test_dist_dataset = strategy.experimental_distribute_dataset(test_dataset)


def create_model() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input(
                (8, 8, 1)
            ),  # built here, before the loop (Keras 3 needs that for Adam under a strategy)
            keras.layers.Conv2D(16, 3, activation="relu"),
            keras.layers.Flatten(),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10),
        ]
    )


checkpoint_dir = os.path.join(args.save or tempfile.mkdtemp(), f"ckpt{rank}")  # one per process
checkpoint_prefix = os.path.join(checkpoint_dir, "ckpt")

with strategy.scope():
    loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)

    def compute_loss(labels: tf.Tensor, predictions: tf.Tensor) -> tf.Tensor:
        per_example_loss = loss_object(labels, predictions)
        return tf.nn.compute_average_loss(per_example_loss, global_batch_size=GLOBAL_BATCH_SIZE)

    test_loss = keras.metrics.Mean(name="test_loss")
    train_accuracy = keras.metrics.SparseCategoricalAccuracy(name="train_accuracy")
    test_accuracy = keras.metrics.SparseCategoricalAccuracy(name="test_accuracy")

    model = create_model()
    optimizer = keras.optimizers.Adam(1e-3)
    checkpoint = tf.train.Checkpoint(optimizer=optimizer, model=model)


def train_step(inputs: tuple[tf.Tensor, tf.Tensor]) -> tf.Tensor:
    images, labels = inputs
    with tf.GradientTape() as tape:
        predictions = model(images, training=True)
        loss = compute_loss(labels, predictions)
    gradients = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(gradients, model.trainable_variables, strict=True))
    train_accuracy.update_state(labels, predictions)
    return loss


def test_step(inputs: tuple[tf.Tensor, tf.Tensor]) -> None:
    images, labels = inputs
    predictions = model(images, training=False)
    test_loss.update_state(loss_object(labels, predictions))
    test_accuracy.update_state(labels, predictions)


@tf.function
def distributed_train_step(dataset_inputs: tuple[tf.Tensor, tf.Tensor]) -> tf.Tensor:
    per_replica_losses = strategy.run(train_step, args=(dataset_inputs,))
    return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica_losses, axis=None)


@tf.function
def distributed_test_step(dataset_inputs: tuple[tf.Tensor, tf.Tensor]) -> None:
    strategy.run(test_step, args=(dataset_inputs,))


for epoch in range(args.epochs):
    total_loss, num_batches = 0.0, 0
    for x in train_dist_dataset:
        total_loss += distributed_train_step(x)
        num_batches += 1
    train_loss = total_loss / num_batches
    for x in test_dist_dataset:
        distributed_test_step(x)
    if epoch % 2 == 0:
        checkpoint.save(checkpoint_prefix)
    # Reading a metric sums it over every replica of every process: every process reads them.
    accuracy, loss, test = (float(m.result()) for m in (train_accuracy, test_loss, test_accuracy))
    if rank == 0:
        print(
            f"epoch {epoch + 1}: loss {float(train_loss):.4f}, accuracy {accuracy:.3f}, "
            f"test loss {loss:.4f}, test accuracy {test:.3f}"
        )
    test_loss.reset_state()
    train_accuracy.reset_state()
    test_accuracy.reset_state()

if args.save:
    np.savez(os.path.join(args.save, f"weights{rank}.npz"), *model.get_weights())
