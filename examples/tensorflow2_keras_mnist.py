# Horovod's examples/tensorflow2/tensorflow2_keras_mnist.py (Apache-2.0, Copyright 2019 Uber
# Technologies, Inc.), ported to tf_adasum. The changes, each marked "tf_adasum:" below:
#   1. the import line: `import tf_adasum.keras as hvd` instead of `import horovod.tensorflow.keras as hvd`;
#   2. `op=hvd.Adasum` in DistributedOptimizer;
#   3. a Keras 3 compile() call: Keras 3 has no `experimental_run_tf_function`;
#   4. offline data: scikit-learn's 8x8 digits instead of downloading MNIST;
#   5. Keras 3 saves whole models as `.keras`, not `.h5`;
#   6. the epoch and step counts are named constants, so that the tests can run a shorter schedule.
#   7. that import comes first, before TensorFlow's, so that the program starts without TensorFlow's
#      C++ start-up log.
# Everything else is Horovod's example as it stands.
#
# Run it with any of:
#   horovodrun -np 2 -H localhost:2 python examples/tensorflow2_keras_mnist.py
#   mpirun -np 2 python examples/tensorflow2_keras_mnist.py
#   python -m tf_adasum.run -np 2 examples/tensorflow2_keras_mnist.py

import sys

# tf_adasum: the one import that changes, first: it imports TensorFlow without its C++ start-up log.
import tf_adasum.keras as hvd

# isort: split
import tensorflow as tf

# tf_adasum: Horovod's schedule (24 epochs of 500 // size steps); tests set shorter ones.
EPOCHS = 24
STEPS = 500


def load_data():
    # tf_adasum: scikit-learn ships the digits, so nothing is downloaded.
    from sklearn.datasets import load_digits

    digits = load_digits()
    return digits.images, digits.target


def train():
    # Horovod: initialize Horovod.
    hvd.init()

    # Horovod: pin GPU to be used to process local rank (one GPU per process)
    gpus = tf.config.experimental.list_physical_devices('GPU')
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)
    if gpus:
        tf.config.experimental.set_visible_devices(gpus[hvd.local_rank()], 'GPU')

    mnist_images, mnist_labels = load_data()

    dataset = tf.data.Dataset.from_tensor_slices(
        (tf.cast(mnist_images[..., tf.newaxis] / 16.0, tf.float32),
                 tf.cast(mnist_labels, tf.int64))
    )
    dataset = dataset.repeat().shuffle(10000).batch(128)

    mnist_model = tf.keras.Sequential([
        tf.keras.layers.Conv2D(32, [3, 3], activation='relu'),
        tf.keras.layers.Conv2D(64, [3, 3], activation='relu'),
        tf.keras.layers.MaxPooling2D(pool_size=(2, 2)),
        tf.keras.layers.Dropout(0.25),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(128, activation='relu'),
        tf.keras.layers.Dropout(0.5),
        tf.keras.layers.Dense(10, activation='softmax')
    ])

    # Horovod: adjust learning rate based on number of GPUs.
    scaled_lr = 0.001 * hvd.size()
    opt = tf.optimizers.Adam(scaled_lr)

    # Horovod: add Horovod DistributedOptimizer.
    # tf_adasum: op=hvd.Adasum, which tf_adasum applies after the optimizer, as the Adasum paper does.
    opt = hvd.DistributedOptimizer(
        opt, backward_passes_per_step=1, average_aggregated_gradients=True, op=hvd.Adasum)

    # tf_adasum: Keras 3 has no `experimental_run_tf_function`.
    mnist_model.compile(loss=tf.losses.SparseCategoricalCrossentropy(),
                        optimizer=opt,
                        metrics=['accuracy'])

    callbacks = [
        # Horovod: broadcast initial variable states from rank 0 to all other processes.
        # This is necessary to ensure consistent initialization of all workers when
        # training is started with random weights or restored from a checkpoint.
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),

        # Horovod: average metrics among workers at the end of every epoch.
        #
        # Note: This callback must be in the list before the ReduceLROnPlateau,
        # TensorBoard or other metrics-based callbacks.
        hvd.callbacks.MetricAverageCallback(),

        # Horovod: using `lr = 1.0 * hvd.size()` from the very beginning leads to worse final
        # accuracy. Scale the learning rate `lr = 1.0` ---> `lr = 1.0 * hvd.size()` during
        # the first three epochs. See https://arxiv.org/abs/1706.02677 for details.
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=3, verbose=1),
    ]

    # Horovod: save checkpoints only on worker 0 to prevent other workers from corrupting them.
    if hvd.rank() == 0:
        # tf_adasum: `.keras`, the format Keras 3 saves whole models in.
        callbacks.append(tf.keras.callbacks.ModelCheckpoint('./checkpoint-{epoch}.keras'))

    # Horovod: write logs on worker 0.
    verbose = 1 if hvd.rank() == 0 else 0

    # Train the model.
    # Horovod: adjust number of steps based on number of GPUs.
    mnist_model.fit(dataset, steps_per_epoch=STEPS // hvd.size(), callbacks=callbacks, epochs=EPOCHS, verbose=verbose)

    # Return the model
    return mnist_model


if __name__ == '__main__':
    if len(sys.argv) == 4:
        # tf_adasum: no horovod.run; launch with horovodrun, mpirun or `python -m tf_adasum.run`.
        raise SystemExit('launch this script with horovodrun, mpirun or python -m tf_adasum.run')
    else:
        # this is running via horovodrun
        train()
