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
    ({"data": {"partition": "zzz"}}, "data.partition: unknown partition 'zzz'; allowed: iid, dirichlet, two_level_dirichlet, shards, natural"),
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


def test_the_evaluation_section():
    cfg = validate({})
    assert (cfg.evaluation.marginal_samples, cfg.evaluation.predictive) == (10, "sample")
    cfg = validate({"algorithm": {"name": "pvi"}, "evaluation": {"marginal_samples": 3, "predictive": "linearised"}})
    assert (cfg.evaluation.marginal_samples, cfg.evaluation.predictive) == (3, "linearised")
    for raw, message in (
        ({"evaluation": {"marginal_samples": 0}}, "evaluation.marginal_samples: Input should be greater than or equal to 1"),
        ({"evaluation": {"predictive": "glm"}}, "evaluation.predictive: Input should be 'sample' or 'linearised'; got 'glm'"),
        (
            {"evaluation": {"samples": 3}},
            "evaluation.samples: unknown key; allowed keys here: marginal_samples, predictive, prior_precision, subset_of_weights, conformal_alpha, calibration_fraction, conformal_score",
        ),
        (
            {"algorithm": {"name": "fedep", "marginal_samples": 5}, "evaluation": {"marginal_samples": 4}},
            "evaluation.marginal_samples: given as 4 and, in the old place algorithm.marginal_samples, as 5; keep the one under [evaluation]",
        ),
    ):
        with pytest.raises(ConfigError) as exc:
            validate(raw)
        assert "\n" not in str(exc.value) and message in str(exc.value), str(exc.value)


def test_the_config_and_the_evaluators_agree_on_predictives():
    from fedbayes.config import schema
    from fedbayes.evaluation.evaluators import PREDICTIVES

    assert schema.PREDICTIVES == PREDICTIVES


def _old_form(cfg: RunConfig) -> dict:
    """``cfg`` as a run folder or checkpoint stored it before the [evaluation] section existed."""
    raw = cfg.model_dump(mode="json", exclude_none=True)  # as to_toml writes it
    evaluation = raw.pop("evaluation")
    raw["algorithm"].update({k: evaluation[k] for k in ("marginal_samples", "predictive")})  # prior_precision came later
    return raw


def test_configs_written_before_the_evaluation_section_are_the_same_config(tmp_path):
    import tomli_w

    from fedbayes.config.schema import resolved, same_config
    from fedbayes.runs.resume import check_resume_config

    # the keys added after the section (prior_precision, subset_of_weights) at what they meant then
    evaluation = {"marginal_samples": 5, "predictive": "linearised", "prior_precision": "fixed", "subset_of_weights": "all"}
    cfg = validate({"algorithm": {"name": "fedep", "burn_in_rounds": 1}, "evaluation": evaluation})
    old = _old_form(cfg)
    assert old["algorithm"]["marginal_samples"] == 5 and "evaluation" not in old
    loaded = load_config_text(tmp_path, tomli_w.dumps(old))  # an old example file still loads, with this version's new keys
    assert loaded.algorithm == cfg.algorithm and (loaded.evaluation.marginal_samples, loaded.evaluation.predictive) == (5, "linearised")
    assert resolved(old) == cfg.model_dump(mode="json")
    path = tmp_path / "config.toml"
    path.write_text(tomli_w.dumps(old))
    assert same_config(path, cfg)
    assert not same_config(path, validate({"algorithm": {"name": "fedep", "burn_in_rounds": 1}, "evaluation": {"marginal_samples": 5, "predictive": "sample"}}))
    # resuming from a checkpoint that recorded the old form: no change to accept
    assert check_resume_config(cfg, {"config": old, "config_hash": "older", "round": 3}, tmp_path) == {}
    other = validate({"algorithm": {"name": "fedep", "burn_in_rounds": 1}, "evaluation": {"marginal_samples": 6, "predictive": "linearised"}})
    with pytest.raises(ConfigError, match=r"evaluation\.marginal_samples \(5 -> 6\)"):
        check_resume_config(other, {"config": old, "config_hash": "older", "round": 3}, tmp_path)


def load_config_text(tmp_path, text: str) -> RunConfig:
    path = tmp_path / "written.toml"
    path.write_text(text)
    return load_config(path)


def test_the_reference_lists_the_evaluation_section_and_every_registered_method():
    from fedbayes.algorithms import registry
    from fedbayes.config import reference

    names = reference.section_names()
    assert "evaluation" in names and all(f"algorithm.{n}" in names for n in registry.names())
    fedep = reference.select("fedep")[0]
    assert not {"marginal_samples", "predictive"} & {k.name for k in fedep.keys}  # (its prior_precision is the prior's own)
    assert {k.name for k in reference.select("evaluation")[0].keys} == {
        "marginal_samples",
        "predictive",
        "prior_precision",
        "subset_of_weights",
        "conformal_alpha",
        "calibration_fraction",
        "conformal_score",
        "personal_fraction",
        "personal_weight",
        "personal_by",
        "personal_epochs",
    }


