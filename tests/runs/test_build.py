"""Building a run from its config: the clients of data that brings its own (an unset
``data.num_clients``)."""

from __future__ import annotations

import numpy as np
import pytest

from fedbayes.config.schema import ConfigError, validate
from fedbayes.data import writers
from fedbayes.runs.build import build_experiment, load_data, split_clients


def _emnist(tmp_path, **server) -> dict:
    folder = writers.write_fed_emnist(tmp_path / "tff", np.random.default_rng(0), num_clients=4)
    return {"data": {"dataset": "emnist", "data_dir": str(folder)}, "server": server}


def test_a_cohort_larger_than_the_datas_own_clients_is_one_line_naming_it(tmp_path):
    config = validate(_emnist(tmp_path))  # clients_per_round = 10, and the files hold 4 writers
    with pytest.raises(ConfigError, match=r"^config error: server.clients_per_round: must be <= data.num_clients \(4, the emnist data's clients\); got 10$"):
        split_clients(config, load_data(config))


def test_a_num_clients_given_must_still_be_the_datas_own(tmp_path):
    raw = _emnist(tmp_path, clients_per_round=2)
    config = validate({**raw, "data": {**raw["data"], "num_clients": 5}})
    with pytest.raises(ConfigError, match=r"data.num_clients: the emnist data has 4 clients in its natural partition; got 5 \(set data.num_clients = 4\)"):
        split_clients(config, load_data(config))


def test_a_run_on_your_clients_has_one_client_per_client_id(tmp_path):
    rng = np.random.default_rng(0)
    rows = ["client,f1,f2,label"] + [f"{i % 3},{rng.normal():.4f},{rng.normal():.4f},{i % 2}" for i in range(60)]
    (tmp_path / "own.csv").write_text("\n".join(rows) + "\n")
    config = validate(
        {
            "data": {"dataset": "files", "path": str(tmp_path / "own.csv"), "client_column": "client"},
            "model": {"name": "logreg"},
            "server": {"clients_per_round": 3},
        }
    )
    exp = build_experiment(config)
    assert config.data.num_clients is None and exp.federation.num_clients == 3
    assert list(exp.federation.sizes) == [16, 16, 16]  # 20 rows each, 0.2 of them held out for testing
