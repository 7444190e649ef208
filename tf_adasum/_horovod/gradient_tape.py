"""Horovod's DistributedGradientTape and PartialDistributedGradientTape: the gradients reduced over
processes before the optimizer (Average, Sum, or Adasum of the gradients)."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from tf_adasum import distributed
from tf_adasum._horovod.arguments import groups_argument, local_layer_list, unsupported
from tf_adasum._horovod.compression import Compression
from tf_adasum._horovod.mpi_ops import grouped_allreduce
from tf_adasum.comm import engine
from tf_adasum.common.variables import tf_variable
from tf_adasum.distributed import Average, Sum


class DistributedGradientTape:
    """A tf.GradientTape whose gradient() reduces the gradients over all processes (Horovod's).

    Wrap the tape after recording: `tape = hvd.DistributedGradientTape(tape)`. gradient() computes this
    process's gradients with the wrapped tape, then reduces all of them in one fused call: Average (the
    default) or Sum, or Adasum of the gradients (as Horovod's op=Adasum). None gradients stay None; sparse
    gradients are reduced dense. Everything else (watch, stop_recording, jacobian, ...) is the wrapped
    tape's.

    For the paper's Adasum after the optimizer, keep a plain tape and use
    `hvd.DistributedOptimizer(opt, op=hvd.Adasum)`, which is tf_adasum.AdasumOptimizer.

    Args:
        gradtape: the tf.GradientTape that recorded the forward pass.
        compression: Compression.none or Compression.fp16 (or a compressor of your own).
        sparse_as_dense: accepted; sparse gradients are always reduced dense.
        op: Average, Sum or Adasum.
        gradient_predivide_factor: with op=Average, gradients are divided by it before the sum and the
            sum by size / factor after, as Horovod does.
        scale_local_gradients: divide the gradients of local sources (register_local_source) by the
            number of processes, as Horovod does.
        groups: Horovod's: a number of groups (consecutive), or a list of lists of variables (each list
            one group, every other variable alone). Each group is one fused call, issued last group
            first; in a tf.function each starts as soon as its gradients exist, overlapping the rest of
            the backward pass. None: one call, or buckets of $TF_ADASUM_BUCKET_MB in a tf.function.
        num_groups: Horovod's older name for an integer `groups`.
        device_dense, device_sparse, process_set: defaults only.
    """

    def __init__(
        self,
        gradtape: tf.GradientTape,
        device_dense: str = "",
        device_sparse: str = "",
        compression: Any = Compression.none,
        sparse_as_dense: bool = False,
        op: Any = Average,
        gradient_predivide_factor: float = 1.0,
        num_groups: int = 0,
        groups: Any = None,
        process_set: Any = None,
        scale_local_gradients: bool = True,
    ) -> None:
        where = "DistributedGradientTape"
        unsupported(where, device_dense=(device_dense, ""), device_sparse=(device_sparse, ""))
        unsupported(where, process_set=(process_set, None))
        self.op = distributed.ReduceOp(op)
        if gradient_predivide_factor != 1.0 and self.op is not Average:
            raise ValueError(
                f"gradient_predivide_factor={gradient_predivide_factor} applies to op=Average only, got "
                f"op={self.op.name.title()}"
            )
        self._tape = gradtape
        self.groups = groups_argument(where, num_groups, groups)
        self.compression = compression
        self.gradient_predivide_factor = gradient_predivide_factor
        self.scale_local_gradients = scale_local_gradients
        # This worker's own sources (Horovod's local sources), by the identity of their tf.Variable.
        self._local_sources: dict[int, Any] = {}
        engine.init()

    def register_local_source(self, source: Any) -> None:
        """Makes `source` (a variable) this worker's own: its gradient is not reduced over processes."""
        self._local_sources[id(tf_variable(source))] = source

    def _is_local(self, source: Any) -> bool:
        return id(tf_variable(source)) in self._local_sources

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tape, name)

    def __enter__(self) -> DistributedGradientTape:
        self._tape.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._tape.__exit__(*exc)

    def gradient(
        self,
        target: Any,
        sources: Any,
        output_gradients: Any = None,
        unconnected_gradients: Any = tf.UnconnectedGradients.NONE,
    ) -> Any:
        """The gradients of `target` with respect to `sources`, reduced over all processes."""
        local = self._tape.gradient(target, sources, output_gradients, unconnected_gradients)
        flat_sources, flat = tf.nest.flatten(sources), tf.nest.flatten(local)
        mine = [self._is_local(s) for s in flat_sources]
        present = [i for i, g in enumerate(flat) if g is not None and not mine[i]]
        names = [_name(flat_sources[i]) for i in present]
        factor = self.gradient_predivide_factor
        size = engine.init().size
        out = list(flat)
        groups = distributed.gradient_groups(
            [flat[i] for i in present],
            [flat_sources[i] for i in present],
            self.groups,
            "DistributedGradientTape",
        )
        for index in groups:  # one fused call per group, last layers' first (distributed.gradient_groups)
            reduced = grouped_allreduce(
                [flat[present[j]] for j in index],
                op=Sum if self.op is Average else self.op,
                compression=self.compression,
                prescale_factor=1.0 / factor if self.op is Average else 1.0,
                postscale_factor=factor / size if self.op is Average else 1.0,
                names=[names[j] for j in index],
            )
            for j, g in zip(index, reduced, strict=True):
                out[present[j]] = g
        if self.scale_local_gradients and size > 1:  # Horovod's: a local gradient divided by the workers
            out = [_divided(g, size) if mine[i] and g is not None else g for i, g in enumerate(out)]
        return tf.nest.pack_sequence_as(local, out)

    def get_local_and_global_gradients(
        self, target: Any, sources: Any, output_gradients: Any = None
    ) -> tuple[list[tuple[Any, Any]], list[tuple[Any, Any]]]:
        """gradient(), as (source, gradient) pairs of the local sources and of the others (Horovod's)."""
        gradients = self.gradient(target, sources, output_gradients)
        pairs = list(zip(tf.nest.flatten(sources), tf.nest.flatten(gradients), strict=True))
        return [p for p in pairs if self._is_local(p[0])], [p for p in pairs if not self._is_local(p[0])]


