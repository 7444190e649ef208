"""Keras variables as TensorFlow holds them: the tf.Variable behind one, its replicas, its name."""

from __future__ import annotations

from typing import Any

import keras


def tf_variable(variable: Any) -> Any:
    """The TensorFlow (possibly distributed) variable behind a Keras variable."""
    return variable.value if isinstance(variable, keras.Variable) else variable


def have_values(variables: Any) -> bool:
    """Whether every variable (Keras or TensorFlow, possibly distributed) holds a value: False while any
    is made in the function being traced, whose first run gives it one. Eager, so call it outside a
    trace or under tf.init_scope. True for no variables."""
    return all(bool(tf_variable(v).is_initialized()) for v in variables)


def replica_values(variable: Any) -> tuple[Any, ...]:
    """Every local replica's copy of a variable, in replica order (one for a plain variable)."""
    value = tf_variable(variable)
    return tuple(getattr(value, "values", (value,)))


def variable_name(variable: Any) -> str:
    """A variable's name for messages: its Keras path ("dense/kernel") where it has one."""
    return getattr(variable, "path", None) or variable.name
