"""The layering of the package: every module imports only its own layer or the layers below it.

The layers, bottom to top, as today's imports draw them (``LAYERS``):

* the algebra (``typing``, ``gaussian`` and its structured families, ``tree``, ``hparams``, ``errors``): pure functions and types;
* the round protocol (keys and streams, cohorts, weights, the server step, the end of a round), the
  aggregation rules and the models, which stand side by side;
* the data (its random streams come from the protocol);
* client inference and evaluation;
* the algorithms; the config (its schema is built from the algorithm registry);
* the simulator; the runs (build, loop, run folders);
* on top, the harness that drives them: the CLI, the Flower deployment, the bench, the toys and the
  package root's curated API.

So the core (algebra, protocol, aggregators, models, data, inference, evaluation, algorithms) never
imports the harness, and nothing below ``runs`` imports ``runs`` or ``cli``. Imports are read from
the source: ``import`` statements anywhere in a module (function-level ones included) and
``importlib.import_module("fedbayes....")`` calls with a literal name, and strings that are a
fedbayes module's full name (the algorithm registry imports its modules by such names).

The modules' import graph has no cycle either (:func:`_cycles`), function-level imports counted:
a cycle that a function-level import hides still ties the modules into one, and a change of
import order can turn it into a failure at import time.
"""

import ast
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "fedbayes"

# Bottom to top; the units of one layer may import each other.
LAYERS = (
    (
        "typing",
        "gaussian",
        "gaussian_full",
        "gaussian_lowrank",
        "gaussian_block",
        "gaussian_shared",
        "gaussian_subspace",
        "gaussian_kron",
        "tree",
        "hparams",
        "errors",
        "registries",
    ),
    ("protocol", "aggregators", "models"),
    ("data",),
    ("inference", "evaluation"),
    ("algorithms",),
    ("config",),
    ("sim",),
    ("runs",),
    ("cli", "flower", "bench", "toys", "__init__"),
)
LEVEL = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}
HARNESS = ("sim", "runs", "cli", "flower", "bench", "toys")
MODULE_PATH = re.compile(r"fedbayes(\.[a-z_][a-z0-9_]*)+")


def _unit_of_path(path: Path) -> str:
    """The layer unit of a source file: its top-level module or package under fedbayes/."""
    return path.relative_to(SRC).parts[0].removesuffix(".py")


def _unit_of_module(name: str) -> str:
    """The layer unit of an imported name (``fedbayes.sim.store`` -> ``sim``); a name of the root
    package that is not a unit (``fedbayes.__version__``) is the root, ``__init__``."""
    parts = name.split(".")
    if len(parts) < 2:
        return "__init__"
    return parts[1] if parts[1] in LEVEL else "__init__"


