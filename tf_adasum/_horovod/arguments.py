"""Horovod's argument rules, shared by its TensorFlow and Keras faces: arguments tf_adasum does not
implement (`unsupported`: NotImplementedError naming them; `name`, `ignore_name_scope` and
`sparse_as_dense` are accepted and have no effect, as documented per function), the choice of reduction
(`reduce_op`), and local layers."""

from __future__ import annotations

from typing import Any

import keras

from tf_adasum import distributed
from tf_adasum._horovod.process_sets import global_process_set
from tf_adasum.distributed import Average, Sum


def unsupported(where: str, **arguments: tuple[Any, Any]) -> None:
    """Raises naming every argument whose value differs from the one default that tf_adasum implements."""
    for name, (value, default) in arguments.items():
        if name == "process_set" and value is global_process_set:
            continue  # every rank: what tf_adasum's collectives do
        same = value is default if default is None else value == default
        if not same:
            raise NotImplementedError(
                f"{where}({name}={value!r}) is not supported by tf_adasum; only {name}={default!r} is"
            )


def groups_argument(where: str, num_groups: int, groups: Any) -> Any:
    """Horovod's `groups`, with its deprecated `num_groups` standing in for an integer `groups`."""
    if num_groups and groups is not None and groups != num_groups:
        raise ValueError(
            f"{where}: pass groups or num_groups, not both (got num_groups={num_groups}, groups={groups!r})"
        )
    return num_groups if groups is None and num_groups else groups


def reduce_op(where: str, average: bool | None, op: Any) -> distributed.ReduceOp:
    """Horovod's rule: op wins; average=False means Sum; neither given means Average."""
    if op is not None and average is not None:
        raise ValueError(f"{where}: pass op or average, not both (got op={op!r}, average={average!r})")
    if op is not None:
        return distributed.ReduceOp(op)
    return Sum if average is False else Average


def local_layer_list(where: str, local_layers: Any) -> list[Any]:
    """Horovod's local_layers (None, a Keras layer, or a list of them) as a list.

    Raises:
        ValueError: something in it is not a Keras layer.
    """
    if local_layers is None:
        return []
    layers = [local_layers] if isinstance(local_layers, keras.layers.Layer) else list(local_layers)
    for i, layer in enumerate(layers):
        if not isinstance(layer, keras.layers.Layer):
            raise ValueError(
                f"{where}: local_layers[{i}] is a {type(layer).__name__}; every local layer must be a "
                "keras.layers.Layer"
            )
    return layers
