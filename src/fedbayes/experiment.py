"""One experiment from a validated config: build data, model and algorithm, run, record, resume.

``run_experiment`` writes into its output folder:

* ``config.toml``: the resolved config (every default written out; ``fedbayes run`` accepts it);
* ``metrics.jsonl``: one line per evaluation (round, accuracy, nll, ece, loss, seconds,
  bytes_up, bytes_down, rejected), round 0 being the initial model;
* ``checkpoints/round_NNNNNN.npz``: atomic checkpoints every ``checkpoint_every`` rounds and at
  the end;
* ``summary.json`` and ``curves.png`` at the end.

A run killed at any point and resumed (``resume=True``) continues from its newest complete
checkpoint, drops the metric lines written after it, and ends with the same metrics as a run that
never stopped (same machine and seed): every random choice derives from (seed, round, client).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np
import optax

from fedbayes import algorithms as algs
from fedbayes import metrics
from fedbayes.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from fedbayes.config import ConfigError, RunConfig, to_toml
from fedbayes.data import load_dataset, natural, partition
from fedbayes.data.dataset import Dataset, DatasetNotFoundError
from fedbayes.evaluation import make_evaluator, make_marginal_evaluator
from fedbayes.inference.sgd import LocalTrainer
from fedbayes.inference.tilted import TiltedSettings, make_tilted_inference
from fedbayes.models import init_params, loss_fn, make_model
from fedbayes.plotting import plot_curves
from fedbayes.simulate import Federation, Simulator

THRESHOLDS = (0.5, 0.6, 0.7, 0.8, 0.85, 0.9)
FAULT_ENV = "FEDBAYES_FAULT_AFTER_ROUND"  # test hook: the process dies abruptly after this round


@dataclasses.dataclass
class Experiment:
    """Everything built from a config, ready to run."""

    config: RunConfig
    dataset: Dataset
    federation: Federation
    model: Any
    params: Any
    simulator: Simulator
    evaluate: Callable[[Any], dict[str, float]]  # server state -> metrics


def load_data(config: RunConfig) -> Dataset:
    """Loads the configured dataset (generated ones get their own parameters)."""
    d = config.data
    params: dict[str, Any] = {}
    if d.dataset == "synthetic_leaf":
        params = dict(num_clients=d.num_clients, alpha=d.synthetic_alpha, beta=d.synthetic_beta, dim=d.dim)
    elif d.dataset == "least_squares":
        params = dict(num_clients=d.num_clients, dim=d.dim)
    if d.fraction < 1.0:
        params["fraction"] = d.fraction
    try:
        return load_dataset(d.dataset, data_dir=d.data_dir, seed=config.seed, **params)
    except DatasetNotFoundError:
        raise
    except ValueError as exc:
        raise ConfigError(f"config error: data: {exc}") from None


def split_clients(config: RunConfig, dataset: Dataset) -> list[np.ndarray]:
    """Partitions the training set over clients with a generator seeded by ``config.seed``."""
    d = config.data
    rng = np.random.default_rng([config.seed, 2])
    params: dict[str, Any] = {}
    if d.partition == "dirichlet":
        params = {"alpha": d.alpha}
    elif d.partition == "two_level_dirichlet":
        params = {"alpha1": d.alpha1, "alpha2": d.alpha2}
    elif d.partition == "shards":
        params = {"classes_per_client": d.classes_per_client}
    elif d.partition == "natural":
        parts = natural(dataset.client_ids)
        if len(parts) != d.num_clients:
            raise ConfigError(
                f"config error: data.num_clients: the {dataset.name} data has {len(parts)} clients in its natural partition; got {d.num_clients}"
            )
        return parts
    try:
        return partition(d.partition, dataset.y_train, d.num_clients, rng, **params)
    except ValueError as exc:  # PartitionError included
        raise ConfigError(
            f"config error: data.partition ({d.partition}, data.num_clients = {d.num_clients}, {dataset.num_train} examples): {exc}"
        ) from None


def check_model(config: RunConfig, dataset: Dataset) -> None:
    """Rejects model/data pairs that cannot work, naming the field (before any training)."""
    if not np.issubdtype(dataset.x_train.dtype, np.floating):
        raise ConfigError(
            f"config error: data.dataset: {dataset.name!r} holds token ids (text, shape {dataset.feature_shape}); "
            "no fedbayes model takes text yet; allowed here: image or tabular data"
        )
    if config.model.name == "cnn" and len(dataset.feature_shape) not in (2, 3):
        raise ConfigError(
            f"config error: model.name: 'cnn' needs image data [H, W] or [H, W, C]; {dataset.name!r} has features of shape "
            f"{dataset.feature_shape}; allowed here: logreg, mlp"
        )


def prepare_data(config: RunConfig) -> tuple[Dataset, list[np.ndarray]]:
    """Loads and partitions the data and checks the model against it: every check that needs
    the data, cheap enough to run for all variants of a comparison before any of them trains."""
    dataset = load_data(config)
    check_model(config, dataset)
    return dataset, split_clients(config, dataset)


def client_optimizer(config: RunConfig) -> optax.GradientTransformation:
    c = config.client
    if c.optimizer == "sgd":
        opt = optax.sgd(c.lr, momentum=c.momentum or None)
    else:
        opt = optax.adam(c.lr)
    if c.weight_decay > 0:
        opt = optax.chain(optax.add_decayed_weights(c.weight_decay), opt)
    return opt


def build_algorithm(
    config: RunConfig, trainer: LocalTrainer, num_clients: int, *, total_examples: int = 0, apply_fn=None, task: str = "classification"
) -> algs.Algorithm:
    s = config.server
    server_opt = algs.make_server_optimizer(
        s.optimizer, s.lr, momentum=s.momentum, b1=s.beta1, b2=s.beta2, tau=s.tau, variant=s.variant
    )
    a = config.algorithm
    if a.name == "fedavg":
        return algs.fedavg(trainer, server_opt)
    if a.name == "fedprox":
        return algs.fedprox(trainer, server_opt, a.mu)
    if a.name == "feddyn":
        return algs.feddyn(trainer, server_opt, alpha=a.alpha, num_clients=num_clients, weight_decay=a.weight_decay)
    if a.name == "admm":
        return algs.admm(trainer, server_opt, rho=a.rho, num_clients=num_clients, delta=a.delta)
    if a.name == "fedpa":
        return algs.fedpa(trainer, server_opt, rho=a.rho, burn_in_rounds=a.burn_in_rounds, skip_epochs=a.skip_epochs)
    if a.name in ("fedep", "fedsep"):
        settings = TiltedSettings(
            scale=a.scale, weight_decay=a.weight_decay, initial_precision=a.initial_precision, mcmc_shrinkage=a.mcmc_shrinkage,
            clip_ratio=a.clip_ratio, laplace_epochs=a.laplace_epochs, ngvi_epochs=a.ngvi_epochs, ngvi_samples=a.ngvi_samples,
            ngvi_beta=a.ngvi_beta, fisher_max_batches=a.fisher_max_batches,
        )  # fmt: skip
        if a.init == "benchmark" and settings.alpha_cov <= 0:
            raise ConfigError(
                "config error: algorithm.weight_decay: the benchmark initialisation needs alpha_cov = scale * (initial_precision + weight_decay) > 0; "
                "set weight_decay or initial_precision > 0, or init = 'uniform'"
            )
        inference = make_tilted_inference(a.method, trainer, settings, apply_fn=apply_fn, task=task)
        common = dict(
            total_examples=total_examples, num_clients=num_clients, damping=a.damping or 1.0 / s.clients_per_round,
            alpha_cov=settings.alpha_cov, burn_in_rounds=a.burn_in_rounds, init=a.init, prior_precision=a.prior_precision,
            delta_clip=a.delta_clip,
        )  # fmt: skip
        if a.name == "fedep":
            return algs.fedep(trainer, server_opt, inference, allow_improper_sites=a.improper_sites == "allow", **common)
        return algs.fedsep(trainer, server_opt, inference, sep_power=a.sep_power, **common)
    raise ValueError(f"algorithm.name: unknown {a.name!r}")


def build_experiment(config: RunConfig, store_dir: str | Path | None = None) -> Experiment:
    """Builds everything; ``store_dir`` is the disk client store's folder when ``config.store_dir`` is unset."""
    dataset, parts = prepare_data(config)
    federation = Federation(dataset.x_train, dataset.y_train, tuple(parts))
    kwargs = {"hidden": tuple(config.model.hidden)} if config.model.name == "mlp" else {}
    model = make_model(config.model.name, dataset.num_classes, **kwargs)
    params = init_params(model, jax.random.fold_in(jax.random.key(config.seed), 3), dataset.feature_shape)
    trainer = LocalTrainer(loss_fn(model, dataset.task), client_optimizer(config), config.client.epochs, config.client.batch_size)
    apply_fn = lambda p, x: model.apply({"params": p}, x)  # noqa: E731
    algorithm = build_algorithm(
        config, trainer, federation.num_clients, total_examples=int(sum(federation.sizes)), apply_fn=apply_fn, task=dataset.task
    )
    simulator = Simulator(
        algorithm,
        federation,
        clients_per_round=config.server.clients_per_round,
        seed=config.seed,
        weighting=config.server.weighting,
        layout=config.layout,
        fail_fast=config.server.fail_fast,
        store=config.store,
        store_dir=config.store_dir or store_dir,
    )
    evaluate = make_evaluator(
        apply_fn, dataset.x_test, dataset.y_test, task=dataset.task, batch_size=config.eval_batch_size, num_bins=config.ece_bins
    )
    if algorithm.server_posterior is not None and dataset.task == "classification":
        evaluate = _with_marginal(evaluate, algorithm, config, apply_fn, dataset)
    else:
        evaluate = _on_state(evaluate, algorithm)
    return Experiment(config, dataset, federation, model, params, simulator, evaluate)


