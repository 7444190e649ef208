"""Horovod's DistributedOptimizer for a tf_keras (Keras 2) optimizer, one process per worker.

As Horovod does for Keras 2, the result is an optimizer of a subclass of the given optimizer's own class,
made from its config, so that `model.compile`, checkpoints and callbacks see the optimizer they know. Its
apply_gradients:

- op=Adasum: the paper's Adasum after the optimizer, as under Keras 3. The optimizer steps on this
  process's gradients with its own state (momentum, Adam's moments), then the step's deltas,
  `w_after - w_before`, are combined with the contract tree over every process, and every process holds
  `w_before + adasum(deltas)`. With backward_passes_per_step k > 1, k local steps between syncs: the
  deltas since the window opened, by the model sync AdasumCallback runs (training/model_sync.py).
- op=Average or Sum: the gradients are all-reduced before the optimizer, as Horovod does.

A non-finite update raises NonFiniteUpdateError on every process (the agreement before Adasum).

Also Horovod's load_model for a file tf_keras wrote (saved_by_keras_2, load_keras_2_model).
"""

from __future__ import annotations

import importlib
import json
import os
import zipfile
from typing import Any

import h5py
import tensorflow as tf

from tf_adasum import _compat, distributed
from tf_adasum._horovod.mpi_ops import grouped_allreduce
from tf_adasum.distributed import Adasum, Average, Sum
from tf_adasum.training import keras2_sync, model_sync
from tf_adasum.training.optimizer_options import accumulate_then_step


def _step_then_adasum(self: Any, grads_and_vars: Any, *args: Any, **kwargs: Any) -> Any:
    keras2_sync.refuse_mixed_precision("DistributedOptimizer", "process")
    pairs = list(grads_and_vars)
    every = self._tf_adasum_every
    stats = model_sync.sync_stats(self)  # an OrthogonalityMonitor's, if one asked
    if every > 1 or stats is not None:  # the deltas since the window opened, as AdasumCallback's sync
        variables = [v for _, v in pairs]
        window = keras2_sync.window_variables(self, variables, every)
        step = lambda: super(type(self), self).apply_gradients(pairs, *args, **kwargs)  # noqa: E731
        compression = self._tf_adasum_compression.name
        return keras2_sync.step_in_window(self, step, variables, window, every, compression)
    synced = [v for g, v in pairs if g is not None]
    before = [tf.identity(v) for v in synced]  # read before the step: tf.function keeps program order
    iteration = super(type(self), self).apply_gradients(pairs, *args, **kwargs)
    deltas = [v - b for v, b in zip(synced, before, strict=True)]
    if deltas:
        combined = grouped_allreduce(deltas, op=Adasum, compression=self._tf_adasum_compression)
        for variable, start, delta in zip(synced, before, combined, strict=True):
            variable.assign(start + delta)
    return iteration


def _allreduce_then_step(self: Any, grads_and_vars: Any, *args: Any, **kwargs: Any) -> Any:
    keras2_sync.refuse_mixed_precision("DistributedOptimizer", "process")
    pairs = list(grads_and_vars)
    if self._tf_adasum_every > 1:
        return _accumulate_then_step(self, pairs, args, kwargs)
    return _reduce_then_step(self, pairs, args, kwargs)


def _reduce_then_step(self: Any, pairs: list[Any], args: Any, kwargs: Any) -> Any:
    present = [i for i, (g, _) in enumerate(pairs) if g is not None]
    if present:
        op = self._tf_adasum_op
        reduced = grouped_allreduce(
            [pairs[i][0] for i in present], op=op, compression=self._tf_adasum_compression
        )
        for i, g in zip(present, reduced, strict=True):
            pairs[i] = (g, pairs[i][1])
    return super(type(self), self).apply_gradients(pairs, *args, **kwargs)


def _accumulate_then_step(self: Any, pairs: list[Any], args: Any, kwargs: Any) -> Any:
    """Horovod's gradient accumulation under tf_keras (accumulate_then_step), into accumulators this
    optimizer keeps per list of variables."""
    variables = [v for _, v in pairs]
    key = ("accumulated", *(id(v) for v in variables))
    windows = self.__dict__.setdefault("_tf_adasum_windows", {})
    with tf.init_scope():
        iterations = self.iterations  # tf_keras's legacy optimizers make it on first use
        if key not in windows:
            windows[key] = [
                tf.Variable(tf.zeros_like(v), trainable=False, name="accumulated_gradient") for v in variables
            ]
    grads = [g for g, _ in pairs]

    def step(summed: list[Any]) -> None:
        _reduce_then_step(self, list(zip(summed, variables, strict=True)), args, kwargs)

    accumulate_then_step(
        windows[key], grads, iterations, self._tf_adasum_every, self._tf_adasum_average, step
    )
    return iterations


