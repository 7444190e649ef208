"""Horovod's DistributedOptimizer and PartialDistributedOptimizer for Keras 3 optimizers: op=Adasum is the
paper's Adasum after the optimizer (an AdasumOptimizer); op=Average and Sum all-reduce the gradients
before it (an AllreduceOptimizer). A tf_keras (Keras 2) optimizer gets the same two behaviours from
keras2_optimizer.py, with backward_passes_per_step for op=Adasum and without groups."""

from __future__ import annotations

from typing import Any

import keras

from tf_adasum import _compat, distributed
from tf_adasum._horovod.arguments import groups_argument, local_layer_list, unsupported
from tf_adasum._horovod.compression import Compression, check_compressor
from tf_adasum._horovod.keras2_optimizer import keras_2_distributed_optimizer
from tf_adasum.comm import engine
from tf_adasum.distributed import Adasum, Average
from tf_adasum.training import model_sync, optimizer_options
from tf_adasum.training.allreduce_optimizer import AllreduceOptimizer
from tf_adasum.training.optimizer import AdasumOptimizer


def DistributedOptimizer(
    optimizer: keras.optimizers.Optimizer,
    name: str | None = None,
    use_locking: bool = False,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    sparse_as_dense: bool = False,
    backward_passes_per_step: int = 1,
    op: Any = Average,
    gradient_predivide_factor: float = 1.0,
    average_aggregated_gradients: bool = False,
    num_groups: int = 0,
    groups: Any = None,
    process_set: Any = None,
    scale_local_gradients: bool = True,
    outer_optimizer: Any = None,
) -> keras.optimizers.Optimizer:
    """Horovod's DistributedOptimizer for a Keras 3 optimizer, in a custom loop or under model.fit.

    Args:
        optimizer: the Keras optimizer to wrap.
        name: optional name of the wrapper.
        compression: Compression.none or Compression.fp16.
        sparse_as_dense: accepted; sparse (IndexedSlices) gradients are always made dense.
        op: Average or Sum all-reduce the gradients before the optimizer; Adasum combines the model
            deltas after it (the paper's method), every `backward_passes_per_step` local steps. With
            op=Adasum the optimizer's options keep their one-worker meaning
            (docs/training/optimizer-options.md).
        backward_passes_per_step: with op=Adasum, the local steps between two syncs (each local step
            applies its own gradient); with Average/Sum, Horovod's gradient accumulation: the passes'
            gradients summed locally, then all-reduced once and applied.
        average_aggregated_gradients: with Average/Sum, divide the accumulated gradients by
            backward_passes_per_step, as Horovod; with op=Adasum and k > 1 a ValueError (nothing is
            aggregated there).
        scale_local_gradients: with Average/Sum, divide the gradients of local variables
            (register_local_var) by the number of processes, as Horovod.
        groups: with Average/Sum, Horovod's grouping: a number of groups, or a list of lists of
            variables, each group one fused all-reduce that starts as soon as its gradients exist
            (AllreduceOptimizer); num_groups is its older name.
        use_locking, device_dense, device_sparse, gradient_predivide_factor, process_set: only their
            defaults are supported; anything else raises.
        outer_optimizer: tf_adasum's, not Horovod's: with op=Adasum, a Keras optimizer that each sync
            steps on the combined deltas, from the weights of the last sync
            (docs/training/outer-optimizer.md); a ValueError with Average or Sum, or a tf_keras optimizer.

    Returns:
        An AdasumOptimizer (op=Adasum) or AllreduceOptimizer (op=Average/Sum) around `optimizer`.

    Raises:
        NotImplementedError: an argument that tf_adasum does not implement, named.
        ValueError: an unknown op, a bad backward_passes_per_step, or with op=Adasum an optimizer
            option that cannot keep its meaning (use_ema with backward_passes_per_step > 1).
    """
    where = "DistributedOptimizer"
    unsupported(where, use_locking=(use_locking, False), device_dense=(device_dense, ""))
    unsupported(where, device_sparse=(device_sparse, ""), process_set=(process_set, None))
    unsupported(where, gradient_predivide_factor=(gradient_predivide_factor, 1.0))
    check_compressor(where, compression)
    chosen = distributed.ReduceOp(op)
    groups = groups_argument(where, num_groups, groups)
    model_sync.check_positive_integer("backward_passes_per_step", backward_passes_per_step)
    engine.init()
    _compat.install_keras_2_mixing_guard()  # a tf.keras model compiled with a Keras 3 one: refused clearly
    if chosen is Adasum and average_aggregated_gradients and backward_passes_per_step > 1:
        raise ValueError(
            f"{where}(op=Adasum, average_aggregated_gradients=True): with Adasum after the optimizer "
            "each of the backward_passes_per_step passes is a local step of its own, and nothing is "
            "aggregated to average; leave average_aggregated_gradients False"
        )
    if outer_optimizer is not None and (chosen is not Adasum or _compat.keras_2_name(optimizer) is not None):
        got = f"op={chosen.name.title()}" if chosen is not Adasum else "a tf_keras optimizer"
        raise ValueError(
            f"{where}(outer_optimizer=...) steps the Adasum of the model deltas after the optimizer: it "
            f"takes op=Adasum and a Keras 3 optimizer, got {got}"
        )
    if _compat.keras_2_name(optimizer) is not None:
        if chosen is Adasum and getattr(optimizer, "use_ema", False):
            raise ValueError(
                f"{where}(op=Adasum) on a tf_keras {type(optimizer).__name__}(use_ema=True): tf_keras "
                "updates the moving average inside its step, before Adasum, so it would follow this "
                "process's weights, not the combined ones. Use use_ema=False under tf_keras, or a Keras 3 "
                "optimizer, where the combination comes first"
            )
        if groups:
            raise NotImplementedError(
                f"{where}(groups={groups!r}) on a tf_keras (Keras 2) optimizer: groups are built for Keras 3 "
                "optimizers (keras.optimizers.*)"
            )
        return keras_2_distributed_optimizer(
            optimizer, chosen, compression, name, backward_passes_per_step, average_aggregated_gradients
        )
    if chosen is Adasum:
        if groups:
            raise NotImplementedError(
                f"{where}(op=Adasum, groups={groups!r}): groups split the gradient all-reduce of "
                "op=Average or Sum; op=Adasum combines the model deltas after the optimizer, one fused "
                "call a sync. For Adasum of the gradients in groups, use "
                "DistributedGradientTape(op=Adasum, groups=...)"
            )
        # Named as the script names it: use_ema with backward_passes_per_step > 1 is refused.
        optimizer_options.check(optimizer, backward_passes_per_step, "backward_passes_per_step")
        return AdasumOptimizer(
            optimizer,
            sync_every=backward_passes_per_step,
            name=name,
            compression=compression.name,
            outer_optimizer=outer_optimizer,
        )
    return AllreduceOptimizer(
        optimizer,
        op=chosen,
        name=name,
        compression=compression.name,
        backward_passes_per_step=backward_passes_per_step,
        average_aggregated_gradients=average_aggregated_gradients,
        scale_local_gradients=scale_local_gradients,
        groups=groups,
    )


