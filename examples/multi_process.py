"""Several processes, one device each: the same script under mpirun, horovodrun --mpi or TF_CONFIG.

Usage:
    mpirun -np 2 python examples/multi_process.py                 # MPI; as root, also set
                                                                  # OMPI_ALLOW_RUN_AS_ROOT(_CONFIRM)=1
    horovodrun --mpi -np 2 python examples/multi_process.py       # Horovod's launcher, MPI mode
    python -m tf_adasum.run -np 2 examples/multi_process.py       # TF_CONFIG on 127.0.0.1
    # or set TF_CONFIG yourself on each machine (Kubernetes TFJob, Slurm) and run the script.

Every process gets the same arrays; AdasumStrategy hands each its share of every global batch,
combines the model updates with Adasum and averages the logs over processes.
"""

import tf_adasum  # first: TensorFlow then starts without its C++ start-up log

# isort: split
import keras
import numpy as np
from sklearn.datasets import load_digits

strategy = tf_adasum.AdasumStrategy()
digits = load_digits()
x, y = (digits.images / 16.0).astype(np.float32)[..., None], digits.target
with strategy.scope():
    model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Flatten(), keras.layers.Dense(10)])
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
model.fit(x, y, batch_size=64, epochs=5, verbose=2 if tf_adasum.rank() == 0 else 0)
accuracy = model.evaluate(x, y, verbose=0)[1]  # collective: every process evaluates its share
if tf_adasum.rank() == 0:
    print(f"accuracy over all processes: {accuracy:.3f}")
