"""Ozer et al. 2022 (VBNN aggregation)'s CNN: the simulator's round against a plain jitted step loop over the same examples.

    PYTHONPATH=src .venv/bin/python benchmarks/cnn_round.py [--clients 10] [--per-client 640]
        [--epochs 1] [--batch 64] [--reps 7] [--layout sequential] [--conv patches xla] [--vbnn] [--json]

One process, one XLA host device per core (``fedbayes.sim.hostdevices``). For each convolution
implementation (``--conv``: ``patches``, the default model's patch extraction plus dot, and
``xla``, ``nn.Conv``) it builds

* ``plain``: one ``jax.jit`` SGD step (lr 0.01, momentum 0.9, batch 64, the masked mean
  cross-entropy), called from Python over every client's minibatches in turn: the same examples,
  the same number of steps as the round (each client's last batch partial and masked), XLA's
  default options, on the default device with all its threads;
* ``round``: ``Simulator.run_round`` of FedAvg (server SGD lr 1) over the same clients, all of
  them in the cohort (``--layout``: ``sequential`` is the CPU default; ``vmap`` also works).

With ``--vbnn`` it also builds ``round_vbnn``: the VBNN round (Ozer et al. 2022 (VBNN aggregation)'s CNN with its dense layers
variational, GAA, the same clients and optimizer) on the default convolution, reported as a ratio
to the CNN FedAvg round of that convolution (``round_vbnn / round_<conv>`` in throughput).

Each repetition times every variant once, in an interleaved order (plain, round, per conv), after
one untimed compile-and-warm-up call of each (``fedbayes.bench.relative.interleaved_times``; ``fedbayes bench --workload cnn --workload vbnn`` measures the default convolution the same way). The reported ratio is, per repetition, plain time
over round time (the round's throughput as a share of the plain loop's), median and range over
repetitions; examples/s are medians. Fashion-MNIST when installed, else random images of the
same shape (the timing does not depend on the values).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from fedbayes.sim import hostdevices  # noqa: E402  (no JAX import)

hostdevices.configure()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from fedbayes.algorithms.fedavg import fedavg  # noqa: E402
from fedbayes.algorithms.server_opt import make_server_optimizer  # noqa: E402
from fedbayes.algorithms.vbnn import vbnn  # noqa: E402
from fedbayes.bench.relative import interleaved_times, plain_loop  # noqa: E402
from fedbayes.data.federation import Federation  # noqa: E402
from fedbayes.inference import LocalTrainer  # noqa: E402
from fedbayes.models import init_params, loss_fn, make_model  # noqa: E402
from fedbayes.models.variational import apply_with_key  # noqa: E402
from fedbayes.sim.simulator import Simulator  # noqa: E402


def _images(num: int, seed: int) -> tuple[np.ndarray, np.ndarray, str]:
    try:
        from fedbayes.data import load_dataset

        data = load_dataset("fashion_mnist")
        x = np.asarray(data.x_train[:num], np.float32).reshape(num, 28, 28, 1)
        return x, np.asarray(data.y_train[:num], np.int32), "fashion_mnist"
    except Exception:  # not installed: random images of the same shape
        rng = np.random.default_rng(seed)
        return rng.normal(size=(num, 28, 28, 1)).astype(np.float32), rng.integers(0, 10, num).astype(np.int32), "random"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--per-client", type=int, default=640)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--layout", default="sequential", choices=("sequential", "vmap"))
    ap.add_argument("--conv", nargs="+", default=["patches", "xla"], choices=("patches", "xla"))
    ap.add_argument("--vbnn", action="store_true", help="also time the VBNN (GAA) round")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    num = args.clients * args.per_client
    x, y, source = _images(num, args.seed)
    parts = tuple(np.arange(k * args.per_client, (k + 1) * args.per_client) for k in range(args.clients))
    optimizer = optax.sgd(0.01, momentum=0.9)
    trainer_args = dict(optimizer=optimizer, num_epochs=args.epochs, batch_size=args.batch)

    variants = {}
    for conv in args.conv:
        model = make_model("cnn", 10, conv=conv)
        params = init_params(model, jax.random.key(args.seed), (28, 28, 1))
        plain, examples = plain_loop(loss_fn(model, "classification"), x, y, parts, args.batch, args.epochs, optimizer)
        trainer = LocalTrainer(loss_fn(model, "classification"), **trainer_args)
        sim = Simulator(
            fedavg(trainer, make_server_optimizer("sgd", 1.0)),
            Federation(x, y, parts),
            clients_per_round=args.clients,
            seed=args.seed,
            layout=args.layout,
        )
        state = sim.init(params)

        def round_fn(_params, sim=sim, box=[state]):  # noqa: B006  (the carried state)
            box[0], _ = sim.run_round(box[0])
            return box[0].server_state

        variants[f"plain_{conv}"] = (plain, params)
        variants[f"round_{conv}"] = (round_fn, params)
    if args.vbnn:
        vmodel = make_model("cnn", 10, variational=True, conv=args.conv[0])
        vparams = init_params(vmodel, jax.random.key(args.seed), (28, 28, 1))
        vsim = Simulator(
            vbnn(LocalTrainer(None, **trainer_args), apply_with_key(vmodel), aggregation="gaa"),
            Federation(x, y, parts),
            clients_per_round=args.clients,
            seed=args.seed,
            layout=args.layout,
        )

        def vbnn_round(_params, sim=vsim, box=[vsim.init(vparams)]):  # noqa: B006
            box[0], _ = sim.run_round(box[0])
            return box[0].server_state

        variants["round_vbnn"] = (vbnn_round, vparams)

    times = interleaved_times({name: (lambda fn=fn, p=params: fn(p)) for name, (fn, params) in variants.items()}, args.reps)

    out = {
        "devices": len(jax.local_devices()),
        "data": source,
        "examples_per_round": examples,
        "setting": vars(args),
        "examples_per_s": {k: examples / statistics.median(v) for k, v in times.items()},
        "ratio_round_to_plain": {},
    }
    for conv in args.conv:
        r = [p / q for p, q in zip(times[f"plain_{conv}"], times[f"round_{conv}"])]
        out["ratio_round_to_plain"][conv] = {"median": statistics.median(r), "min": min(r), "max": max(r)}
    if args.vbnn:
        r = [p / q for p, q in zip(times[f"round_{args.conv[0]}"], times["round_vbnn"])]
        out["ratio_vbnn_to_fedavg_round"] = {"median": statistics.median(r), "min": min(r), "max": max(r)}
    if len(args.conv) == 2:
        r = [p / q for p, q in zip(times["plain_xla"], times["round_patches"])]
        out["ratio_round_patches_to_plain_xla"] = {"median": statistics.median(r), "min": min(r), "max": max(r)}
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        print(f"{out['devices']} devices, {source}, {examples} examples per round, layout {args.layout}, {args.reps} reps")
        for k, v in out["examples_per_s"].items():
            print(f"  {k:16s} {v:9.0f} examples/s (median)")
        for k, v in out["ratio_round_to_plain"].items():
            print(f"  round/plain [{k}]: median {v['median']:.2f}, range {v['min']:.2f}-{v['max']:.2f}")
        if "ratio_vbnn_to_fedavg_round" in out:
            v = out["ratio_vbnn_to_fedavg_round"]
            print(f"  round[vbnn gaa]/round[fedavg] ({args.conv[0]}): median {v['median']:.2f}, range {v['min']:.2f}-{v['max']:.2f}")
        if "ratio_round_patches_to_plain_xla" in out:
            v = out["ratio_round_patches_to_plain_xla"]
            print(f"  round[patches]/plain[xla]: median {v['median']:.2f}, range {v['min']:.2f}-{v['max']:.2f}")
    return out


if __name__ == "__main__":
    main()