def _imports(path: Path):
    """Every fedbayes module name ``path`` imports: statements anywhere (function level too),
    relative imports resolved, and ``importlib.import_module`` calls with a literal name."""
    package = ".".join(("fedbayes", *path.relative_to(SRC).parent.parts)) if path.is_relative_to(SRC) else "fedbayes"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module
            if module != "fedbayes":  # `from fedbayes import protocol`: the names below say which units
                yield module
            yield from (f"{module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name == "import_module":
                yield node.args[0].value
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and MODULE_PATH.fullmatch(node.value):
            yield node.value  # a module named by a string that is imported later (the registry's table)


def _module_of_path(path: Path, root: Path) -> str:
    """The dotted name of the module at ``path`` under the package folder ``root``."""
    parts = (root.name, *path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph(root: Path) -> dict[str, set[str]]:
    """module -> the package's modules it imports, read from the source under ``root`` (a package
    folder): ``import`` statements anywhere (function level too), relative ones resolved, and
    ``importlib.import_module`` calls with a literal name. ``from P import m`` is an arrow to the
    module ``P.m`` where there is one, else to ``P``; an imported name that is not a module is an
    arrow to the deepest module above it. The package that holds a module is not counted as its
    import (that would tie every module to the root package). Module names in other strings are
    not imports here (one names the module a subprocess runs, ``python -m fedbayes.bench``)."""
    modules = {_module_of_path(p, root): p for p in sorted(root.rglob("*.py"))}

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    module = f"{base}.{node.module}" if node.module else base
                else:
                    module = node.module
                found.update(f"{module}.{a.name}" if f"{module}.{a.name}" in modules else module for a in node.names)
            elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                func = node.func
                if (func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)) == "import_module":
                    found.add(node.args[0].value)
        graph[name] = {m for m in map(known, found) if m is not None and m != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle of each strongly connected set of two or more modules (Tarjan's algorithm), each
    as the modules along it, the first repeated at the end."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(_a_cycle(graph, component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _a_cycle(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A cycle through the first module of a strongly connected ``component``: the shortest path
    back to it (breadth first)."""
    start = min(component)
    previous = {start: None}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    path = [v]
                    while previous[path[-1]] is not None:
                        path.append(previous[path[-1]])
                    return [*reversed(path), start]
                if w not in previous:
                    previous[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{sorted(component)} is not strongly connected")


def _violations(path: Path, unit: str) -> list[str]:
    level = LEVEL[unit]
    bad = set()
    for name in _imports(path):
        if name != "fedbayes" and not name.startswith("fedbayes."):
            continue
        other = _unit_of_module(name)
        if other != unit and LEVEL[other] > level:
            bad.add(f"{name} ({other}, layer {LEVEL[other]} above {unit}'s {level})")
    return sorted(bad)


def _modules():
    return sorted(SRC.rglob("*.py"))


def test_every_unit_of_the_package_has_a_layer():
    units = {_unit_of_path(p) for p in _modules()}
    assert units <= set(LEVEL), f"units without a layer in LAYERS: {sorted(units - set(LEVEL))}"


def test_the_harness_sits_above_the_core():
    assert min(LEVEL[u] for u in HARNESS) > max(LEVEL[u] for u in ("algorithms", "inference", "evaluation", "aggregators", "models", "data", "protocol"))
    assert all(LEVEL[u] > LEVEL["runs"] for u in ("cli", "flower", "bench", "toys"))


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(SRC)))
def test_modules_import_only_their_layer_and_below(path):
    bad = _violations(path, _unit_of_path(path))
    assert not bad, f"{path.relative_to(SRC)} imports upwards: {bad}"


def test_the_check_sees_a_violation(tmp_path):
    bad = tmp_path / "m.py"
    bad.write_text(
        "import importlib\n"
        "from fedbayes.sim.simulator import Simulator\n"
        "import fedbayes.cli\n"
        "def late():\n"
        "    from fedbayes.runs import experiment\n"
        "    return importlib.import_module('fedbayes.flower.rounds')\n"
    )
    assert {"fedbayes.sim.simulator", "fedbayes.cli", "fedbayes.runs", "fedbayes.flower.rounds"} <= set(_imports(bad))
    found = _violations(bad, "algorithms")
    assert [v.split()[0] for v in found] == [
        "fedbayes.cli",
        "fedbayes.flower.rounds",
        "fedbayes.runs",
        "fedbayes.runs.experiment",
        "fedbayes.sim.simulator",
        "fedbayes.sim.simulator.Simulator",
    ]
    assert _violations(bad, "cli") == []  # the top layer may import anything


def test_a_module_named_by_a_string_counts_as_an_import(tmp_path):
    """The algorithm registry imports its modules by name on first use: such a name is an arrow too."""
    bad = tmp_path / "m.py"
    bad.write_text('"""Docstring naming fedbayes.sim.store in prose is not an import."""\nTABLE = {"fedavg": "fedbayes.sim.store"}\n')
    assert list(_imports(bad)) == ["fedbayes.sim.store"]
    assert [v.split()[0] for v in _violations(bad, "algorithms")] == ["fedbayes.sim.store"]


def test_the_import_graph_has_no_cycle():
    cycles = _cycles(_import_graph(SRC))
    assert not cycles, "import cycles (function-level imports counted): " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_cycle_check_sees_a_cycle_through_a_function_level_import(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg.sub import b\n")
    (package / "sub" / "b.py").write_text("from . import c\n")
    (package / "sub" / "c.py").write_text("def late():\n    from pkg.a import name\n    return name\n")
    (package / "d.py").write_text("import importlib\nimportlib.import_module('pkg.a')\nTABLE = 'pkg.d'  # a string is no import\n")
    graph = _import_graph(package)
    assert graph == {"pkg": set(), "pkg.sub": set(), "pkg.a": {"pkg.sub.b"}, "pkg.sub.b": {"pkg.sub.c"}, "pkg.sub.c": {"pkg.a"}, "pkg.d": {"pkg.a"}}
    assert _cycles(graph) == [["pkg.a", "pkg.sub.b", "pkg.sub.c", "pkg.a"]]
    (package / "sub" / "c.py").write_text("")
    assert _cycles(_import_graph(package)) == []
