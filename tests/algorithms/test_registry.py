"""The algorithm registry: its errors, the built-in methods' traits, its laziness, and a method
registered from this file that runs from a TOML config through ``fedbayes run``."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Literal

import jax
import jax.numpy as jnp
import pytest
from pydantic import Field
from typer.testing import CliRunner

from fedbayes.algorithms import registry
from fedbayes.algorithms.base import AGGREGATOR_POLICIES, Algorithm, AlgorithmSpec, BuildContext
from fedbayes.algorithms.fedavg import fedavg
from fedbayes.config.schema import ConfigError, validate
from fedbayes.hparams import HParams

ROOT = Path(__file__).resolve().parents[2]


# ----- a Bayesian method, added from a test file --------------------------------------------------
class GaussAvgConfig(HParams):
    """FedAvg whose posterior is ``N(theta, variance)`` per weight (a stand-in for a Bayesian method)."""

    name: Literal["gauss_avg"] = "gauss_avg"
    variance: float = Field(1e-4, gt=0, description="the posterior's variance per weight")


def build_gauss_avg(hp: GaussAvgConfig, ctx: BuildContext) -> Algorithm:
    def server_posterior(state):
        return state.params, jax.tree.map(lambda p: jnp.full_like(p, hp.variance), state.params)

    return fedavg(ctx.trainer, ctx.server_optimizer)._replace(name="gauss_avg", server_posterior=server_posterior)


GAUSS_AVG = AlgorithmSpec("gauss_avg", GaussAvgConfig, build_gauss_avg, "FedAvg with a fixed-width Gaussian posterior")


@pytest.fixture
def gauss_avg():
    registry.register(GAUSS_AVG)
    yield GAUSS_AVG
    registry.unregister(GAUSS_AVG.name)


# ----- errors ----------------------------------------------------------------------------------------
def test_register_get_and_unregister(gauss_avg):
    assert registry.get("gauss_avg") is gauss_avg and registry.names()[-1] == "gauss_avg"
    assert gauss_avg in registry.specs()
    with pytest.raises(ValueError, match="'gauss_avg' is already registered"):
        registry.register(gauss_avg)
    with pytest.raises(ValueError, match="'fedavg' is already registered"):
        registry.register(AlgorithmSpec("fedavg", GaussAvgConfig, build_gauss_avg))
    with pytest.raises(ValueError, match="expected an AlgorithmSpec"):
        registry.register(("gauss_avg", GaussAvgConfig, build_gauss_avg))
    with pytest.raises(ValueError, match="'fedep' is built in and cannot be removed"):
        registry.unregister("fedep")
    registry.unregister("gauss_avg")
    assert "gauss_avg" not in registry.names()
    with pytest.raises(ValueError, match="unknown algorithm 'gauss_avg'; allowed: fedavg, fedprox"):
        registry.get("gauss_avg")
    registry.unregister("gauss_avg")  # never registered (any more): no error
    registry.register(gauss_avg)  # for the fixture's teardown


def test_a_spec_is_checked_when_declared():
    class Nameless(HParams):
        variance: float = 1.0

    with pytest.raises(ValueError, match="need a name field"):
        AlgorithmSpec("nameless", Nameless, build_gauss_avg)
    with pytest.raises(ValueError, match="hparams must be an HParams subclass"):
        AlgorithmSpec("plain", dict, build_gauss_avg)
    with pytest.raises(ValueError, match="aggregator_policy must be one of wrappable, own, refuses; got 'mine'"):
        AlgorithmSpec("gauss_avg", GaussAvgConfig, build_gauss_avg, aggregator_policy="mine")
    with pytest.raises(ValueError, match="needs an aggregator_note"):
        AlgorithmSpec("gauss_avg", GaussAvgConfig, build_gauss_avg, aggregator_policy="own")


def test_build_checks_the_context_against_the_traits():
    ctx = BuildContext(trainer=None, server_optimizer=None, federation=None, clients_per_round=2)
    with pytest.raises(ValueError, match="fedlap_func: the build context lacks apply_fn .*; feature_spec"):
        registry.build(registry.get("fedlap_func").hparams(name="fedlap_func"), ctx)
    with pytest.raises(ValueError, match="vbnn: the build context lacks keyed_apply_fn"):
        registry.build(registry.get("vbnn").hparams(name="vbnn"), ctx)


# ----- the built-in methods' traits ----------------------------------------------------------------
def test_every_builtin_spec_is_declared_in_its_module_and_consistent():
    specs = registry.builtin_specs()
    assert tuple(s.name for s in specs) == registry.names()[: len(specs)]
    for spec in specs:
        module = importlib.import_module(spec.build.__module__)
        assert spec in module.SPECS and len({s.name for s in module.SPECS}) == len(module.SPECS)
        hp = spec.hparams(name=spec.name)  # every built-in setting has a default
        assert hp.name == spec.name and spec.hparams.section == "algorithm."
        assert spec.aggregator_policy in AGGREGATOR_POLICIES and (spec.aggregator_policy == "wrappable") == (not spec.aggregator_note)
        minimum, why = spec.min_local_epochs(hp)
        assert isinstance(minimum, int) and minimum >= 1 and (minimum == 1 or why)
        assert spec.burn_in_rounds(hp) == getattr(hp, "burn_in_rounds", 0)
        assert spec.summary and not spec.divergence_hint.startswith(("or ", ","))


def test_traits_say_what_the_name_checks_said():
    """The traits reproduce the per-name knowledge that config and run code held before."""
    specs = {s.name: s for s in registry.builtin_specs()}
    has = lambda trait: {n for n, s in specs.items() if getattr(s, trait)}  # noqa: E731
    assert has("exact_server") == {"fedlap", "fedlap_cov", "fedlap_func"}
    assert {n: s.aggregator_policy for n, s in specs.items() if s.aggregator_policy != "wrappable"} == {"vbnn": "own", "fedlap_func": "refuses"}
    assert has("needs_variational_model") == {"vbnn"}
    assert has("needs_feature_spec") == {"fedlap_func"}
    assert has("needs_apply_fn") == {"fedlap_cov", "fedlap_func"}
    assert has("divergence_hint") == {"fedep", "fedsep", "pvi"}
    assert has("calibration_advice") == {"fedep", "fedsep", "pvi", "fedlap_cov"}
    assert has("bayesian") == {"fedpa", "fedep", "fedsep", "fedlap", "fedlap_cov", "fedlap_func", "pvi", "vbnn"}
    fedpa = specs["fedpa"].hparams(name="fedpa", skip_epochs=3, burn_in_rounds=2)
    assert specs["fedpa"].min_local_epochs(fedpa)[0] == 4 and specs["fedpa"].burn_in_rounds(fedpa) == 2
    assert specs["fedep"].min_local_epochs(specs["fedep"].hparams(name="fedep", method="mcmc"))[0] == 2


def test_the_config_reads_the_traits():
    with pytest.raises(ConfigError, match=r"server.aggregator: fedlap_func aggregates .*; allowed: mean; got 'median'"):
        validate({"algorithm": {"name": "fedlap_func"}, "server": {"aggregator": "median"}})
    with pytest.raises(ConfigError, match=r"privacy.clip: fedlap_func .*unset privacy.clip"):
        validate({"algorithm": {"name": "fedlap_func"}, "privacy": {"clip": 1.0}, "server": {"weighting": "uniform"}})
    with pytest.raises(ConfigError, match=r"server.max_precision_share: vbnn .*unset it"):
        validate({"algorithm": {"name": "vbnn"}, "model": {"variational": True}, "server": {"max_precision_share": 0.5}})
    with pytest.raises(ConfigError, match=r"server.optimizer: fedlap_func's server solves its own problem"):
        validate({"algorithm": {"name": "fedlap_func"}, "server": {"lr": 0.5}})
    with pytest.raises(ConfigError, match=r"client.epochs: fedpa takes one sample per epoch after algorithm.skip_epochs \(2\), so it needs epochs >= 3; got 2"):
        validate({"algorithm": {"name": "fedpa", "skip_epochs": 2}, "client": {"epochs": 2}})
    with pytest.raises(ConfigError, match=r"model.variational: algorithm 'vbnn' trains variational models"):
        validate({"algorithm": {"name": "vbnn"}})


# ----- plain imports, lazy loading -------------------------------------------------------------------
def test_the_package_does_not_shadow_its_modules():
    import fedbayes.algorithms.fedep as fedep_module
    from fedbayes.algorithms import fedlap

    assert fedlap.__name__ == "fedbayes.algorithms.fedlap" and callable(fedlap.fedlap)
    assert fedep_module.__name__ == "fedbayes.algorithms.fedep" and fedep_module.SPECS == (fedep_module.FEDEP, fedep_module.FEDSEP)


def _imported_after(code: str) -> set[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "JAX_PLATFORMS": "cpu"}
    out = subprocess.run(
        [sys.executable, "-c", f"import sys, json\n{code}\nprint(json.dumps(sorted(sys.modules)))"], env=env, capture_output=True, text=True, check=True
    )
    return set(json.loads(out.stdout.splitlines()[-1]))


def test_validating_a_config_imports_only_the_named_method():
    loaded = _imported_after("from fedbayes.config.schema import validate\nvalidate({'algorithm': {'name': 'fedprox'}})")
    methods = {m.rsplit(".", 1)[1] for m in loaded if m.startswith("fedbayes.algorithms.") and not m.rsplit(".", 1)[1].startswith("_")}
    # fedavg: the config's default method; point: the local-delta client FedProx shares with FedAvg
    assert methods == {"base", "registry", "server_opt", "fedavg", "point", "fedprox"}, methods
    assert not any(m.startswith(("fedbayes.sim", "fedbayes.runs", "flax")) for m in loaded)
    assert {m for m in loaded if m.startswith("fedbayes.models")} <= {
        "fedbayes.models",
        "fedbayes.models.registry",
        "fedbayes.models.tasks",
    }  # the model registry, no model


# ----- a registered Bayesian method runs from a TOML file through `fedbayes run` ------------------
CONFIG = """
name = "gauss_avg_run"
rounds = 2
checkpoint_every = 0
[data]
dataset = "digits"
num_clients = 4
[model]
name = "logreg"
[client]
lr = 0.1
batch_size = 32
[server]
clients_per_round = 2
[algorithm]
name = "gauss_avg"
variance = 0.001
[evaluation]
marginal_samples = 3
"""


def test_a_registered_bayesian_method_runs_from_a_toml_config(gauss_avg, tmp_path):
    from fedbayes.cli import app
    from fedbayes.runs.folder import read_metrics

    path = tmp_path / "gauss.toml"
    path.write_text(CONFIG)
    out = tmp_path / "run"
    res = CliRunner().invoke(app, ["run", str(path), "--out", str(out)])
    assert res.exit_code == 0, res.output
    records = read_metrics(out / "metrics.jsonl")
    assert [r["round"] for r in records] == [0, 1, 2]
    for r in records:
        assert {"accuracy", "accuracy_marg", "nll_marg", "ece_marg"} <= set(r), r
    assert 'name = "gauss_avg"' in (out / "config.toml").read_text()
    registry.unregister("gauss_avg")  # a config naming it no longer validates
    with pytest.raises(ConfigError, match="algorithm.name: unknown algorithm 'gauss_avg'; allowed: fedavg"):
        validate({"algorithm": {"name": "gauss_avg"}})
    registry.register(gauss_avg)
