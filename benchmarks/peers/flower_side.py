"""The Flower worker: FedAvg on the workload with Flower's simulation engine, written as Flower's
PyTorch quickstart writes it (Message API): a ``ClientApp`` whose ``@app.train()`` loads the
received ``ArrayRecord`` into the PyTorch MLP, trains one local epoch of plain SGD on its partition
and replies with its weights and ``num-examples``; a ``ServerApp`` whose ``@app.main()`` runs
``flwr.serverapp.strategy.FedAvg.start`` (``fraction_evaluate=0``: no federated evaluation);
``flwr.simulation.run_simulation`` with the Ray backend and ``client_resources`` from the spec.
Round times are taken in the strategy (``configure_train`` to ``aggregate_train``); the final
model is evaluated on the test set after the run.

    python flower_side.py SPEC_JSON

The ClientApp lives in this module (imported by name through ``PYTHONPATH`` in Ray's actors), and
each actor keeps its clients' tensors between tasks, as the quickstart keeps its dataset.
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402
from flwr.serverapp import Grid, ServerApp  # noqa: E402
from flwr.serverapp.strategy import FedAvg  # noqa: E402

SPEC_ENV = "PEERS_FLOWER_SPEC"
_DATA: dict = {}  # per process (Ray actor): the clients' tensors

client = ClientApp()
server = ServerApp()


def _spec() -> dict:
    return json.loads(os.environ[SPEC_ENV])


def _client_data(cid: int):
    import torch

    if "all" not in _DATA:
        spec = _spec()
        torch.set_num_threads(max(1, int(spec["num_cpus"])))
        data = common.load_fashion_mnist(spec["data_dir"])
        _DATA["all"] = (spec, data, common.load_parts(spec["parts"]))
    spec, data, parts = _DATA["all"]
    if cid not in _DATA:
        idx = parts[cid]
        _DATA[cid] = (torch.from_numpy(data["x_train"][idx]), torch.from_numpy(data["y_train"][idx]))
    return spec, _DATA[cid]


@client.train()
def train(msg: Message, context: Context) -> Message:
    import torch

    cid = int(context.node_config["partition-id"])
    spec, (x, y) = _client_data(cid)
    model = common.mlp(spec["hidden"])
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    config = msg.content["config"]
    generator = torch.Generator().manual_seed(spec["seed"] * 1_000_003 + int(config["server-round"]) * 1009 + cid)
    common.local_sgd(model, x, y, float(config["lr"]), spec["batch_size"], spec["epochs"], generator)
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": MetricRecord({"num-examples": len(x)})})
    return Message(content=content, reply_to=msg)


class TimedFedAvg(FedAvg):
    """Flower's FedAvg with each round's start and end noted (``marks``) and its examples counted."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.marks: list[float] = []
        self.examples: list[int] = []

    def configure_train(self, server_round, arrays, config, grid):
        if not self.marks:
            self.marks.append(time.perf_counter())
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round, replies):
        replies = list(replies)
        failed = [m for m in replies if m.has_error()]
        if failed:
            raise RuntimeError(f"round {server_round}: {len(failed)} Flower clients failed: {failed[0].error.reason}")
        out = super().aggregate_train(server_round, replies)
        self.marks.append(time.perf_counter())
        self.examples.append(sum(int(m.content["metrics"]["num-examples"]) for m in replies) * _spec()["epochs"])
        return out


@server.main()
def main_server(grid: Grid, context: Context) -> None:
    spec = _spec()
    k, m = spec["num_clients"], spec["clients_per_round"]
    strategy = TimedFedAvg(fraction_train=m / k, fraction_evaluate=0.0, min_train_nodes=m, min_available_nodes=k)
    import torch

    torch.manual_seed(spec["seed"])
    initial = ArrayRecord(common.mlp(spec["hidden"]).state_dict())
    result = strategy.start(grid=grid, initial_arrays=initial, num_rounds=spec["rounds"], train_config=ConfigRecord({"lr": spec["lr"]}))
    if len(strategy.examples) != spec["rounds"]:
        raise RuntimeError(f"Flower ran {len(strategy.examples)} of {spec['rounds']} rounds")
    # Round r runs from the end of round r - 1 (the first from its configure_train).
    out = common.timing(strategy.marks, strategy.examples)
    torch.save(result.arrays.to_torch_state_dict(), spec["out"] + ".pt")
    with open(spec["out"], "w") as f:
        json.dump(out, f)


def run(spec: dict) -> None:
    import flower_side
    import flwr
    import ray
    import torch
    from flwr.simulation import run_simulation

    t_imported = time.time()
    os.environ[SPEC_ENV] = json.dumps(spec)
    backend = {"client_resources": {"num_cpus": spec["num_cpus"], "num_gpus": 0.0}, "init_args": {"num_cpus": spec["ray_cpus"]}}
    run_simulation(server_app=flower_side.server, client_app=flower_side.client, num_supernodes=spec["num_clients"], backend_config=backend)
    with open(spec["out"]) as f:
        result = json.load(f)
    data = common.load_fashion_mnist(spec["data_dir"])
    model = common.mlp(spec["hidden"])
    model.load_state_dict(torch.load(spec["out"] + ".pt"))
    result.update(
        accuracy=common.accuracy(model, torch.from_numpy(data["x_test"]), torch.from_numpy(data["y_test"])),
        rounds=spec["rounds"], imports_s=t_imported - common.SPAWN_TIME, num_cpus=spec["num_cpus"],
        versions={"torch": torch.__version__, "flwr": flwr.__version__, "ray": ray.__version__},
    )  # fmt: skip
    common.emit(result)


if __name__ == "__main__":
    run(json.loads(sys.argv[1]))
