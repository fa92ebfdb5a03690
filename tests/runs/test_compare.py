"""Comparison orchestration (fedbayes.runs.compare) without running: reading comparison files, the
runs of a comparison with and without seeds, and what a diverged summary keeps."""

from pathlib import Path

import pytest

from fedbayes.config.schema import ConfigError, validate
from fedbayes.runs import compare as cmp

COMPARISON = """
seeds = [0, 2]
[base]
rounds = 2
[base.data]
dataset = "digits"
num_clients = 3
[base.server]
clients_per_round = 3
[variants.fedavg.algorithm]
name = "fedavg"
[variants.fedprox.algorithm]
name = "fedprox"
"""


def _file(tmp_path, text, name="c.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_a_comparison_file_with_common_and_targeted_overrides(tmp_path):
    path = _file(tmp_path, COMPARISON)
    runs = cmp.load_comparison([path], ["rounds=3", "fedprox.client.lr=0.5"])
    assert list(runs) == ["fedavg", "fedprox"] and all(c.rounds == 3 for c in runs.values())
    assert runs["fedprox"].client.lr == 0.5 and runs["fedavg"].client.lr != 0.5 and runs["fedavg"].name == "fedavg"
    assert cmp.file_seeds([path]) == [0, 2] and cmp.file_reference([path], list(runs)) is None
    assert cmp.split_overrides(["a=1", "fedavg.b=2", "fedavg.c"], ["fedavg"]) == (["a=1", "fedavg.c"], {"fedavg": ["b=2"]})


def test_bad_comparison_files_are_one_line_naming_the_field(tmp_path):
    with pytest.raises(ConfigError, match="unknown top-level key"):
        cmp.load_comparison([_file(tmp_path, "extra = 1\n" + COMPARISON)], [])
    with pytest.raises(ConfigError, match="at least one"):
        cmp.load_comparison([_file(tmp_path, "[base]\nrounds = 2\n")], [])
    with pytest.raises(ConfigError, match="variant 'fedprox'"):
        cmp.load_comparison([_file(tmp_path, COMPARISON)], ["fedprox.algorithm.mu=-1"])
    other = _file(tmp_path, COMPARISON.replace("seeds = [0, 2]", "seeds = [1]"), "d.toml")
    with pytest.raises(ConfigError, match="differs from another file's"):
        cmp.file_seeds([_file(tmp_path, COMPARISON), other])


def test_one_seed_is_a_list_of_one_run_per_variant(tmp_path):
    runs = cmp.load_comparison([_file(tmp_path, COMPARISON)], [])
    plain = cmp.jobs(runs, tmp_path, None)
    assert [(j.variant, j.seed, j.folder, j.label) for j in plain] == [
        ("fedavg", None, tmp_path / "fedavg", "fedavg"),
        ("fedprox", None, tmp_path / "fedprox", "fedprox"),
    ]
    seeded = cmp.jobs(runs, tmp_path, [0, 2])
    assert [(j.variant, j.seed, j.config.seed, j.folder.relative_to(tmp_path).as_posix(), j.label) for j in seeded][:2] == [
        ("fedavg", 0, 0, "fedavg/seed_0", "fedavg seed 0"),
        ("fedavg", 2, 2, "fedavg/seed_2", "fedavg seed 2"),
    ]
    assert cmp.conflicts(seeded) == []


def test_a_diverged_summary_keeps_where_not_its_numbers():
    diverged = {"name": "m", "algorithm": "fedavg", "rounds": 4, "final": {"accuracy": 0.1}, "diverged": {"round": 2, "metric": "training loss"}}
    assert cmp.without_numbers(diverged) == {"name": "m", "algorithm": "fedavg", "rounds": 4, "diverged": {"round": 2, "metric": "training loss"}}
    fine = {"name": "m", "final": {"accuracy": 0.9}}
    assert cmp.without_numbers(fine) is fine
    over_seeds = {"name": "m", "seeds": [0, 1], "runs": {"0": fine, "1": diverged}}
    assert cmp.without_numbers(over_seeds)["runs"]["1"] == cmp.without_numbers(diverged)


def test_overrides_merge_by_key_the_later_winning():
    assert cmp.merge_overrides(["algorithm.mu=0.1", "rounds=3"], ["algorithm.mu = 0.5", "seed=1"]) == ["rounds=3", "algorithm.mu = 0.5", "seed=1"]


def test_a_files_overrides_apply_before_remembered_ones_and_the_command_line(tmp_path):
    path = _file(tmp_path, COMPARISON + '\n[overrides]\nfedprox = ["client.lr=0.3", "rounds=4"]\n')
    runs, items = cmp.load_comparison_with_overrides([path], ["fedprox.rounds=5"], {"fedprox": ["client.lr=0.2"], "fedavg": ["seed=7"]})
    assert runs["fedprox"].client.lr == 0.2 and runs["fedprox"].rounds == 5 and runs["fedavg"].seed == 7
    assert items == {"fedprox": ["client.lr=0.2", "rounds=5"], "fedavg": ["seed=7"]}
    with pytest.raises(ConfigError, match="overrides"):
        cmp.load_comparison([_file(tmp_path, COMPARISON + "\n[overrides]\nfedprox = 3\n")], [])


def test_the_bayesian_variants_are_those_whose_method_says_so(tmp_path):
    text = COMPARISON + '[variants.fedep.algorithm]\nname = "fedep"\n[variants.fedlap.algorithm]\nname = "fedlap"\n'
    runs = cmp.load_comparison([_file(tmp_path, text)], [])
    assert cmp.bayesian_variants(runs) == {"fedep", "fedlap"}


def test_the_plots_title_says_what_was_run(tmp_path):
    runs = cmp.load_comparison([_file(tmp_path, COMPARISON)], [])
    assert cmp.describe("c", runs) == "c: 2 methods, digits, 3 clients, 2 rounds"
    runs = cmp.load_comparison([_file(tmp_path, COMPARISON)], ["data.num_clients=6", "data.fraction=0.5", "fedprox.rounds=4"])
    assert cmp.describe("c", runs) == "c: 2 methods, digits (50%), 6 clients (3 per round), 2, 4 rounds"
    leaf = validate({"data": {"dataset": "leaf"}, "server": {"clients_per_round": 2}})
    assert cmp.describe("c", {"leaf": leaf}) == "c: 1 method, leaf, the data's own clients (2 per round), 10 rounds"