def _with_marginal(evaluate_point, algorithm: algs.Algorithm, config: RunConfig, apply_fn, dataset: Dataset):
    """Adds the marginalised prediction over ``S`` samples of ``q_g`` (``accuracy_marg``,
    ``nll_marg``, ``ece_marg``; seed 000 Table 5) to the point metrics. The samples' key depends on
    the seed and the round only, so a resumed run draws the same ones."""
    marginal = make_marginal_evaluator(
        apply_fn, dataset.x_test, dataset.y_test, num_samples=config.algorithm.marginal_samples,
        batch_size=config.eval_batch_size, num_bins=config.ece_bins,
    )  # fmt: skip
    root = jax.random.fold_in(jax.random.key(config.seed), 5)

    def evaluate(server_state) -> dict[str, float]:
        out = evaluate_point(algorithm.server_params(server_state))
        mean, variance = algorithm.server_posterior(server_state)
        key = jax.random.fold_in(root, int(server_state.round))
        out.update({f"{k}_marg": v for k, v in marginal(key, mean, variance).items() if k in ("accuracy", "nll", "ece")})
        return out

    return evaluate


def _on_state(evaluate_point, algorithm: algs.Algorithm):
    """The point evaluation of the server state's model."""
    return lambda server_state: evaluate_point(algorithm.server_params(server_state))


