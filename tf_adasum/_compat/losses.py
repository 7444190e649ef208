"""Hooks into the scaling of losses by the number of replicas.

`loss scaling for distribution`
    keras.src.losses.loss's scale_loss_for_distribution and unscale_loss_for_distribution: under a
    tf.distribute strategy Keras divides the losses of its Loss objects (reduce_values), compute_loss and
    add_loss (TensorFlowTrainer._aggregate_additional_loss) by the number of replicas, and multiplies the
    logged loss back (train_step, CompileLoss). tf_adasum makes both identities in a Keras train step of a
    model that runs Adasum (install_loss_scaling), so that each replica's loss is its own.
`tf.nn.compute_average_loss`
    TensorFlow's custom-loop convention, the sum of per-example losses over the global batch: replaced in
    tf.nn so that tf_adasum sees that a step's loss was scaled, and, in such a Keras train step, gives the
    replica's own mean.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import tensorflow as tf

from tf_adasum._compat.registry import hook_problem, mark, register, replaced, uses


def _loss_module() -> Any:
    from keras.src.losses import loss

    return loss


@register(
    "loss scaling for distribution",
    "a Keras train step whose loss is built by hand would step on N times its gradient under Adasum",
)
def _check_loss_scaling() -> str | None:
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer
    from keras.src.trainers import compile_utils

    module = _loss_module()
    for name in ("scale_loss_for_distribution", "unscale_loss_for_distribution"):
        if not callable(getattr(module, name, None)):
            return f"keras.src.losses.loss has no {name}"
    if not uses(module.reduce_values, "scale_loss_for_distribution"):
        return "Keras's Loss objects no longer scale through scale_loss_for_distribution"
    if not uses(TensorFlowTrainer._aggregate_additional_loss, "scale_loss_for_distribution"):
        return "add_loss losses are no longer scaled through scale_loss_for_distribution"
    if not uses(TensorFlowTrainer.train_step, "unscale_loss_for_distribution"):
        return "train_step no longer logs its loss through unscale_loss_for_distribution"
    if not uses(compile_utils.CompileLoss.call, "unscale_loss_for_distribution"):
        return "CompileLoss no longer logs its losses through unscale_loss_for_distribution"
    return None


@register(
    "tf.nn.compute_average_loss", "tf_adasum cannot see a custom loop's loss scaled by the global batch"
)
def _check_compute_average_loss() -> str | None:
    if not callable(getattr(tf.nn, "compute_average_loss", None)):
        return "tf.nn has no compute_average_loss"
    return None


def install_loss_scaling(unscaled: Callable[[], bool], scaled: Callable[[], None]) -> None:
    """Makes Keras's loss scaling (and unscaling) by the number of replicas an identity where unscaled()
    holds, and tf.nn.compute_average_loss give the replica's own mean there; elsewhere both scale as
    before, and each scaling calls scaled() first. Once per process."""
    if hook_problem("loss scaling for distribution") is None:
        module = _loss_module()
        scale, unscale = module.scale_loss_for_distribution, module.unscale_loss_for_distribution
        if not replaced(scale):

            @functools.wraps(scale)
            def scale_loss(value: Any) -> Any:
                if unscaled():
                    return value
                scaled()
                return scale(value)

            @functools.wraps(unscale)
            def unscale_loss(value: Any) -> Any:
                return value if unscaled() else unscale(value)

            module.scale_loss_for_distribution = mark(scale_loss, scale)
            module.unscale_loss_for_distribution = mark(unscale_loss, unscale)
    if hook_problem("tf.nn.compute_average_loss") is None and not replaced(tf.nn.compute_average_loss):
        average = tf.nn.compute_average_loss

        @functools.wraps(average)
        def compute_average_loss(per_example_loss: Any, *args: Any, **kwargs: Any) -> Any:
            loss = average(per_example_loss, *args, **kwargs)
            if unscaled():  # the global batch is the replicas' batches: this replica's is 1/N of it
                return loss * tf.cast(tf.distribute.get_strategy().num_replicas_in_sync, loss.dtype)
            scaled()
            return loss

        tf.nn.compute_average_loss = mark(compute_average_loss, average)
