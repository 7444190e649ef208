"""The package's import graph runs down: every module imports only modules on lower floors, so there is
no circle. Imports inside functions count too: a lazy import is still a dependency, and lazy imports
are how the last circle (optimizer <-> callbacks, through _compat) crept in unnoticed.

FLOORS is the declared order, bottom first; docs/design.md shows the same floors with each module's job.
A new module goes on a floor here, or this test fails naming it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.support.floors import FLOORS

PACKAGE = Path(__file__).resolve().parents[1] / "tf_adasum"


def module_name(path: Path, package: Path) -> str:
    parts = list(path.relative_to(package).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]  # a subpackage's __init__ is the subpackage
    return ".".join(parts)


def imports_of(path: Path, package: Path) -> list[tuple[int, str]]:
    """(line, module) for every import of a module of the package in `path`, at any depth."""
    modules = {module_name(p, package) for p in package.rglob("*.py")}
    top = package.name

    def resolve(name: str) -> str | None:
        if name != top and not name.startswith(f"{top}."):
            return None
        inner = name[len(top) + 1 :] or "__init__"
        return inner if inner in modules else None

    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [resolve(alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            # `from tf_adasum import ops` imports the module tf_adasum.ops; `from tf_adasum import
            # HookError` a name of the package's face, tf_adasum/__init__.py.
            targets = [resolve(f"{node.module}.{alias.name}") or resolve(node.module) for alias in node.names]
        else:
            continue
        found |= {(node.lineno, target) for target in targets if target is not None}
    return sorted(found)


def import_graph(package: Path) -> dict[str, list[tuple[int, str]]]:
    """Every module of the package (dotted, relative to it) and what it imports of the package."""
    graph = {}
    for path in sorted(package.rglob("*.py")):
        name = module_name(path, package)
        graph[name] = [(line, m) for line, m in imports_of(path, package) if m != name]
    return graph


def problems(graph: dict[str, list[tuple[int, str]]], floors: list[list[str]]) -> list[str]:
    """Every import that runs sideways or up the declared floors, every module not on a floor, and
    every circle."""
    floor = {module: i for i, modules in enumerate(floors) for module in modules}
    found = [f"{m} is on no floor of FLOORS: place it" for m in graph if m not in floor]
    for module, imported in graph.items():
        for line, target in imported:
            if module in floor and target in floor and floor[target] >= floor[module]:
                direction = "up" if floor[target] > floor[module] else "sideways"
                found.append(
                    f"{module}.py:{line} imports {target}, which runs {direction} "
                    f"(floor {floor[module]} -> floor {floor[target]})"
                )
    found += ["circle: " + " -> ".join(circle) for circle in circles(graph)]
    return found


def circles(graph: dict[str, list[tuple[int, str]]]) -> list[list[str]]:
    """The import circles, each once, as module paths that end where they start."""
    edges = {m: sorted({t for _, t in targets if t in graph}) for m, targets in graph.items()}
    found, seen = [], set()
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        stack.append(module)
        for target in edges[module]:
            if state.get(target) == 1:
                circle = [*stack[stack.index(target) :], target]
                key = frozenset(circle)
                if key not in seen:
                    seen.add(key)
                    found.append(circle)
            elif target not in state:
                visit(target)
        stack.pop()
        state[module] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module)
    return found


def test_every_import_in_the_package_runs_down() -> None:
    found = problems(import_graph(PACKAGE), FLOORS)
    assert not found, "\n".join(found)


def test_the_check_finds_an_upward_import_a_sideways_one_and_a_circle(tmp_path: Path) -> None:
    package = tmp_path / "tf_adasum"
    (package / "comm").mkdir(parents=True)
    (package / "__init__.py").write_text("from tf_adasum import low\n")
    (package / "comm" / "__init__.py").write_text("")
    (package / "comm" / "base.py").write_text("import tf_adasum.low\n")
    (package / "low.py").write_text("def later():\n    from tf_adasum.high import x\n")
    (package / "high.py").write_text("from tf_adasum import low, peer\nx = 1\n")
    (package / "peer.py").write_text("from tf_adasum.comm.base import y\n")
    (package / "stray.py").write_text("")
    graph = import_graph(package)
    assert graph["low"] == [(2, "high")]  # found inside a function
    assert graph["comm.base"] == [(1, "low")]
    floors = [["comm", "low"], ["comm.base", "high", "peer"], ["__init__"]]
    found = problems(graph, floors)
    assert "stray is on no floor of FLOORS: place it" in found
    assert "low.py:2 imports high, which runs up (floor 0 -> floor 1)" in found
    assert "high.py:1 imports peer, which runs sideways (floor 1 -> floor 1)" in found
    assert "peer.py:1 imports comm.base, which runs sideways (floor 1 -> floor 1)" in found
    assert "circle: low -> high -> low" in found
    assert "circle: low -> high -> peer -> comm.base -> low" in found
    assert len(found) == 6, found


@pytest.mark.parametrize(
    "module",
    [
        "training/model_sync",
        "training/keras_consensus",
        "algorithm/fused_adasum",
        "algorithm/fusion",
        "comm/engine",
    ],
)
def test_each_module_says_its_one_job_first(module: str) -> None:
    docstring = ast.get_docstring(ast.parse((PACKAGE / f"{module}.py").read_text()))
    assert docstring and len(docstring.splitlines()[0]) <= 110, docstring


def test_no_module_is_over_500_lines() -> None:
    """One idea per module: a module past 500 lines holds more than one, and is split where one ends."""
    long = {
        module_name(path, PACKAGE): n
        for path in PACKAGE.rglob("*.py")
        if (n := len(path.read_text().splitlines())) > 500
    }
    assert not long, f"modules over 500 lines: {long}"


HEAVY = ("tensorflow", "keras", "numpy", "mpi4py")


def third_party_imports(path: Path) -> set[str]:
    """The top-level names of every package `path` imports, at any depth (tf_adasum's own excluded)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            found.add(node.module.split(".")[0])
    return found - {"tf_adasum"}


def test_the_launcher_imports_no_tensorflow() -> None:
    """A launch starts in a fraction of a second: nothing that launch/ imports, at any depth, imports
    TensorFlow, Keras, numpy or MPI, and its packages' __init__ files are empty, so that importing
    tf_adasum.launch.x imports nothing more."""
    graph = import_graph(PACKAGE)
    reached, todo = set(), [m for m in graph if m == "launch" or m.startswith("launch.")]
    while todo:
        module = todo.pop()
        if module not in reached:
            reached.add(module)
            todo += [target for _, target in graph[module]]
    heavy = {
        module: sorted(third_party_imports(PACKAGE / (module.replace(".", "/") + ".py")) & set(HEAVY))
        for module in reached
        if (PACKAGE / (module.replace(".", "/") + ".py")).exists()
    }
    assert not {m: h for m, h in heavy.items() if h}, heavy
    for init in (PACKAGE / "launch").rglob("__init__.py"):
        assert init.read_text() == "", f"{init} must stay empty"
    assert third_party_imports(PACKAGE / "run.py") & set(HEAVY) == set()


# The top of tf_adasum/: the public faces (each a path users import) and the layer folders.
PUBLIC_FACES = {
    "__init__.py", "keras.py", "tensorflow.py", "ops.py", "timeline.py", "distributed.py", "demo.py",
    "run.py", "callbacks", "elastic",
}  # fmt: skip
LAYER_FOLDERS = {"common", "algorithm", "comm", "training", "launch", "_compat", "_horovod"}


def test_the_top_of_the_package_holds_the_public_faces_and_the_layer_folders() -> None:
    top = {
        p.name
        for p in PACKAGE.iterdir()
        if (p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").exists()))
    }
    assert top == PUBLIC_FACES | LAYER_FOLDERS, (
        f"only at the top: {sorted(top - PUBLIC_FACES - LAYER_FOLDERS)}; "
        f"missing: {sorted(PUBLIC_FACES | LAYER_FOLDERS - top)}"
    )


def test_no_launcher_function_is_over_80_lines() -> None:
    """The launcher reads as Horovod's runner: a parser, a dispatch, one supervise loop, small steps."""
    long = {}
    for path in (PACKAGE / "launch").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > 80:
                    long[f"{path.relative_to(PACKAGE)}:{node.name}"] = lines
    assert not long, f"launcher functions over 80 lines: {long}"
