"""fedbayes.flower.internals, the one wall around Flower's internals: every private name it
needs is in the installed flwr (a failure names the symbol), each feature falls back to Flower's
stock path where a symbol is missing (simulated through the wall's own table, SYMBOLS), no other
module of fedbayes imports a private flwr name, and the object-pull patch itself."""

from __future__ import annotations

import ast
import logging
import os
import sys
import time
import types
from pathlib import Path

import pytest

pytest.importorskip("flwr", reason="the flower extra is not installed (pip install -e '.[flower]')")

from fedbayes.flower import executor, internals  # noqa: E402

pytestmark = pytest.mark.flower

SRC = Path(__file__).resolve().parents[2] / "src" / "fedbayes"
WALL = SRC / "flower" / "internals.py"


# ----- the installed flwr has every private name the wall needs -------------------------------------
@pytest.mark.parametrize("key", sorted(internals.SYMBOLS))
def test_every_private_symbol_the_wall_needs_is_in_the_installed_flwr(key):
    import flwr

    why = internals.problem(key)
    assert why is None, f"flwr {flwr.__version__}: the private symbol {internals.SYMBOLS[key].path} that fedbayes.flower.internals needs fails its check: {why}"


def test_every_feature_is_available_and_every_symbol_belongs_to_one(caplog):
    caplog.set_level(logging.WARNING, "fedbayes.flower.internals")
    assert internals.flwr_version().startswith(internals.TESTED)
    assert {f: internals.missing(f) for f in internals.FEATURES} == dict.fromkeys(internals.FEATURES, {})
    assert all(internals.available(f) for f in internals.FEATURES) and not caplog.records
    assert {k for keys in internals.FEATURES.values() for k in keys} == set(internals.SYMBOLS) - {"ObjectUnavailableError"}  # that one: the tests' only
    assert internals.chunk_size() == 5 * 1024 * 1024 and len(internals.unavailable_codes()) == 3


# ----- a missing symbol: the stock path, said once ----------------------------------------------------
def _gone(monkeypatch, key: str) -> str:
    """``SYMBOLS[key]`` as a later flwr might have it: moved away. Returns the path the wall names."""
    symbol = internals.SYMBOLS[key]
    moved = internals.Symbol(symbol.module, f"{symbol.name or 'x'}_moved_{key.replace('.', '_')}", symbol.params, symbol.kind)
    monkeypatch.setitem(internals.SYMBOLS, key, moved)
    return moved.path


def _said(caplog, path: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "fedbayes.flower.internals" and path in r.getMessage()]


@pytest.mark.parametrize(
    "key, feature, patch",
    [
        ("supernode.time", "node-sleeps", lambda: internals.patch_node_sleeps(types.SimpleNamespace(sleep=None))),
        ("supernode.pull_objects", "node-object-pulls", internals.shorten_node_pulls),
        ("grid.pull_objects", "server-object-pulls", internals.shorten_server_pulls),
    ],
)
def test_a_patch_whose_symbol_moved_is_not_made_and_says_so_once(key, feature, patch, monkeypatch, caplog):
    caplog.set_level(logging.WARNING, "fedbayes.flower.internals")
    path = _gone(monkeypatch, key)
    assert internals.lookup(key) is None and path in internals.missing(feature)
    assert patch() is False and patch() is False
    (line,) = _said(caplog, path)  # once, naming the symbol
    assert f"fedbayes's {feature} falls back to Flower's stock path" in line


def test_the_loopback_node_keeps_flowers_sleeps_where_its_loop_no_longer_sleeps_through_time(monkeypatch):
    """The shape check: a ``time`` that is not the time module (another clock, or patched already)."""
    monkeypatch.setitem(internals.SYMBOLS, "supernode.time", internals.Symbol("flwr.app", "Message", kind="time"))
    assert internals.problem("supernode.time").startswith("not the time module")
    assert internals.patch_node_sleeps(types.SimpleNamespace(sleep=None)) is False


def test_a_function_that_no_longer_takes_the_backoff_fails_its_check(monkeypatch):
    symbol = internals.SYMBOLS["grid.pull_objects"]
    monkeypatch.setitem(internals.SYMBOLS, "grid.pull_objects", internals.Symbol(symbol.module, symbol.name, (*symbol.params, "poll_interval")))
    assert internals.problem("grid.pull_objects") == "takes no poll_interval"
    assert internals.shorten_server_pulls() is False


def test_without_flowers_error_codes_no_node_is_taken_for_gone_and_the_chunk_size_is_5_mb(monkeypatch, caplog):
    caplog.set_level(logging.WARNING, "fedbayes.flower.internals")
    path = _gone(monkeypatch, "ErrorCode.NODE_UNAVAILABLE")
    assert internals.unavailable_codes() == ()
    _gone(monkeypatch, "FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE")
    assert internals.chunk_size() == internals.DEFAULT_CHUNK_BYTES
    assert len(_said(caplog, path)) == 1