def _register_local_var(self: Any, var: Any) -> None:
    raise NotImplementedError(
        "register_local_var on a tf_keras (Keras 2) optimizer: local variables are served under Keras 3 "
        "(keras.optimizers.*); with tf_keras every variable is combined"
    )


def keras_2_distributed_optimizer(
    optimizer: Any,
    op: distributed.ReduceOp,
    compression: Any,
    name: str | None,
    every: int = 1,
    average_aggregated: bool = False,
) -> Any:
    """`optimizer` (a tf_keras optimizer) remade as one whose apply_gradients runs Adasum after the step
    (op=Adasum), every `every` steps the deltas since the last sync, or all-reduces the gradients before
    it (Average, Sum), every `every` passes their sum (average_aggregated: their mean)."""
    if op not in (Adasum, Average, Sum):
        raise ValueError(f"DistributedOptimizer: op must be Adasum, Average or Sum, got {op}")
    cls = type(optimizer)
    apply = _step_then_adasum if op is Adasum else _allreduce_then_step
    distributed_class: Any = type(
        cls.__name__,
        (cls,),
        {
            "apply_gradients": apply,
            "register_local_var": _register_local_var,
            # BroadcastGlobalVariablesCallback: each process's optimizer state is its own under Adasum.
            "_tf_adasum_state_per_process": op is Adasum,
            "__module__": cls.__module__,
        },
    )
    config = optimizer.get_config()
    if name is not None:
        config["name"] = name
    distributed_optimizer = distributed_class.from_config(config)
    distributed_optimizer._tf_adasum_op = op
    distributed_optimizer._tf_adasum_compression = compression
    distributed_optimizer._tf_adasum_every = every
    distributed_optimizer._tf_adasum_average = average_aggregated
    return distributed_optimizer


def saved_by_keras_2(filepath: Any) -> bool:
    """Whether tf_keras (Keras 2) wrote this model file: a `.keras` archive or an HDF5 file whose
    keras_version is 2.x, or a SavedModel folder (which Keras 3 does not load). Read from the file, so
    that a process with either Keras loads either file."""
    path = os.fspath(filepath)
    if os.path.isdir(path):
        return os.path.exists(os.path.join(path, "saved_model.pb"))
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as archive:
            if "metadata.json" not in archive.namelist():
                return False
            version = json.loads(archive.read("metadata.json")).get("keras_version", "")
    elif h5py.is_hdf5(path):
        with h5py.File(path, "r") as h5:
            version = h5.attrs.get("keras_version", "")
    else:
        return False
    version = version.decode() if isinstance(version, bytes) else str(version)
    return version.startswith("2.")


def load_keras_2_model(
    filepath: Any, custom_objects: dict[str, Any], compression: Any, op: distributed.ReduceOp
) -> Any:
    """Horovod's load_model for a file tf_keras wrote: tf_keras loads it, and its optimizer comes back as
    DistributedOptimizer(op=op) of its own class, with the state tf_keras restored (moved over
    variable by variable). An optimizer that is distributed already (a user's class) is kept."""
    try:
        tf_keras = importlib.import_module("tf_keras")
    except ImportError as e:
        raise ImportError(
            f"load_model: {os.fspath(filepath)} was written by tf_keras (Keras 2), which is not installed: "
            f"pip install 'tf-keras~={tf.__version__.rsplit('.', 1)[0]}.0'"
        ) from e
    model = tf_keras.models.load_model(filepath, custom_objects=custom_objects)
    loaded = getattr(model, "optimizer", None)
    if loaded is None or hasattr(loaded, "_tf_adasum_op") or _compat.keras_2_name(loaded) is None:
        return model
    remade = keras_2_distributed_optimizer(loaded, op, compression, None)
    _compat.build_optimizer(loaded, model.trainable_variables)
    _compat.build_optimizer(remade, model.trainable_variables)
    state, new = _compat.optimizer_variables(loaded), _compat.optimizer_variables(remade)
    if len(state) != len(new):
        raise ValueError(
            f"load_model: {type(loaded).__name__} from {os.fspath(filepath)} has {len(state)} state "
            f"variables, and the same optimizer made distributed has {len(new)}: its state cannot be moved"
        )
    for target, value in zip(new, state, strict=True):
        target.assign(value)
    model.optimizer = remade
    return model
