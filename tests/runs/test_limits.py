"""The sizes the out-of-memory line names (fedbayes.runs.limits.size_settings): settings the
run's dataset reads, largest first."""

from fedbayes.config.schema import validate
from fedbayes.runs.limits import size_settings


def _config(dataset: str, model: str = "mlp", hidden=(20000,)):
    return validate(
        {
            "data": {"dataset": dataset, "num_clients": 4},
            "model": {"name": model, **({"hidden": list(hidden)} if model == "mlp" else {})},
            "server": {"clients_per_round": 2},
            "algorithm": {"name": "fedavg"},
        }
    )


def test_a_dataset_is_not_told_to_lower_settings_it_does_not_read():
    emnist = size_settings(_config("emnist"))
    assert emnist[0] == "model.hidden = [20000]" and not any(s.startswith("data.") for s in emnist), emnist
    nwp = size_settings(_config("stackoverflow_nwp", model="lstm_nwp"))
    assert "data.vocab_size = 10000" in nwp and not any(s.startswith("data.num_tags") for s in nwp), nwp
