"""The layering of the package: the core never imports the harness around it.

The algebra (gaussian, tree), the round protocol, the aggregators, the algorithms, client
inference and the models are pure functions over pytrees that a simulator, a deployment or a
user's own loop can call; nothing in them may import the simulator, the client-state store,
checkpoints, the experiment runner, the CLI, the bench or a deployment adapter.
"""

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "fedbayes"
CORE = ["gaussian.py", "tree.py", "protocol.py", "hparams.py", "aggregators", "algorithms", "inference", "models"]
HARNESS = ("sim", "runs", "cli", "bench", "flower", "toys")


def _modules():
    for entry in CORE:
        path = SRC / entry
        yield from (sorted(path.rglob("*.py")) if path.is_dir() else [path])


def _imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module
            yield from (f"{node.module}.{a.name}" for a in node.names)


@pytest.mark.parametrize("path", list(_modules()), ids=lambda p: str(p.relative_to(SRC)))
def test_core_modules_do_not_import_the_harness(path):
    bad = sorted({m for m in _imports(path) if m.startswith("fedbayes.") and m.split(".")[1] in HARNESS})
    assert not bad, f"{path.relative_to(SRC)} imports {bad}"


def test_the_check_sees_a_violation(tmp_path):
    bad = tmp_path / "m.py"
    bad.write_text("from fedbayes.sim.simulator import Simulator\nimport fedbayes.cli\n")
    assert {"fedbayes.sim.simulator", "fedbayes.cli"} <= set(_imports(bad))
