"""Flower's own FedAvg (``flwr.serverapp.strategy.FedAvg``) on the model and data of a fedbayes
config: the baseline of benchmarks/flower_overhead.py.

The ClientApp trains as fedbayes's FedAvg client does (the same node setup, key and shuffles:
:mod:`fedbayes.flower.node`; the data spec comes with the strategy's train config) and returns
its new parameters; the ServerApp is Flower's strategy
(its own sampling, polling and weighted averaging). Run config: ``config`` (the TOML file) and
``out`` (a JSON file for the ServerApp's timing).
"""

from __future__ import annotations

import json
import time

from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

clientapp = ClientApp()
serverapp = ServerApp()


@clientapp.train()
def train(msg: Message, context: Context) -> Message:
    import jax

    from fedbayes.config.schema import load_config
    from fedbayes.flower.codec import decode, encode
    from fedbayes.flower.node import client_update, node_setup
    from fedbayes.flower.nodedata import node_source

    config = load_config(str(context.run_config["config"]))
    client = int(context.node_config["partition-id"])
    spec = {k: (list(v) if isinstance(v, list) else v) for k, v in msg.content["config"].items() if k != "server-round"}
    setup = node_setup(config, client, str(context.node_config["state-dir"]), spec, node_source(context.node_config))
    theta = decode(msg.content["arrays"], setup.params)
    round_idx = int(msg.content["config"]["server-round"]) - 1
    delta, _, _ = client_update(setup, config.seed, round_idx, client, theta, setup.algorithm.client_init(setup.params))
    new = jax.tree.map(lambda t, g: t - g, theta, delta)  # FedAvg's message is theta - theta_k
    return Message(RecordDict({"arrays": encode(new), "metrics": MetricRecord({"num-examples": int(len(setup.y))})}), reply_to=msg)


@serverapp.main()
def main(grid: Grid, context: Context) -> None:
    from flwr.app import ConfigRecord
    from flwr.serverapp.strategy import FedAvg

    from fedbayes.config.schema import load_config
    from fedbayes.flower.codec import encode
    from fedbayes.flower.rounds import data_spec
    from fedbayes.runs.build import build_experiment

    config = load_config(str(context.run_config["config"]))
    exp = build_experiment(config)
    k = exp.federation.num_clients
    strategy = FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=k, min_evaluate_nodes=0, min_available_nodes=k)
    t0 = time.perf_counter()
    result = strategy.start(grid=grid, initial_arrays=encode(exp.params), num_rounds=config.rounds, train_config=ConfigRecord(data_spec(exp)))
    seconds = time.perf_counter() - t0
    with open(str(context.run_config["out"]), "w") as f:
        json.dump({"seconds": seconds, "rounds": config.rounds, "arrays": sorted(result.arrays.keys())}, f)