def test_the_predictive_and_prior_precision_default_to_what_matches_the_posterior():
    """Unset, ``evaluation.predictive`` and ``evaluation.prior_precision`` come from the method's
    traits (Laplace/GGN posteriors: linearised, marglik); a set value wins; the validated config
    (and so the run's config.toml) holds the resolved values."""
    cases = {
        "fedavg": ("sample", "fixed", "all"),
        "pvi": ("sample", "fixed", "all"),
        "fedlap_cov": ("linearised", "marglik", "last_layer"),
        "fedlap": ("sample", "fixed", "all"),  # no posterior to evaluate (server_posterior is None): the traits' defaults
        "fedep": ("linearised", "marglik", "last_layer"),  # the laplace method: a diagonal Laplace
        "fedep/identity": ("linearised", "fixed", "all"),  # the identity method's variance is a scaled prior
    }
    for name, want in cases.items():
        name, _, method = name.partition("/")
        e = validate({"algorithm": {"name": name, **({"method": method} if method else {})}}).evaluation
        assert (e.predictive, e.prior_precision, e.subset_of_weights) == want, name
    for method, want in (("laplace", ("linearised", "marglik")), ("ngvi", ("linearised", "marglik")), ("mcmc", ("sample", "fixed"))):
        e = validate({"algorithm": {"name": "fedsep", "method": method}, "client": {"epochs": 2}}).evaluation
        assert (e.predictive, e.prior_precision) == want, method
    # a flat prior (no prior precision, no weight decay): nothing to re-choose
    assert (
        validate(
            {"algorithm": {"name": "fedep", "method": "laplace", "weight_decay": 0.0, "prior_precision": 0.0, "init": "uniform"}}
        ).evaluation.prior_precision
        == "fixed"
    )
    e = validate({"algorithm": {"name": "fedlap_cov"}, "evaluation": {"predictive": "sample", "prior_precision": "fixed"}}).evaluation
    assert (e.predictive, e.prior_precision) == ("sample", "fixed")
    e = validate({"algorithm": {"name": "fedlap_cov"}, "data": {"validation_fraction": 0.1}, "evaluation": {"prior_precision": "validation"}}).evaluation
    assert e.prior_precision == "validation"
    text = to_toml(validate({"algorithm": {"name": "fedlap_cov"}}))
    assert 'predictive = "linearised"' in text and 'prior_precision = "marglik"' in text and 'subset_of_weights = "last_layer"' in text
    assert validate({"algorithm": {"name": "fedlap_cov"}, "evaluation": {"subset_of_weights": "all"}}).evaluation.subset_of_weights == "all"
    # the old place of predictive still counts as set
    assert validate({"algorithm": {"name": "fedlap_cov", "predictive": "sample"}}).evaluation.predictive == "sample"


def test_a_prior_precision_search_the_posterior_cannot_take_is_one_line():
    for raw, message in (
        (
            {"algorithm": {"name": "pvi"}, "evaluation": {"prior_precision": "marglik"}},
            "evaluation.prior_precision: pvi (as configured) has no Laplace-family posterior",
        ),
        ({"algorithm": {"name": "fedavg"}, "evaluation": {"prior_precision": "validation"}}, "allowed: fixed; got 'validation'"),
        (
            {"algorithm": {"name": "fedlap_cov"}, "evaluation": {"prior_precision": "validation"}},
            "evaluation.prior_precision: 'validation' chooses on the validation split; set data.validation_fraction > 0",
        ),
        (
            {"algorithm": {"name": "fedlap_cov"}, "evaluation": {"prior_precision": "grid"}},
            "evaluation.prior_precision: Input should be 'fixed', 'marglik' or 'validation'",
        ),
    ):
        with pytest.raises(ConfigError) as exc:
            validate(raw)
        assert "\n" not in str(exc.value) and message in str(exc.value), str(exc.value)


def test_the_config_and_the_evaluation_agree_on_prior_precisions_and_subsets():
    from fedbayes.config import schema
    from fedbayes.evaluation.evaluators import SUBSETS
    from fedbayes.evaluation.prior_precision import SEARCHES

    assert schema.PRIOR_PRECISIONS == SEARCHES and schema.SUBSETS == SUBSETS


