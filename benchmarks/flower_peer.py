"""fedbayes against Flower's simulation on the same FedAvg workload, measured in one invocation.

    .venv/bin/python benchmarks/flower_peer.py [--flower-python PYTHON] [--rounds N] [--num-cpus C] [--json]

The workload is ``fedbayes bench``'s ``fedavg``: Fashion-MNIST IID over 10 clients, all 10 per
round, the MLP (200, 100), batch 32, one local epoch of SGD (lr 0.05), FedAvg with server
``sgd(1.0)`` (the plain weighted mean). Both sides run the same JAX client code
(``fedbayes.inference.sgd.run_sgd`` on the client's own shuffles, ``jit``-compiled once per
process):

* **fedbayes**: ``fedbayes.bench.run_federated_process`` (the simulator, one XLA host device per
  core), exactly as ``fedbayes bench --workload fedavg``;
* **Flower**: ``flwr.simulation.run_simulation`` with a ``ClientApp`` whose ``NumPyClient.fit``
  runs that client update on its partition, and the ``FedAvg`` strategy (``fraction_fit=1``, no
  evaluation). Round times are taken in the strategy (``configure_fit`` to ``aggregate_fit``);
  ``--num-cpus`` is Flower's ``client_resources`` (1: one Ray actor per core, Flower's default).

Flower is not a dependency of fedbayes: install it in an environment of its own, with JAX and
fedbayes' other imports, e.g.

    python -m venv /tmp/flwr && /tmp/flwr/bin/pip install "flwr[simulation]==1.41.*" \\
        jax==0.10.2 flax==0.12.8 optax==0.2.8 scikit-learn matplotlib tomli-w filelock

and pass ``--flower-python /tmp/flwr/bin/python`` (fedbayes' sources are put on its
``PYTHONPATH``). Without an interpreter that can import ``flwr`` the script says so and exits
with status 0, measuring nothing.

Reported per side: ``examples_per_s`` (60,000 examples / median steady round time; the rounds
after the first), ``round_s``, ``first_round_s``, ``startup_s`` (process start to the end of the
first round) and ``wall_s`` (the whole run); and ``fedbayes / flower`` throughput.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"
RESULT = "FLOWER_PEER_RESULT "


# ----- the Flower side (runs in the Flower environment) ------------------------------------------
def flower_worker(spec: dict) -> dict:
    t_enter = time.time()
    import jax
    import numpy as np
    from flwr.client import ClientApp
    from flwr.common import Context, ndarrays_to_parameters
    from flwr.server import ServerApp, ServerAppComponents, ServerConfig
    from flwr.server.strategy import FedAvg
    from flwr.simulation import run_simulation

    from fedbayes import bench as fb

    settings = fb.settings_from_dict(spec["settings"])
    num_clients = spec["clients"]
    dataset = fb.load_data(settings)
    params, _, _ = fb.model_and_trainer(settings, dataset, settings.batch_size)
    leaves, treedef = jax.tree.flatten(params)
    initial = [np.asarray(a) for a in leaves]
    marks: list[tuple[str, int, float]] = []

    class TimedFedAvg(FedAvg):
        def configure_fit(self, server_round, parameters, client_manager):
            marks.append(("start", server_round, time.perf_counter()))
            return super().configure_fit(server_round, parameters, client_manager)

        def aggregate_fit(self, server_round, results, failures):
            out = super().aggregate_fit(server_round, results, failures)
            marks.append(("end", server_round, time.perf_counter()))
            if failures:
                raise RuntimeError(f"round {server_round}: {len(failures)} Flower clients failed: {failures[:1]}")
            return out

    def server_fn(context: Context) -> ServerAppComponents:
        strategy = TimedFedAvg(
            fraction_fit=1.0, fraction_evaluate=0.0, min_fit_clients=num_clients, min_available_clients=num_clients,
            initial_parameters=ndarrays_to_parameters(initial), on_fit_config_fn=lambda r: {"server_round": r},
        )  # fmt: skip
        return ServerAppComponents(strategy=strategy, config=ServerConfig(num_rounds=spec["rounds"]))

    # By reference (module flower_peer, importable in Ray's actors through PYTHONPATH), so that each
    # actor keeps its data and compiled update across tasks; __main__'s would be pickled by value.
    import flower_peer

    client_app = ClientApp(client_fn=flower_peer.ClientFn(spec))
    t_start = time.time()
    run_simulation(
        server_app=ServerApp(server_fn=server_fn),
        client_app=client_app,
        num_supernodes=num_clients,
        backend_config={"client_resources": {"num_cpus": spec["num_cpus"], "num_gpus": 0.0}},
    )
    t_done = time.time()
    starts = {r: t for kind, r, t in marks if kind == "start"}
    rounds = [t - starts[r] for kind, r, t in marks if kind == "end"]
    if len(rounds) != spec["rounds"]:
        raise RuntimeError(f"Flower ran {len(rounds)} of {spec['rounds']} rounds")
    first_end = next(t for kind, r, t in marks if kind == "end" and r == 1)
    steady = rounds[1:] or rounds
    examples = int(dataset.num_train) * settings.epochs
    return {
        "examples_per_s": examples / statistics.median(steady),
        "round_s": statistics.median(steady),
        "round_range_s": [min(steady), max(steady)],
        "first_round_s": rounds[0],
        "startup_s": first_end + _PERF_OFFSET - spec["spawn_time"],
        "wall_s": t_done - spec["spawn_time"],
        "imports_and_data_s": t_start - t_enter,
        "rounds": len(steady),
        "num_cpus": spec["num_cpus"],
        "flwr": _version("flwr"),
        "ray": _version("ray"),
    }


_PERF_OFFSET = time.time() - time.perf_counter()  # wall clock = perf_counter + this (same process)


def _version(name: str) -> str:
    from importlib.metadata import version

    try:
        return version(name)
    except Exception:
        return "?"


_CACHE: dict = {}  # per process (Ray actor): data, partition, compiled update


class ClientFn:
    """The ClientApp's ``client_fn``: fedbayes' FedAvg client update on partition ``partition-id``."""

    def __init__(self, spec: dict):
        self.spec = spec

    def __call__(self, context):
        from flwr.client import NumPyClient

        cid, spec = int(context.node_config["partition-id"]), self.spec

        class Client(NumPyClient):
            def fit(self, parameters, config):
                import jax
                import numpy as np

                update, treedef, n = _setup(cid, spec)
                params = jax.tree.unflatten(treedef, [np.asarray(p) for p in parameters])
                new = update(params, int(config["server_round"]) - 1)  # Flower counts rounds from 1
                return [np.asarray(a) for a in jax.tree.leaves(new)], n, {}

        return Client().to_client()


def _setup(cid: int, spec: dict):
    """``(update, treedef, n_k)`` of client ``cid``, built once per process."""
    import jax
    import numpy as np

    from fedbayes import bench as fb
    from fedbayes.data import partition
    from fedbayes.data.batches import ClientData, layout_orders
    from fedbayes.inference.sgd import run_sgd

    if "base" not in _CACHE:
        settings = fb.settings_from_dict(spec["settings"])
        dataset = fb.load_data(settings)
        parts = partition("iid", dataset.y_train, spec["clients"], np.random.default_rng([settings.seed, 2]))
        params, trainer, _ = fb.model_and_trainer(settings, dataset, settings.batch_size)
        step = jax.jit(lambda p, x, y, order, n: run_sgd(jax.random.key(0), p, ClientData(x, y, order, np.int32(0), n), trainer)[0])
        _CACHE["base"] = (settings, dataset, parts, trainer, step, jax.tree.structure(params))
    settings, dataset, parts, trainer, step, treedef = _CACHE["base"]
    if cid not in _CACHE:
        idx = np.asarray(parts[cid])
        _CACHE[cid] = (jax.device_put(dataset.x_train[idx]), jax.device_put(dataset.y_train[idx]), len(idx))
    x, y, n = _CACHE[cid]

    def update(params, server_round):
        # The simulator's shuffles of this client and round (positions into its own data).
        order, _, _ = layout_orders(settings.seed, server_round, [cid], [np.arange(n)], trainer.num_epochs, trainer.batch_size)
        return step(params, x, y, order, np.int32(n))

    return update, treedef, n


# ----- the parent (runs with fedbayes) -----------------------------------------------------------
def _flower_python(arg: str | None) -> str | None:
    candidates = [arg, os.environ.get("FLWR_PYTHON"), sys.executable, "/tmp/flwr/bin/python"]
    for python in candidates:
        if not python or not os.path.exists(python):
            continue
        ok = subprocess.run([python, "-c", "import flwr, jax"], capture_output=True).returncode == 0
        if ok:
            return python
        if python == arg:
            return None
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--flower-python", default=None, help="interpreter with flwr[simulation] and jax (default: $FLWR_PYTHON, this one, /tmp/flwr/bin/python)")
    ap.add_argument("--rounds", type=int, default=6, help="rounds per side (the first is reported apart)")
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--num-cpus", type=float, default=1.0, help="Flower client_resources num_cpus")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--flower-worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.flower_worker:
        print(RESULT + json.dumps(flower_worker(json.loads(args.flower_worker))), flush=True)
        return 0

    python = _flower_python(args.flower_python)
    if python is None:
        print(
            "flower_peer: Flower is not importable (with JAX) from any interpreter tried "
            f"({args.flower_python or '$FLWR_PYTHON, ' + sys.executable + ', /tmp/flwr/bin/python'}); nothing measured. "
            "Install it apart from fedbayes, e.g. python -m venv /tmp/flwr && /tmp/flwr/bin/pip install 'flwr[simulation]==1.41.*' "
            "jax==0.10.2 flax==0.12.8 optax==0.2.8 scikit-learn matplotlib tomli-w filelock; then pass --flower-python /tmp/flwr/bin/python."
        )
        return 0

    from fedbayes import bench as fb

    settings = fb.BenchSettings(rounds=max(1, args.rounds - 1), repeats=1)
    fb.check_dataset(settings)
    workload = fb.WORKLOADS["fedavg"]
    if args.clients != workload.num_clients:
        raise SystemExit("flower_peer: --clients must match the fedavg workload (10)")
    t0 = time.time()
    ours = fb.federated_entry(fb.run_federated_process(workload, settings))
    ours["wall_s"] = time.time() - t0

    spec = {"settings": fb.settings_to_dict(settings), "clients": args.clients, "rounds": args.rounds, "num_cpus": args.num_cpus, "spawn_time": time.time()}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(SRC), str(HERE), os.environ.get("PYTHONPATH")])))
    env.pop("XLA_FLAGS", None)  # Flower's actors run JAX as it comes
    res = subprocess.run([python, __file__, "--flower-worker", json.dumps(spec)], capture_output=True, text=True, env=env)
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith(RESULT)), None)
    if res.returncode != 0 or line is None:
        print(res.stdout[-2000:], res.stderr[-4000:], file=sys.stderr)
        raise SystemExit(f"flower_peer: the Flower run failed (exit code {res.returncode})")
    theirs = json.loads(line[len(RESULT) :])
    keys = ("examples_per_s", "round_s", "first_round_s", "startup_s", "wall_s")
    out = {"fedbayes": {k: ours[k] for k in keys}, "flower": theirs, "fedbayes_over_flower": ours["examples_per_s"] / theirs["examples_per_s"]}
    if args.json:
        print(json.dumps(out))
    else:
        for side in ("fedbayes", "flower"):
            e = out[side]
            print(
                f"{side:>9}: {e['examples_per_s']:>9,.0f} examples/s  round {e['round_s']:.3f} s  first round {e['first_round_s']:.2f} s  start-up {e['startup_s']:.1f} s  wall {e['wall_s']:.1f} s"
            )
        print(f"fedbayes / Flower throughput: {out['fedbayes_over_flower']:.2f}  (Flower {theirs['flwr']}, Ray {theirs['ray']}, num_cpus {args.num_cpus:g})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
