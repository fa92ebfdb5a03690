"""Every example config is valid; those on always-available data run end to end."""

import tomllib
from pathlib import Path

import pytest

from fedbayes.config.schema import deep_merge, load_config, read_reference, read_toml, validate
from fedbayes.runs.loop import run_experiment

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.toml"))


def _configs(path):
    raw = read_toml(path)
    if "variants" in raw:
        return [validate({**deep_merge(raw["base"], v), "name": n}) for n, v in raw["variants"].items()]
    return [load_config(path)]


def test_examples_exist():
    names = {p.name for p in EXAMPLES}
    assert {"fmnist_fedavg_iid.toml", "fmnist_compare.toml"} <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_is_valid(path):
    cfgs = _configs(path)
    assert cfgs
    text = path.read_text()
    assert text.lstrip().startswith("#"), "examples open with a comment saying what they run"


def test_demo_is_the_fedlap_papers_setting_with_every_family():
    path = Path(EXAMPLES[0]).parent / "fmnist_compare.toml"
    cfgs = {c.name: c for c in _configs(path)}
    assert set(cfgs) == {"fedavg", "fedprox", "feddyn", "fedpa", "fedep", "fedsep", "fedlap", "fedlap_cov", "fedlap_func", "vbnn_cf"}
    assert all(
        cfgs[m].algorithm.method == "laplace" and cfgs[m].algorithm.preset == "posterior" and cfgs[m].algorithm.default_damping(10) == "adaptive"
        for m in ("fedep", "fedsep")
    )
    assert cfgs["vbnn_cf"].algorithm.aggregation == "cf" and cfgs["vbnn_cf"].model.variational
    assert not any(c.model.variational for n, c in cfgs.items() if n != "vbnn_cf")
    for c in cfgs.values():  # Swaroop et al. 2025 (ADMM and Bayes), Table 1's heterogeneous Fashion-MNIST
        assert c.data.dataset == "fashion_mnist" and c.data.num_clients == 10 and c.data.fraction == 0.1 and c.rounds == 50
        assert c.data.partition == "two_level_dirichlet" and c.model.name == "mlp" and c.server.clients_per_round == 10
    reference = read_reference(tomllib.loads(path.read_text())["reference"], path, list(cfgs))
    assert set(reference.values) == {"fedavg", "fedprox", "feddyn", "fedlap", "fedlap_cov", "fedlap_func"}


def test_bayes_table_has_every_method():
    cfgs = {c.name: c for c in _configs(Path(EXAMPLES[0]).parent / "fmnist_bayes_compare.toml")}
    methods = {(c.algorithm.name, getattr(c.algorithm, "method", None)) for c in cfgs.values()}
    assert methods == {("fedavg", None), ("fedpa", None)} | {(a, m) for a in ("fedep", "fedsep") for m in ("identity", "mcmc", "laplace", "ngvi")}


@pytest.mark.parametrize(
    "name", ["digits_fedprox.toml", "breast_cancer_admm.toml", "synthetic_leaf_fedavg.toml", "least_squares_fedavg.toml", "digits_fedpa_compare.toml"]
)
def test_available_examples_run(tmp_path, name):
    path = Path(EXAMPLES[0]).parent / name
    cfg = _configs(path)[-1].model_copy(update={"rounds": 2, "checkpoint_every": 0})  # a comparison: its last variant
    summary = run_experiment(cfg, tmp_path)
    final = summary["final"]
    assert all(v == v for v in final.values())  # no NaN
    assert (tmp_path / "curves.png").is_file()
