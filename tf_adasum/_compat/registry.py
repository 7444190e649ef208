"""The registry of hooks: each private Keras or TensorFlow name tf_adasum depends on, with its check.

A hook module (optimizers, trainer, distribute, tracking, layers, numpy_views) registers each hook it
uses beside the code that uses it. The checks run at import (warn_at_import) and before anything that
needs them is created (require), so a renamed or reshaped hook in a new release is a warning at import
and a HookError at use, never a different algorithm mid-training.
"""

from __future__ import annotations

import dataclasses
import inspect
import types
import warnings
from collections.abc import Callable
from typing import Any

import keras
import tensorflow as tf

from tf_adasum.common.errors import HookError

# [first, last) of the releases tf_adasum is tested with; pyproject.toml carries the same bounds.
TESTED_TENSORFLOW = ("2.16", "2.22")
TESTED_KERAS = ("3.10", "3.16")


@dataclasses.dataclass(frozen=True)
class Hook:
    """A private name tf_adasum uses: how to check it, what breaks without it, whether that is fatal."""

    name: str
    check: Callable[[], str | None]
    consequence: str
    required: bool = True


HOOKS: dict[str, Hook] = {}


def register(name: str, consequence: str, required: bool = True) -> Callable[[Callable[[], str | None]], Any]:
    """Registers the decorated check as hook `name`'s: it returns what is wrong, or None."""

    def add(check: Callable[[], str | None]) -> Callable[[], str | None]:
        HOOKS[name] = Hook(name, check, consequence, required)
        return check

    return add


def _release(version: str) -> tuple[int, ...]:
    numbers = []
    for part in version.split(".")[:2]:
        digits = "".join(c for c in part if c.isdigit())
        numbers.append(int(digits or 0))
    return tuple(numbers)


def untested_versions() -> list[str]:
    """The installed Keras and TensorFlow releases outside the tested ranges, described."""
    found = []
    for name, version, (first, last) in (
        ("TensorFlow", tf.__version__, TESTED_TENSORFLOW),
        ("Keras", keras.__version__, TESTED_KERAS),
    ):
        if not _release(first) <= _release(version) < _release(last):
            found.append(f"{name} {version} (tested: >={first}, <{last})")
    return found


def _names(code: types.CodeType) -> set[str]:
    """The global and attribute names a function's code uses, nested functions included."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def uses(function: Any, *names: str) -> bool:
    """Whether `function`'s code (unwrapped, nested functions included) uses all of `names`."""
    code = getattr(inspect.unwrap(function), "__code__", None)
    return code is not None and set(names) <= _names(code)


def original(function: Any) -> Any:
    """The function tf_adasum replaced with `function`, or `function` itself."""
    return getattr(function, "_tf_adasum_original", function)


def replaced(function: Any) -> bool:
    """Whether `function` is tf_adasum's replacement of another (installed already)."""
    return hasattr(function, "_tf_adasum_original")


def mark(function: Any, replaced_function: Any) -> Any:
    """Marks `function` as tf_adasum's replacement of `replaced_function`."""
    function._tf_adasum_original = replaced_function
    return function


def hook_problem(name: str) -> str | None:
    """What is wrong with hook `name`, or None when it is there and used as assumed."""
    try:
        return HOOKS[name].check()
    except (ImportError, AttributeError) as error:
        return f"{type(error).__name__}: {error}"


def required_hooks() -> tuple[str, ...]:
    return tuple(name for name, hook in HOOKS.items() if hook.required)


def require(*names: str) -> None:
    """Raises HookError if any of the named hooks (default: every required one) is missing or changed."""
    for name in names or required_hooks():
        found = hook_problem(name)
        if found is not None:
            raise HookError(
                f"tf_adasum cannot run safely with Keras {keras.__version__} and TensorFlow "
                f"{tf.__version__}: {found}, so {HOOKS[name].consequence}. tf_adasum is tested with "
                f"tensorflow>={TESTED_TENSORFLOW[0]},<{TESTED_TENSORFLOW[1]} and "
                f"keras>={TESTED_KERAS[0]},<{TESTED_KERAS[1]}: install those"
            )


def require_tensorflow_backend(what: str) -> None:
    """Refuses a Keras backend other than TensorFlow: every hook is TensorFlow's."""
    backend = keras.backend.backend()
    if backend != "tensorflow":
        raise RuntimeError(
            f"{what} needs Keras's TensorFlow backend, but KERAS_BACKEND is {backend!r}: set "
            "KERAS_BACKEND=tensorflow before importing keras"
        )


def warn_at_import() -> None:
    """One warning for a Keras or TensorFlow outside the tested range, and one per missing hook."""
    untested = untested_versions()
    if untested:
        warnings.warn(
            f"tf_adasum is not tested with {' and '.join(untested)}; its hooks into Keras are checked, "
            "but results may differ",
            stacklevel=3,
        )
    for name, hook in HOOKS.items():
        found = hook_problem(name)
        if found is not None:
            warnings.warn(
                f"tf_adasum: {found}, so {hook.consequence}"
                + ("; using it raises tf_adasum.HookError" if hook.required else ""),
                stacklevel=3,
            )
