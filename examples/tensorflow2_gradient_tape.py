"""A TensorFlow 2 GradientTape loop in Horovod's style, on tf_adasum: one process per worker.

Usage:
    mpirun -np 2 python examples/tensorflow2_gradient_tape.py [--op adasum|average|adasum-gradients]
    python -m tf_adasum.run -np 2 examples/tensorflow2_gradient_tape.py
    horovodrun -np 2 -H localhost:2 python examples/tensorflow2_gradient_tape.py

The loop is the one horovod.tensorflow teaches (GradientTape, DistributedGradientTape, a broadcast of
the variables after the first step), with `import tf_adasum.tensorflow as hvd` as the import. Each
process trains on its own shard of scikit-learn's digits; rank 0 prints the held-out accuracy.

--op chooses how the processes combine their work:
    adasum            the paper's Adasum after the optimizer: a plain tape, and the optimizer wrapped
                      by hvd.DistributedOptimizer(op=hvd.Adasum); the one-worker learning rate
    average           Horovod's gradient average (DistributedGradientTape), learning rate times size
    adasum-gradients  Horovod's Adasum of the gradients (DistributedGradientTape(op=hvd.Adasum))

--save DIR writes each rank's final weights to DIR/weights<rank>.npz (they are the same on every rank).
"""

from __future__ import annotations

import argparse
import os

# The one import that names tf_adasum, first: TensorFlow then starts without its C++ start-up log, and
# under tf_adasum.run or horovodrun the TF engine starts before TensorFlow runs an op.
import tf_adasum.tensorflow as hvd

# isort: split
import keras
import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--op", choices=["adasum", "average", "adasum-gradients"], default="adasum")
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--save", default="")
args = parser.parse_args()

hvd.init()
keras.utils.set_random_seed(hvd.rank())  # different initial weights per rank: the broadcast fixes them

digits = load_digits()
images = (digits.images[..., None] / 16.0).astype(np.float32)
labels = digits.target.astype(np.int64)
held_out = 297
x_train, y_train = images[held_out:][hvd.rank() :: hvd.size()], labels[held_out:][hvd.rank() :: hvd.size()]
steps_per_epoch = (len(images) - held_out) // hvd.size() // args.batch_size  # the same on every rank
dataset = (
    tf.data.Dataset.from_tensor_slices((x_train, y_train))
    .shuffle(len(x_train), seed=hvd.rank())
    .batch(args.batch_size, drop_remainder=True)
    .take(steps_per_epoch)
)

model = keras.Sequential(
    [
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(16, 3, activation="relu"),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10),
    ]
)
loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
if args.op == "adasum":
    # Adasum after the optimizer: each rank steps with its own Adam state; the model deltas are combined.
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(1e-3), op=hvd.Adasum)
else:
    opt = keras.optimizers.Adam(1e-3 * hvd.size())  # Horovod's rule for an average of gradients


@tf.function
def training_step(images: tf.Tensor, labels: tf.Tensor, first_batch: bool) -> tf.Tensor:
    with tf.GradientTape() as tape:
        loss_value = loss_fn(labels, model(images, training=True))
    if args.op != "adasum":
        tape = hvd.DistributedGradientTape(
            tape, op=hvd.Adasum if args.op == "adasum-gradients" else hvd.Average
        )
    grads = tape.gradient(loss_value, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
    # Every rank starts from rank 0's weights and optimizer state. (The Adasum optimizer broadcasts the
    # weights when it is built, and its state is each rank's own: nothing to broadcast there.)
    if first_batch and args.op != "adasum":
        hvd.broadcast_variables(model.variables, root_rank=0)
        hvd.broadcast_variables(opt.variables, root_rank=0)
    return loss_value


for epoch in range(args.epochs):
    for batch, (x, y) in enumerate(dataset):
        loss_value = training_step(x, y, epoch == 0 and batch == 0)
    if hvd.rank() == 0:
        print(f"epoch {epoch + 1}: loss {float(loss_value):.4f}")

if hvd.rank() == 0:
    predictions = np.argmax(model.predict(images[:held_out], verbose=0), axis=1)
    print(f"held-out accuracy {np.mean(predictions == labels[:held_out]):.3f}")
if args.save:
    os.makedirs(args.save, exist_ok=True)
    np.savez(os.path.join(args.save, f"weights{hvd.rank()}.npz"), *model.get_weights())