def test_a_stored_config_without_the_keys_evaluates_as_it_did(tmp_path):
    """A run folder or checkpoint written before the defaults depended on the method lacks
    ``predictive`` (or ``prior_precision``): it meant the sampled predictive at the method's own
    prior, and reading it as stored keeps that, for resolved(), same_config and a resume."""
    from fedbayes.config.schema import resolved, same_config, stored_meaning

    old = validate({"algorithm": {"name": "fedlap_cov"}, "evaluation": {"predictive": "sample", "prior_precision": "fixed", "subset_of_weights": "all"}})
    raw = old.model_dump(mode="json", exclude_none=True)
    del raw["evaluation"]["predictive"], raw["evaluation"]["prior_precision"], raw["evaluation"]["subset_of_weights"]
    assert validate(stored_meaning(raw)) == old and resolved(raw) == old.model_dump(mode="json")
    assert validate(raw) != old  # as a new config: this version's defaults
    assert stored_meaning(old.model_dump(mode="json")) == old.model_dump(mode="json")  # a new run records both keys
    path = tmp_path / "config.toml"
    path.write_text(to_toml(old).replace('predictive = "sample"\n', "").replace('prior_precision = "fixed"\n', "").replace('subset_of_weights = "all"\n', ""))
    assert same_config(path, old) and not same_config(path, validate({"algorithm": {"name": "fedlap_cov"}}))


def test_a_stored_config_without_max_steps_keeps_its_epoch_cap():
    """``client.max_steps`` (a converging small client's step floor) did not exist before
    2026-11-28: a stored run without it capped every client at ``max_epochs`` epochs."""
    from fedbayes.config.schema import stored_meaning

    assert validate({}).client.max_steps == 200
    old = {"algorithm": {"name": "pvi"}, "client": {"stop": "converged", "max_epochs": 20}}
    assert validate(stored_meaning(old)).client.max_steps == 0
    new = validate({"algorithm": {"name": "pvi"}}).model_dump(mode="json")
    assert stored_meaning(new)["client"]["max_steps"] == 200


def test_resume_reads_a_run_folders_config_as_it_was_written(tmp_path):
    """``fedbayes resume`` loads the folder's config.toml with stored=True: an older FedLap-Cov run
    (no predictive, prior_precision or subset_of_weights) resumes with the sampled predictive at its
    own prior, as it evaluated, and a new config file gets this version's defaults."""
    from fedbayes.cli.common import load

    text = to_toml(
        validate({"algorithm": {"name": "fedlap_cov"}, "evaluation": {"predictive": "sample", "prior_precision": "fixed", "subset_of_weights": "all"}})
    )
    path = tmp_path / "config.toml"
    path.write_text(text.replace('predictive = "sample"\n', "").replace('prior_precision = "fixed"\n', "").replace('subset_of_weights = "all"\n', ""))
    e = load(path, [], stored=True).evaluation
    assert (e.predictive, e.prior_precision, e.subset_of_weights) == ("sample", "fixed", "all")
    e = load(path, []).evaluation
    assert (e.predictive, e.prior_precision, e.subset_of_weights) == ("linearised", "marglik", "last_layer")
    assert load(path, ["evaluation.predictive=linearised"], stored=True).evaluation.predictive == "linearised"  # --set still wins


