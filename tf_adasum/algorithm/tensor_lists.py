"""Lists of tensors: the checks every entry point makes of them, their specs, how two lists differ, and
grouping by dtype.

Every Adasum entry point takes a list of tensors (a model's layers). The tree over replicas, the
agreement across ranks and the fusing into buffers all describe, compare and group such lists the
same way, through these.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

FLOAT_DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64)


Spec = tuple[list[int | None] | None, str]  # a tensor's static shape (None: unknown rank) and dtype name


def dense(value: Any) -> Any:
    """A tensor, with IndexedSlices (an embedding's gradient, in Keras 3 under TensorFlow) made dense:
    every reduction here, and Adasum above all, needs the whole tensor."""
    return tf.convert_to_tensor(value) if isinstance(value, tf.IndexedSlices) else value


def tensor_specs(tensors: Sequence[tf.Tensor]) -> list[Spec]:
    """Each tensor's static shape (None when even the rank is unknown) and dtype name."""
    return [(t.shape.as_list() if t.shape.rank is not None else None, t.dtype.name) for t in tensors]


def describe_tensor(index: int, count: int, names: Sequence[str] | None = None) -> str:
    """'tensor 3 of 12', with the tensor's name in parentheses when it is known."""
    name = f" ({names[index]})" if names is not None and index < len(names) else ""
    return f"tensor {index} of {count}{name}"


def first_mismatch(
    specs: Sequence[Sequence[Spec]], where: str, names: Sequence[str] | None = None
) -> str | None:
    """How the first of specs[1:] that differs from specs[0] differs from it, or None when none does.

    Replica or rank 0 holds what is expected. Used by the tree over a process's replicas and by the
    check across ranks, so both say the same thing the same way.

    Args:
        specs: specs[r] is tensor_specs() of replica or rank r's tensors.
        where: "replica" or "rank".
        names: the tensors' names, for the message.

    Returns:
        For example "tensor 3 of 12 (dense/kernel) has shape [4, 6] and dtype float32 on rank 1 but
        shape [4, 5] and dtype float32 on rank 0", or "rank 2 has 1 tensors but rank 0 has 2".
    """
    expected = specs[0]
    for r, got in enumerate(specs[1:], start=1):
        if len(got) != len(expected):
            return f"{where} {r} has {len(got)} tensors but {where} 0 has {len(expected)}"
        for i, ((shape, dtype), (shape0, dtype0)) in enumerate(zip(got, expected, strict=True)):
            if shape != shape0 or dtype != dtype0:
                return (
                    f"{describe_tensor(i, len(expected), names)} has shape {shape} and dtype {dtype} "
                    f"on {where} {r} but shape {shape0} and dtype {dtype0} on {where} 0"
                )
    return None


def check_replicas_match(per_replica: Sequence[Sequence[tf.Tensor]]) -> None:
    """Raises ValueError naming the tensor and the replica whose count, shape or dtype differ from 0's."""
    mismatch = first_mismatch([tensor_specs(tensors) for tensors in per_replica], "replica")
    if mismatch is not None:
        raise ValueError(mismatch)


def indices_by_dtype(tensors: Sequence[tf.Tensor]) -> list[list[int]]:
    """The positions of the tensors of each dtype, dtypes in the order they first appear.

    Mixed precision mixes dtypes in one list; the fused ops take one dtype per call.
    """
    groups: dict[tf.DType, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(i)
    return list(groups.values())


def as_tensor_list(op: str, tensors: Any) -> tuple[list[tf.Tensor], bool]:
    """Returns (tensors as a list, whether a single tensor was given); refuses None, naming it."""
    single = not isinstance(tensors, (list, tuple))
    items = [tensors] if single else list(tensors)
    for i, t in enumerate(items):
        if t is None:
            raise ValueError(f"{op}: tensor {i} of {len(items)} is None (a variable without a gradient?)")
    return [tf.convert_to_tensor(t) for t in items], single


def check_float_tensors(op: str, tensors: Sequence[tf.Tensor], one_dtype: bool = True) -> tf.DType | None:
    """Checks that all tensors are floating (and, with one_dtype, share a dtype); returns tensor 0's.

    Raises:
        TypeError: a non-floating dtype, or two dtypes where one is needed; the message names the tensor.
    """
    if not tensors:
        return None
    dtype = tensors[0].dtype
    for i, t in enumerate(tensors):
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(
                f"{op}: tensor {i} of {len(tensors)} has dtype {t.dtype.name}; Adasum needs float16, "
                "bfloat16, float32 or float64 (use op=tf_adasum.Sum or Average for other dtypes)"
            )
        if one_dtype and t.dtype != dtype:
            raise TypeError(
                f"{op}: tensor {i} of {len(tensors)} has dtype {t.dtype.name} but tensor 0 has "
                f"{dtype.name}; all tensors of one call must share a dtype"
            )
    return dtype
