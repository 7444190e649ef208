"""Saving where a Keras user saves (tf.saved_model.save, model.export, .keras), from every tf_adasum entry
point, and loading in a process that does not import tf_adasum: an inference server, a colleague's
notebook."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_adasum
from tests.support.training import cpus

ROOT = Path(__file__).resolve().parents[1]

# Runs in a fresh interpreter; tf_adasum must stay unimported, whatever it loads.
LOADER = textwrap.dedent(
    """
    import json, sys
    import keras, numpy as np, tensorflow as tf
    out = sys.argv[1]
    x = np.load(f"{out}/x.npy")
    results = {}
    for name in json.loads(open(f"{out}/names.json").read()):
        base = f"{out}/{name}"
        served = tf.saved_model.load(f"{base}_saved_model").signatures["serving_default"]
        results[f"{name}/saved_model"] = next(iter(served(tf.constant(x)).values())).numpy().tolist()
        exported = tf.saved_model.load(f"{base}_export")
        results[f"{name}/export"] = exported.serve(tf.constant(x)).numpy().tolist()
        model = keras.models.load_model(f"{base}.keras", compile=False)
        results[f"{name}/keras"] = model.predict(x, verbose=0).tolist()
        try:
            keras.models.load_model(f"{base}.keras")
            results[f"{name}/compiled"] = "loaded"
        except TypeError as error:
            results[f"{name}/compiled"] = str(error)
    results["imported"] = "tf_adasum" in sys.modules
    open(f"{out}/loaded.json", "w").write(json.dumps(results))
    """
)


def _model(strategy: tf.distribute.Strategy, entry: str) -> keras.Model:
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, "relu"), keras.layers.Dense(2)])
        optimizer = {
            "strategy": lambda: keras.optimizers.Adam(0.01),  # wrapped by the strategy
            "optimizer": lambda: tf_adasum.AdasumOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), 2),
            "allreduce": lambda: tf_adasum.AllreduceOptimizer(keras.optimizers.Adam(0.01)),
        }[entry]()
        model.compile(optimizer=optimizer, loss="mse")
    return model


@pytest.mark.slow
def test_saved_models_and_keras_files_load_without_tf_adasum(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 3)).astype(np.float32)
    y = rng.standard_normal((16, 2)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    predictions, names = {}, []
    # Four of the six (entry point, trained) pairs, for CI's time: the strategy trained and not, a
    # trained AdasumOptimizer, an untrained AllreduceOptimizer (a trained AllreduceOptimizer and an
    # untrained AdasumOptimizer are left out); each pair saves and loads in three formats.
    for entry, trained in (
        ("strategy", False),
        ("strategy", True),
        ("optimizer", True),
        ("allreduce", False),
    ):
        strategy = (
            tf_adasum.AdasumStrategy(devices=cpus(2)) if entry == "strategy" else tf.distribute.get_strategy()
        )
        model = _model(strategy, entry)
        if trained:
            model.fit(x, y, batch_size=8, epochs=2, verbose=0)
        name = f"{entry}_{'trained' if trained else 'untrained'}"
        tf.saved_model.save(model, str(tmp_path / f"{name}_saved_model"))
        model.export(str(tmp_path / f"{name}_export"), verbose=False)
        model.save(tmp_path / f"{name}.keras")
        predictions[name] = model.predict(x, verbose=0)
        names.append(name)
    (tmp_path / "names.json").write_text(json.dumps(names))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "-c", LOADER, str(tmp_path)],
        cwd=tmp_path,  # not the repository: tf_adasum is importable only as the installed package
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-5000:]
    loaded = json.loads((tmp_path / "loaded.json").read_text())
    assert loaded.pop("imported") is False
    for name in names:
        for how in ("saved_model", "export", "keras"):
            np.testing.assert_allclose(loaded[f"{name}/{how}"], predictions[name], rtol=1e-6, atol=1e-6)
        # Keras's own "Could not locate class" error, which prints the saved config: its first key
        # says what to do.
        message = loaded[f"{name}/compiled"]
        assert "Could not locate class" in message, message
        assert "`import tf_adasum` before keras.models.load_model" in message, message
        assert "compile=False" in message, message


def test_a_keras_file_loads_back_with_tf_adasum_as_it_was_saved(tmp_path: Path) -> None:
    model = _model(tf.distribute.get_strategy(), "optimizer")
    model.fit(np.ones((8, 3), np.float32), np.ones((8, 2), np.float32), batch_size=4, verbose=0)
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert isinstance(loaded.optimizer, tf_adasum.AdasumOptimizer)
    assert loaded.optimizer.get_config() == model.optimizer.get_config()
    for mine, theirs in zip(loaded.optimizer.variables, model.optimizer.variables, strict=True):
        np.testing.assert_array_equal(mine.numpy(), theirs.numpy())