def test_a_stored_config_keeps_the_method_defaults_it_was_written_with():
    """Run folders written before the posterior defaults (FedEP's presets, PVI's and FedLap-Cov's
    damping 0.5, the VBNN's bayes variant) resume with the settings they ran: each method's ``stored_meaning`` fills the keys
    such a config lacks; a config written now records them and is kept as it is."""
    from fedbayes.config.schema import stored_meaning

    # [algorithm] tables as the resolved config.toml of the version before held them (None left out)
    old_fedep = {"name": "fedep", "method": "laplace", "scale": 500.0, "weight_decay": 1e-4, "clip_ratio": 2.0, "prior_precision": 0.0}
    old_pvi = {"name": "pvi", "delta": 1.0, "samples": 1}
    old_cov = {"name": "fedlap_cov", "delta": 1.0}
    server, data = {"clients_per_round": 4}, {"num_clients": 8, "dataset": "digits"}
    fedep = validate(stored_meaning({"algorithm": old_fedep, "server": server, "data": data})).algorithm
    assert fedep.preset == "paper" and fedep.ngvi_bias_correction is False and fedep.default_damping(4) == 0.25 and fedep.scale == 500.0
    assert validate({"algorithm": old_fedep, "server": server, "data": data}).algorithm.preset == "posterior"  # as a new config
    old_pvi_run = validate(stored_meaning({"algorithm": old_pvi, "server": server, "data": data})).algorithm
    assert old_pvi_run.rho == 0.25 and old_pvi_run.estimator == "weights"
    assert validate({"algorithm": old_pvi, "server": server, "data": data}).algorithm.estimator == "local"  # as a new config
    assert validate(stored_meaning({"algorithm": old_cov, "server": server, "data": data})).algorithm.rho == 0.125
    old_vbnn = {"algorithm": {"name": "vbnn", "aggregation": "gaa"}, "model": {"name": "mlp", "variational": True}, "server": server, "data": data}
    assert validate(stored_meaning(old_vbnn)).algorithm.variant == "paper" and validate(old_vbnn).algorithm.variant == "bayes"
    for name in ("fedep", "pvi", "fedlap_cov", "vbnn"):
        model = {"name": "mlp", "variational": name == "vbnn"}
        new = validate({"algorithm": {"name": name}, "model": model, "server": server, "data": data}).model_dump(mode="json", exclude_none=True)
        assert stored_meaning(new) == new


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"evaluation": {"conformal_alpha": 1.0}}, "config error: evaluation.conformal_alpha: Input should be less than 1"),
        ({"evaluation": {"conformal_alpha": 0.1, "calibration_fraction": 0}}, "config error: evaluation.calibration_fraction: Input should be greater than 0"),
        (
            {"evaluation": {"conformal_alpha": 0.1, "calibration_fraction": 0.5}, "data": {"validation_fraction": 0.5}},
            "config error: evaluation.calibration_fraction: with data.validation_fraction = 0.5 nothing is left to train on",
        ),
        (
            {"evaluation": {"conformal_alpha": 0.1}, "data": {"dataset": "least_squares"}, "model": {"name": "linear"}},
            "config error: evaluation.conformal_alpha: conformal prediction sets here are for classification",
        ),
        ({"evaluation": {"conformal_score": "raps"}}, "config error: evaluation.conformal_score: Input should be 'lac' or 'aps'"),
    ],
)
def test_bad_conformal_settings_are_one_line(raw, message):
    with pytest.raises(ConfigError) as exc:
        validate(raw)
    assert "\n" not in str(exc.value) and message in str(exc.value), str(exc.value)


def test_the_config_and_the_evaluation_agree_on_conformal_scores():
    from fedbayes.config import schema
    from fedbayes.evaluation.conformal import SCORES

    assert schema.CONFORMAL_SCORES == SCORES
    assert validate({}).evaluation.conformal_alpha is None  # off unless asked


def test_the_data_table_takes_each_key_from_the_one_spec_settings_that_declares_it():
    from fedbayes.config.schema import DataConfig
    from fedbayes.data import partitions
    from fedbayes.data import registry as datasets

    declared = datasets.settings_fields([*partitions.builtin_specs(), *datasets.builtin_specs()])  # raises on a key declared twice
    fields = DataConfig.model_fields
    assert set(fields) - set(declared) == {
        "dataset",
        "data_dir",
        "fraction",
        "num_clients",
        "partition",
        "validation_fraction",
        "standardize",
        "on_demand",
        "cache_clients",
        "cache_bytes",
    }
    for key, own in declared.items():
        flat = fields[key]
        assert (flat.annotation, flat.default, flat.metadata, flat.description) == (own.annotation, own.default, own.metadata, own.description), key
    for spec in [*partitions.builtin_specs(), *datasets.builtin_specs()]:
        for key in spec.setting_keys:  # a key several specs read is one field, the same in each
            assert spec.settings.model_fields[key].description == declared[key].description


@pytest.mark.parametrize(
    "data,clients",
    [
        ({}, 10),
        ({"dataset": "digits", "partition": "dirichlet"}, 10),
        ({"dataset": "files", "path": "x.csv"}, 10),  # no client column: nothing to count
        ({"dataset": "synthetic_leaf"}, 10),  # generated: it makes as many clients as asked for
        ({"dataset": "cifar100"}, 10),
        ({"dataset": "leaf"}, None),  # the data's own, counted when it is loaded
        ({"dataset": "emnist", "partition": "iid"}, None),
        ({"dataset": "stackoverflow_lr"}, None),
        ({"dataset": "files", "path": "x.csv", "client_column": "c"}, None),
        ({"dataset": "arrays", "partition": "natural"}, None),
        ({"dataset": "leaf", "num_clients": 7}, 7),
    ],
)
def test_an_unset_num_clients_is_ten_unless_the_data_brings_its_own_clients(data, clients):
    config = validate({"data": data, "server": {"clients_per_round": 2}})
    assert config.data.num_clients == clients
    if clients is None:  # written out without it, read back the same
        assert "num_clients" not in to_toml(config) and validate(config.model_dump(mode="json")) == config


def test_the_reference_says_what_an_unset_num_clients_means():
    from fedbayes.config.reference import select

    (section,) = select("data")
    (key,) = [k for k in section.keys if k.name == "num_clients"]
    assert key.default == "none" and "unset: the data's own number of clients" in key.meaning and "else 10" in key.meaning