def PartialDistributedOptimizer(
    optimizer: keras.optimizers.Optimizer,
    name: str | None = None,
    use_locking: bool = False,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    sparse_as_dense: bool = False,
    backward_passes_per_step: int = 1,
    op: Any = Average,
    gradient_predivide_factor: float = 1.0,
    average_aggregated_gradients: bool = False,
    num_groups: int = 0,
    groups: Any = None,
    process_set: Any = None,
    local_layers: Any = None,
    scale_local_gradients: bool = True,
) -> keras.optimizers.Optimizer:
    """Horovod's PartialDistributedOptimizer: DistributedOptimizer with every variable of `local_layers`
    (a layer or a list of layers) registered as this worker's own (register_local_var)."""
    wrapped = DistributedOptimizer(
        optimizer,
        name=name,
        use_locking=use_locking,
        device_dense=device_dense,
        device_sparse=device_sparse,
        compression=compression,
        sparse_as_dense=sparse_as_dense,
        backward_passes_per_step=backward_passes_per_step,
        op=op,
        gradient_predivide_factor=gradient_predivide_factor,
        average_aggregated_gradients=average_aggregated_gradients,
        num_groups=num_groups,
        groups=groups,
        process_set=process_set,
        scale_local_gradients=scale_local_gradients,
    )
    for layer in local_layer_list("PartialDistributedOptimizer", local_layers):
        for variable in layer.trainable_weights:
            wrapped.register_local_var(variable)
    return wrapped