def test_without_the_forked_pull_the_executor_pulls_with_flowers_own(monkeypatch):
    """``executor-object-pulls`` missing: the task's input comes from Flower's ``pull_task_input``
    (here a stand-in module that the wall's table names in its place)."""
    got = []
    stand_in = types.ModuleType("flower_stand_in")
    stand_in.pull_task_input = lambda client: got.append(client) or ("message", "context", "run", "fab")
    monkeypatch.setitem(sys.modules, "flower_stand_in", stand_in)
    monkeypatch.setitem(internals.SYMBOLS, "run_clientapp.pull_task_input", internals.Symbol("flower_stand_in", "pull_task_input", ("client",)))
    _gone(monkeypatch, "pull_and_inflate_object_from_tree")
    assert internals.pull_task_input("client") == ("message", "context", "run", "fab") and got == ["client"]


def test_without_the_runtime_api_names_the_executor_runs_flowers_own_superexec(monkeypatch, caplog):
    caplog.set_level(logging.WARNING)
    path = _gone(monkeypatch, "RuntimeHttpClient")
    ran = []
    monkeypatch.setattr(os, "environ", dict(os.environ))  # main sets the node's environment
    monkeypatch.setattr(os, "execv", lambda exe, argv: ran.append(argv))
    secret_file = "/run/secret"
    assert executor.main(["--runtime-api-address", "10.0.0.2:9094", "--root-certificates", "ca.crt", "--superexec-auth-secret-file", secret_file]) == 0
    (argv,) = ran
    assert Path(argv[0]).name == "flower-superexec"
    assert argv[1:] == ["--runtime-api-address", "10.0.0.2:9094", "--root-certificates", "ca.crt", "--superexec-auth-secret-file", secret_file]
    assert len(_said(caplog, path)) == 1 and any("running Flower's own SuperExec instead" in r.getMessage() for r in caplog.records)


# ----- no other module imports a private flwr name --------------------------------------------------
def _flwr_imports(path: Path) -> list[tuple[int, str, str]]:
    """``(line, module, name)`` of every flwr import in ``path`` (``name`` empty for ``import m``)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, "") for a in node.names if a.name.split(".")[0] == "flwr"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "flwr":
            out += [(node.lineno, node.module, a.name) for a in node.names]
    return out


def _private(module: str, name: str) -> bool:
    """A private flwr name: a module outside Flower's public API (any the wall owns among them), or
    a module path or name that starts with ``_``."""
    parts = [*module.split("."), *([name] if name else [])]
    return module not in internals.PUBLIC_MODULES or module in internals.INTERNAL_MODULES or any(p.startswith("_") for p in parts)


def test_no_module_of_fedbayes_outside_the_wall_imports_a_private_flwr_name():
    found = [
        f"{path.relative_to(SRC.parent)}:{line}: {module}{'.' + name if name else ''}"
        for path in sorted(SRC.rglob("*.py"))
        if path != WALL
        for line, module, name in _flwr_imports(path)
        if _private(module, name)
    ]
    assert found == [], "private flwr names outside fedbayes.flower.internals:\n" + "\n".join(found)
    assert all(_private(m, "") for m in internals.INTERNAL_MODULES) and not _private("flwr.app", "Message") and _private("flwr.app", "_x")
    # the wall itself reaches every private name through SYMBOLS (checked), never by an import
    assert [m for _, m, n in _flwr_imports(WALL) if _private(m, n)] == []


# ----- the object-pull patch ------------------------------------------------------------------------
def test_short_object_pulls_retry_fast_without_a_try_limit_and_only_once():
    seen = []
    module = types.SimpleNamespace(pull_objects=lambda ids, fn, **kw: seen.append(kw) or {})
    assert internals.short_object_pulls(module) and not internals.short_object_pulls(module)
    module.pull_objects(["a"], None)
    module.pull_objects(["a"], None, initial_backoff=2.0)  # a caller's own choice is kept
    assert seen[0] == {"initial_backoff": 0.005, "backoff_cap": 0.05, "max_tries_per_object": None}
    assert seen[1]["initial_backoff"] == 2.0
    assert not internals.short_object_pulls(types.SimpleNamespace())


def test_short_object_pulls_wait_for_the_root_alone_then_pull_the_rest_within_one_time_limit():
    """The message's root is pushed last: while it is missing, the others are not retried one by
    one; both calls share the caller's one overall time limit."""
    pull_objects, ObjectUnavailableError = internals.lookup("inflatable_utils.pull_objects"), internals.lookup("ObjectUnavailableError")
    module = types.SimpleNamespace(pull_objects=pull_objects)
    internals.short_object_pulls(module)
    calls = []

    def fn(object_id):
        calls.append(object_id)
        if object_id == "root" and calls.count("root") < 4:
            raise ObjectUnavailableError(object_id)
        return object_id.encode()

    assert module.pull_objects(["leaf", "record", "root"], fn) == {"leaf": b"leaf", "record": b"record", "root": b"root"}
    assert calls[:4] == ["root"] * 4 and sorted(calls[4:]) == ["leaf", "record"]  # no request for the others while the root is missing

    limits = []

    def fake(ids, fn, **kw):
        limits.append((list(ids), kw["max_time"]))
        time.sleep(0.01)  # the root's pull takes a while
        return dict.fromkeys(ids, b"")

    module = types.SimpleNamespace(pull_objects=fake)
    internals.short_object_pulls(module)
    module.pull_objects(["leaf", "root"], None, max_time=5.0)
    assert [ids for ids, _ in limits] == [["root"], ["leaf"]] and limits[0][1] == 5.0 and 0 < limits[1][1] < 5.0 - 0.005
