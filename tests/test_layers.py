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

PACKAGE = Path(__file__).resolve().parents[1] / "tf_adasum"

FLOORS: list[list[str]] = [
    # leaves: nothing of tf_adasum
    [
        "settings",
        "secret",
        "private_files",
        "compression",
        "variables",
        "ops",
        "_quiet",
        "hosts",
        "loss_scaling",
        "comm",
        "_horovod",
    ],
    # errors; the launcher's services and its output; the numpy views the MPI engine receives into
    ["errors", "service", "launch_output", "_compat.numpy_views"],
    # the registry of private Keras and TensorFlow hooks; tensor lists; the elastic launcher's protocol
    ["_compat.registry", "tensor_lists", "elastic_protocol"],
    # the elastic launcher's membership rules, its pool of warm processes, its copies of the commits
    ["elastic_policy", "elastic_pool", "elastic_commits"],
    # the elastic launcher's discovery of slots
    ["elastic_discovery"],
    # each hook, by subject; the communicator interface; the contract tree; the launcher
    [
        "_compat.optimizers",
        "_compat.trainer",
        "_compat.distribute",
        "_compat.tracking",
        "_compat.layers",
        "_compat.profiler",
        "_compat.losses",
        "comm.base",
        "tree",
        "elastic_launcher",
        "elastic_relay",
    ],
    # the fence's face: every private name tf_adasum touches
    ["_compat"],
    # the Timeline of each rank's phases
    ["timeline"],
    # the engines; the fused buffer
    ["comm.mpi", "comm.tf_collective", "fusion"],
    # what ranks check before data moves; the algorithms on one buffer
    ["agreement", "vhdd"],
    # Adasum across processes; this process's engine
    ["across_processes", "engine"],
    # the public collectives; Horovod's process sets
    ["distributed", "_horovod.process_sets"],
    # Keras state shared by processes; the one model sync; BatchNorm over processes; elastic state;
    # Horovod's argument rules and compression
    [
        "shared_state",
        "sync",
        "sync_batch_norm",
        "elastic_state",
        "_horovod.arguments",
        "_horovod.compression",
    ],
    # every replica's optimizer state; TensorFlow and Keras elastic state; Horovod's basics, collectives
    # and functions; what two callbacks share
    [
        "replica_state",
        "elastic_keras",
        "_horovod.basics",
        "_horovod.mpi_ops",
        "_horovod.functions",
        "callbacks.batches",
    ],
    # AdasumOptimizer; hvd.elastic; Horovod's gradient tape
    ["optimizer", "elastic", "_horovod.gradient_tape"],
    # the entry points: AllreduceOptimizer, the strategy, the callbacks (one per file)
    [
        "allreduce_optimizer",
        "strategy",
        "callbacks.adasum",
        "callbacks.broadcast",
        "callbacks.metric_average",
        "callbacks.best_model_checkpoint",
        "callbacks.learning_rate_schedule",
        "callbacks.orthogonality",
    ],
    # the warm-up (a schedule); Horovod's optimizers
    ["callbacks.learning_rate_warmup", "_horovod.optimizers"],
    # the callbacks' face; Horovod's TensorFlow face
    ["callbacks", "tensorflow"],
    # Horovod's Keras face: the TensorFlow face's functions, and the callbacks
    ["keras"],
    # the public face, the one place that patches Keras
    ["__init__"],
    ["demo", "elastic_standby", "run"],
    # the fork server of the elastic launcher's pool, which runs a warm process's standby in each fork
    ["elastic_forkserver"],
]


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


@pytest.mark.parametrize("module", ["sync", "shared_state", "across_processes", "fusion", "engine"])
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
