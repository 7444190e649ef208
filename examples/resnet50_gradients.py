"""Adasum on real model-sized tensors: two replicas' gradients of a ResNet-50, combined per layer.

Usage:
    python examples/resnet50_gradients.py

Computes the gradients of a randomly initialised ResNet-50 with a 10-class head (23.6M parameters, 214
tensors) on two different batches, as two data-parallel replicas would, then combines them per layer
with the fused Adasum ops and shows how Adasum sits between the sum (orthogonal gradients) and the mean
(parallel gradients), and how long the fused ops take against the same math as composite TensorFlow
ops (benchmarks/common.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

from tf_adasum import ops

# isort: split
import keras
import numpy as np
import tensorflow as tf

# The composite-ops baseline and the timer are the benchmarks' own: benchmarks/common.py.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import composite_pair, median_ms


def replica_gradients(model: keras.Model, seed: int, batch: int = 8) -> list[tf.Tensor]:
    rng = np.random.default_rng(seed)
    images = tf.constant(rng.standard_normal((batch, 64, 64, 3)), tf.float32)
    labels = tf.constant(rng.integers(0, 10, batch))
    with tf.GradientTape() as tape:
        logits = model(images, training=True)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits))
    return tape.gradient(loss, model.trainable_variables)


def main() -> None:
    keras.utils.set_random_seed(0)
    model = keras.applications.ResNet50(
        weights=None, input_shape=(64, 64, 3), classes=10, classifier_activation=None
    )
    names = [v.path for v in model.trainable_variables]
    print(f"ResNet-50: {model.count_params() / 1e6:.1f}M parameters, {len(names)} trainable tensors")
    g0, g1 = replica_gradients(model, seed=1), replica_gradients(model, seed=2)

    combined = ops.adasum_pair(g0, g1)
    dot_norms = ops.adasum_dot_norms(g0, g1).numpy()
    cosine = dot_norms[:, 0] / np.sqrt(np.maximum(dot_norms[:, 1] * dot_norms[:, 2], 1e-300))

    print("\nPer layer, |adasum| against |sum| and |mean| of the two replicas' gradients:")
    print(f"{'tensor':<48} {'cos(g0,g1)':>10} {'|sum|':>10} {'|mean|':>10} {'|adasum|':>10}")
    for i in np.linspace(0, len(names) - 1, 10).astype(int):
        total = np.linalg.norm((g0[i] + g1[i]).numpy())
        print(
            f"{names[i][-48:]:<48} {cosine[i]:>10.3f} {total:>10.3e} {total / 2:>10.3e} "
            f"{np.linalg.norm(combined[i].numpy()):>10.3e}"
        )

    fused = tf.function(lambda: ops.adasum_pair(g0, g1))
    composite = tf.function(lambda: composite_pair(g0, g1))
    fused_ms = median_ms(lambda: fused()[0].numpy(), repeats=7)
    composite_ms = median_ms(lambda: composite()[0].numpy(), repeats=7)
    print(
        f"\nAll {len(names)} tensors in one fused call: {fused_ms:.1f} ms; the same math as composite "
        f"TensorFlow ops: {composite_ms:.1f} ms ({composite_ms / fused_ms:.1f}x)."
    )
    print(
        "Adasum keeps the sum where replicas disagree (cos ~ 0) and falls to the mean where they agree "
        "(cos ~ 1), per layer."
    )


if __name__ == "__main__":
    main()
