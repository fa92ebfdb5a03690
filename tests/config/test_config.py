"""Config validation: bad configs are rejected with one line naming the field and what is allowed."""

import pytest

from fedbayes.config.schema import ConfigError, RunConfig, apply_overrides, deep_merge, load_config, to_toml, validate

BAD = [
    ({"server": {"clients_per_round": 20}}, "server.clients_per_round: must be <= data.num_clients (10); got 20"),
    ({"client": {"lr": 0}}, "client.lr: Input should be greater than 0"),
    ({"server": {"lr": -1.0}}, "server.lr: Input should be greater than 0"),
    ({"data": {"alpha": 0}}, "data.alpha: Input should be greater than 0"),
    ({"data": {"alpha2": -1}}, "data.alpha2: Input should be greater than 0"),
    ({"algorithm": {"name": "feddyn", "alpha": 0}}, "algorithm.alpha: Input should be greater than 0"),
    ({"foo": 1}, "foo: unknown key; allowed keys here: name, seed, rounds"),
    ({"server": {"bogus": 1}}, "server.bogus: unknown key; allowed keys here: clients_per_round"),
    ({"algorithm": {"name": "feddyn", "rho": 1}}, "algorithm.rho: unknown key; allowed keys here: name, alpha, weight_decay"),
    ({"algorithm": {"name": "nope"}}, "algorithm.name: unknown algorithm 'nope'; allowed: fedavg, fedprox, feddyn, admm"),
    ({"rounds": "ten"}, "rounds: Input should be a valid integer"),
    ({"data": {"partition": "zzz"}}, "data.partition: Input should be 'iid', 'dirichlet', 'two_level_dirichlet', 'shards' or 'natural'"),
    ({"client": {"momentum": 1.0}}, "client.momentum: Input should be less than 1"),
    ({"model": {"name": "linear"}}, "model.name: the least_squares dataset needs model 'linear'"),
    ({"data": {"partition": "natural"}}, "data.partition: 'natural' needs a dataset with client ids"),
]


@pytest.mark.parametrize("raw,message", BAD)
def test_bad_configs_give_one_line_naming_the_field(raw, message):
    with pytest.raises(ConfigError) as exc:
        validate(raw)
    text = str(exc.value)
    assert "\n" not in text
    assert text.startswith("config error: ")
    assert message in text, text


def test_defaults_validate_and_round_trip_through_toml(tmp_path):
    cfg = validate({"algorithm": {"name": "fedprox", "mu": 0.1}})
    path = tmp_path / "c.toml"
    path.write_text(to_toml(cfg))
    again = load_config(path)
    assert again == cfg
    assert isinstance(again, RunConfig) and again.algorithm.mu == 0.1


def test_overrides_are_parsed_as_toml_values():
    raw = apply_overrides({}, ["server.lr=0.5", "algorithm.name=fedprox", "model.hidden=[10, 5]", "data.dataset=digits"])
    cfg = validate(raw)
    assert cfg.server.lr == 0.5 and cfg.algorithm.name == "fedprox" and cfg.model.hidden == (10, 5)
    with pytest.raises(ConfigError, match="expected key=value"):
        apply_overrides({}, ["server.lr"])


def test_deep_merge_switching_algorithm_drops_old_keys():
    base = {"algorithm": {"name": "fedprox", "mu": 0.1}, "server": {"lr": 1.0, "optimizer": "sgd"}}
    merged = deep_merge(base, {"algorithm": {"name": "feddyn"}, "server": {"optimizer": "momentum"}})
    assert merged["algorithm"] == {"name": "feddyn"}
    assert merged["server"] == {"lr": 1.0, "optimizer": "momentum"}
    validate(merged)


def test_missing_or_broken_files(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "none.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("rounds = = 3")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(bad)
