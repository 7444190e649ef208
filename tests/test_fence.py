"""The fence: no module of tf_adasum but those of tf_adasum/_compat/ touches a private Keras or TensorFlow
name, so that every one of them is checked at import (tf_adasum/_compat/registry.py) instead of failing
mid-training in a new release.

Outside tf_adasum/_compat/, a module must not
- import a private module (keras.src, tensorflow.python, tensorflow.core, ...) or reach
  tf.__internal__;
- read or write a private attribute (`x._name`) that tf_adasum does not define itself;
- in a class built on a Keras or TensorFlow class, define, override or use through `self` a private name
  of that class (its methods, or the attributes its code sets on `self`);
- swap an object's class (`obj.__class__ = ...`).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "tf_adasum"
FENCED = "_compat"
PRIVATE_MODULES = (
    "keras.src",
    "tensorflow.python",
    "tensorflow.core",
    "tensorflow.compiler",
    "tensorflow.tsl",
)
FOREIGN_PACKAGES = ("keras", "tensorflow", "tf_keras")
# Private by name, public by documentation: os._exit ends a process without running its atexit hooks.
STDLIB = {("os", "_exit")}


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def outside_the_fence(package: Path) -> list[Path]:
    return [p for p in sorted(package.rglob("*.py")) if FENCED not in p.relative_to(package).parts]


def own_private_names(files: list[Path]) -> set[str]:
    """Every private name tf_adasum defines: functions, classes, and what it assigns (names, attributes)."""
    names = set()
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
    return {n for n in names if private(n)}


def foreign(cls: type) -> bool:
    return cls.__module__.split(".")[0] in FOREIGN_PACKAGES


def foreign_private_names(cls: type) -> set[str]:
    """The private names of the Keras and TensorFlow classes `cls` is built on: their class attributes,
    and the attributes their code sets or reads on `self`."""
    names: set[str] = set()
    for base in cls.__mro__:
        if not foreign(base):
            continue
        names |= {n for n in vars(base) if private(n)}
        try:
            source = inspect.getsource(base)
        except (OSError, TypeError):
            continue
        names |= {n for n in re.findall(r"self\.(_\w+)", source) if private(n)}
    return names


def module_of(path: Path, package: Path) -> str:
    parts = list(path.relative_to(package).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join([package.name, *parts])


def findings(package: Path, import_modules: bool = True) -> list[str]:
    files = outside_the_fence(package)
    ours = own_private_names(files)
    found = []
    for path in files:
        where = path.relative_to(package.parent)
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            modules = []
            if isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                modules = [node.module]
            for module in modules:
                if module.startswith(PRIVATE_MODULES):
                    found.append(f"{where}:{node.lineno} imports the private module {module}")
            if isinstance(node, ast.Attribute):
                owner = node.value.id if isinstance(node.value, ast.Name) else None
                if node.attr == "__internal__":
                    found.append(f"{where}:{node.lineno} reaches {owner}.__internal__")
                elif private(node.attr) and node.attr not in ours and (owner, node.attr) not in STDLIB:
                    found.append(
                        f"{where}:{node.lineno} touches .{node.attr}, a name tf_adasum does not define"
                    )
            if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    if isinstance(target, ast.Attribute) and target.attr == "__class__":
                        found.append(f"{where}:{node.lineno} swaps an object's class")
        if import_modules:
            found += _class_findings(path, package, tree, where)
    return found


def fenced(value: object) -> bool:
    """Whether a class attribute was put there by the fence (a hook of tf_adasum/_compat/, checked at
    import), such as a property its function defines."""
    function = getattr(value, "fget", value)
    return getattr(function, "__module__", "").startswith(f"tf_adasum.{FENCED}.")


def _class_findings(path: Path, package: Path, tree: ast.Module, where: Path) -> list[str]:
    """Private names of Keras and TensorFlow classes that a class of this module defines or uses."""
    module = importlib.import_module(module_of(path, package))
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ClassDef):
            continue
        cls = getattr(module, node.name, None)
        if not isinstance(cls, type) or not any(foreign(b) for b in cls.__mro__[1:]):
            continue
        theirs = foreign_private_names(cls)
        for name in sorted(n for n in vars(cls) if private(n) and n in theirs and not fenced(vars(cls)[n])):
            found.append(f"{where}: {node.name} defines {name}, a private name of the class it is built on")
        for inner in ast.walk(node):
            if (
                isinstance(inner, ast.Attribute)
                and isinstance(inner.value, ast.Name)
                and inner.value.id == "self"
                and private(inner.attr)
                and inner.attr in theirs
            ):
                found.append(
                    f"{where}:{inner.lineno} {node.name} uses self.{inner.attr}, a private name of the class "
                    "it is built on"
                )
    return found


def test_no_module_outside_the_fence_touches_a_private_keras_or_tensorflow_name() -> None:
    found = findings(PACKAGE)
    assert not found, "reach them through tf_adasum/_compat/, with a check:\n" + "\n".join(found)


def test_the_check_finds_each_kind_of_breach(tmp_path: Path) -> None:
    package = tmp_path / "tf_adasum"
    (package / "_compat").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "_compat" / "__init__.py").write_text("from keras.src import optimizers\n")  # fenced: fine
    (package / "ours.py").write_text(
        "import os\n"
        "class Mine:\n"
        "    def __init__(self):\n"
        "        self._count = 0\n"
        "    def _step(self):\n"
        "        self._count += 1\n"
        "        os._exit(0)\n"
    )
    (package / "breach.py").write_text(
        "import tensorflow as tf\n"
        "from tensorflow.python.distribute import input_lib\n"
        "def f(optimizer, dataset, Holder):\n"
        "    strategy = optimizer._distribution_strategy\n"
        "    base = tf.__internal__.tracking.Trackable\n"
        "    dataset.__class__ = Holder\n"
        "    return strategy, base\n"
    )
    found = findings(package, import_modules=False)
    assert sorted(found) == [
        "tf_adasum/breach.py:2 imports the private module tensorflow.python.distribute",
        "tf_adasum/breach.py:4 touches ._distribution_strategy, a name tf_adasum does not define",
        "tf_adasum/breach.py:5 reaches tf.__internal__",
        "tf_adasum/breach.py:6 swaps an object's class",
    ], found


def test_the_check_finds_a_class_that_uses_its_keras_base_s_private_names() -> None:
    import keras

    source = (
        "class Wrapped(keras.optimizers.SGD):\n"
        "    def _mine(self):\n"
        "        return self._variables\n"
        "    def _get_variable_index(self, variable):\n"
        "        return 0\n"
    )
    namespace: dict[str, object] = {"keras": keras, "__name__": "probe"}
    exec(compile(source, "probe.py", "exec"), namespace)
    cls = namespace["Wrapped"]
    assert isinstance(cls, type)
    theirs = foreign_private_names(cls)
    assert "_variables" in theirs and "_get_variable_index" in theirs
    assert "_mine" not in theirs