def _divided(gradient: Any, size: int) -> Any:
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(gradient.values / size, gradient.indices, gradient.dense_shape)
    return gradient / size


def PartialDistributedGradientTape(
    gradtape: tf.GradientTape,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    sparse_as_dense: bool = False,
    op: Any = Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Any = None,
    process_set: Any = None,
    local_layers: Any = None,
    scale_local_gradients: bool = True,
) -> DistributedGradientTape:
    """DistributedGradientTape whose gradients of `local_layers`' trainable weights stay this worker's
    own (not reduced; divided by the number of processes with scale_local_gradients), as Horovod's.

    Args:
        local_layers: a keras.layers.Layer or a list of them; None: every gradient is reduced.
        The others: as DistributedGradientTape.

    Raises:
        ValueError: something in local_layers is not a Keras layer.
    """
    layers = local_layer_list("PartialDistributedGradientTape", local_layers)
    tape = DistributedGradientTape(
        gradtape,
        device_dense=device_dense,
        device_sparse=device_sparse,
        compression=compression,
        sparse_as_dense=sparse_as_dense,
        op=op,
        gradient_predivide_factor=gradient_predivide_factor,
        num_groups=num_groups,
        groups=groups,
        process_set=process_set,
        scale_local_gradients=scale_local_gradients,
    )
    for layer in layers:
        for variable in layer.trainable_weights:
            tape.register_local_source(variable)
    return tape


def _name(source: Any) -> str:
    return getattr(source, "path", None) or getattr(source, "name", None) or "tensor"