def read_metrics(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                break  # a line torn by a kill: everything after it is dropped too
    return out


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def summarize(config: RunConfig, records: list[dict], task: str) -> dict:
    """Final metrics and curve summaries (spec 13.2) of one run."""
    last = records[-1] if records else {}
    summary: dict[str, Any] = {
        "name": config.name,
        "algorithm": config.algorithm.name,
        "server_optimizer": config.server.optimizer,
        "rounds": config.rounds,
        "final": {k: v for k, v in last.items() if k != "round"},
    }
    if task == "classification" and records:
        rounds = [r["round"] for r in records]
        acc = [r["accuracy"] for r in records]
        summary["best_accuracy"] = float(max(acc))
        # seed 001 Table 3: the first round whose accuracy reaches the threshold (no smoothing);
        # seeds 000/003: the first round whose 10-evaluation running mean reaches it.
        summary["rounds_to"] = {f"{t:.2f}": metrics.rounds_to_threshold(rounds, acc, t, window=1) for t in THRESHOLDS}
        summary["rounds_to_rm10"] = {f"{t:.2f}": metrics.rounds_to_threshold(rounds, acc, t, window=10) for t in THRESHOLDS}
        summary["final_mean_3"] = metrics.final_mean(acc, 3)
        for w in (10, 100):
            m = metrics.running_mean(acc, w)
            summary[f"running_mean_{w}"] = None if np.isnan(m[-1]) else float(m[-1])
    return summary


class PlainReporter:
    """Progress as plain lines (when output is not a terminal)."""

    def __init__(self, echo: Callable[[str], None] = print):
        self.echo = echo

    def start(self, name: str, total: int, done: int) -> None:
        self.echo(f"[{name}] rounds {done}/{total}")

    def update(self, round_idx: int, total: int, record: dict | None) -> None:
        if record is not None:
            self.echo(format_record(record, total))

    def stop(self) -> None:
        pass


def format_record(r: dict, total: int) -> str:
    if "accuracy" in r:
        body = f"acc {r['accuracy']:.4f}  nll {r['nll']:.4f}  ece {100 * r['ece']:.2f}%"
    else:
        body = f"mse {r['mse']:.5f}"
    rej = f"  rejected {r['rejected']}" if r.get("rejected") else ""
    return f"round {r['round']:>4}/{total}  {body}  {r['seconds']:.1f}s{rej}"


class Diverged(RuntimeError):
    """A run stopped because a loss or the server model turned non-finite (``server.on_divergence``).

    Attributes: ``round``, ``metric`` (what turned non-finite), ``checkpoint`` (the round of the
    last good checkpoint, or None).
    """

    def __init__(self, message: str, round_idx: int, metric: str, checkpoint: int | None):
        super().__init__(message)
        self.round, self.metric, self.checkpoint = round_idx, metric, checkpoint


DIVERGENCE_METRICS = ("loss", "nll", "mse", "nll_marg")  # evaluated losses a guard checks


def _non_finite(record: dict | None, params) -> str | None:
    """The first non-finite quantity: the server model's parameters, then the evaluated losses;
    None when all are finite."""
    if params is not None:
        finite = jax.tree.reduce(lambda a, b: a & b, jax.tree.map(lambda v: jax.numpy.all(jax.numpy.isfinite(v)), params), True)
        if not bool(finite):
            return "server parameters"
    for key in DIVERGENCE_METRICS:
        if record is not None and key in record and not np.isfinite(record[key]):
            return f"evaluated {key}"
    return None


def _divergence_message(config: RunConfig, round_idx: int, metric: str, out: Path, checkpoint: int | None) -> str:
    cause = (
        "likely cause: a step too large for the loss's curvature (client.lr, server.lr"
        + (", or the tilted precisions of FedEP's laplace/ngvi methods" if config.algorithm.name in ("fedep", "fedsep") else "")
        + ")"
    )
    ckpt = f"last good checkpoint: round {checkpoint}" if checkpoint is not None else "no checkpoint was saved yet (checkpoint_every)"
    return (
        f"diverged at round {round_idx}: {metric} non-finite; {cause}; {ckpt}; "
        f"continue with: fedbayes resume {out} --set client.lr=... (or server.lr=...)"
    )


def run_experiment(config: RunConfig, out_dir: str | Path, *, resume: bool = False, reporter=None) -> dict:
    """Runs (or resumes) one experiment and returns its summary (see the module docstring)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ckpt_dir = out / "checkpoints"
    metrics_path = out / "metrics.jsonl"
    reporter = reporter or PlainReporter()
    exp = build_experiment(config, store_dir=out / "client_store")
    sim = exp.simulator
    ckpt = latest_checkpoint(ckpt_dir) if resume else None
    if ckpt is None:
        shutil.rmtree(ckpt_dir, ignore_errors=True)  # before a new disk client store replaces the old one
    state = sim.init(exp.params, resume=ckpt is not None)  # resume: open the disk store, not rewrite it
    counters = {"seconds": 0.0, "bytes_up": 0, "bytes_down": 0, "rejected": 0}
    records: list[dict] = []
    if ckpt is not None:
        state, meta = load_checkpoint(ckpt, state)
        state = state._replace(server_state=sim.place(state.server_state))
        counters = meta["counters"]
        records = [r for r in read_metrics(metrics_path) if r["round"] <= state.round]
    else:
        for stale in ("summary.json", "curves.png"):  # a killed fresh run must not look finished
            (out / stale).unlink(missing_ok=True)
    _write_atomic(out / "config.toml", to_toml(config))
    _write_atomic(metrics_path, "".join(json.dumps(r) + "\n" for r in records))

    def record(round_idx: int) -> dict:
        m = exp.evaluate(state.server_state)
        r = {"round": round_idx, **m, **counters}
        r["seconds"] = round(r["seconds"], 3)
        records.append(r)
        with open(metrics_path, "a") as f:
            f.write(json.dumps(r) + "\n")
        return r

    fault = int(os.environ.get(FAULT_ENV, "-1"))
    last_ckpt = int(state.round) if ckpt is not None else None
    warned = False
    reporter.start(config.name, config.rounds, state.round)
    if state.round == 0 and not records:
        reporter.update(0, config.rounds, record(0))
    try:
        while state.round < config.rounds:
            t0 = time.perf_counter()
            state, info = sim.run_round(state, donate=True)  # the old state is dropped: no store copy
            jax.block_until_ready(state.server_state)
            counters["seconds"] += time.perf_counter() - t0
            counters["bytes_up"] += info.bytes_up
            counters["bytes_down"] += info.bytes_down
            counters["rejected"] += len(info.rejected)
            r = state.round
            rec = record(r) if (r % config.eval_every == 0 or r == config.rounds) else None
            bad = _non_finite(rec, sim.server_params(state))
            if bad is not None and not warned:
                message = _divergence_message(config, r, bad, out, last_ckpt)
                if config.server.on_divergence == "stop":
                    summary = {**summarize(config, records, exp.dataset.task), "diverged": {"round": r, "metric": bad, "checkpoint": last_ckpt}}
                    _write_atomic(out / "summary.json", json.dumps(summary, indent=2) + "\n")
                    raise Diverged(message, r, bad, last_ckpt)
                print(f"warning: {message}", file=sys.stderr, flush=True)
                warned = True
            if not warned and (r == config.rounds or (config.checkpoint_every and r % config.checkpoint_every == 0)):
                save_checkpoint(ckpt_dir, state, {"counters": counters, "name": config.name})
                last_ckpt = r
            reporter.update(r, config.rounds, rec)
            if r == fault:
                os._exit(137)
    finally:
        reporter.stop()
    task = exp.dataset.task
    summary = summarize(config, records, task)
    _write_atomic(out / "summary.json", json.dumps(summary, indent=2) + "\n")
    plot_curves(out / "curves.png", {config.name: records}, title=config.name, task=task)
    return summary
