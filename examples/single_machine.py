"""One process, several devices: swap MirroredStrategy for AdasumStrategy.

Usage:
    python examples/single_machine.py            # all GPUs, or 4 logical CPUs when there is none
"""

import tf_adasum  # first: TensorFlow then starts without its C++ start-up log

# isort: split
import keras
import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits

if not tf.config.list_physical_devices("GPU"):
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 4)
    devices = [d.name for d in tf.config.list_logical_devices("CPU")]
else:
    devices = None

digits = load_digits()
x, y = (digits.images / 16.0).astype(np.float32)[..., None], digits.target

strategy = tf_adasum.AdasumStrategy(devices)  # was: tf.distribute.MirroredStrategy(devices)
with strategy.scope():
    model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Flatten(), keras.layers.Dense(10)])
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
model.fit(x, y, batch_size=64, epochs=5, validation_split=0.2)
