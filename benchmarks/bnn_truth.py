"""A small Bayesian neural network against HMC: the federated posteriors compared in function space.

The problem of ``fedbayes bench posterior`` (breast cancer, the library's split, 10 Dirichlet(0.5)
clients, seed 0, prior ``N(0, I)`` on every parameter), with a one-hidden-layer MLP (8 tanh units,
266 parameters) in place of logistic regression. Its posterior is multimodal (the hidden units can
be permuted and their signs flipped), so moments in weight space mean little; as Izmailov et al.
2021 ("What Are Bayesian Neural Network Posteriors Really Like?", ICML 2021, Sec. 5) the methods
are compared in **function space**, with the HMC predictive on the test set,

    p_HMC(y | x) = 1/S sum_s softmax(f(x; theta_s))   (all draws of all chains),

as the reference:

* agreement: the fraction of test points where ``argmax_c p_method(c | x) = argmax_c p_HMC(c | x)``;
* total variation: the mean over test points of ``1/2 sum_c |p_method(c | x) - p_HMC(c | x)|``;

plus each predictive's accuracy, NLL and ECE (:func:`fedbayes.evaluation.metrics.classification_metrics`).

Ground truth: NumPyro's NUTS (Hoffman and Gelman 2014) on ``exp(-L(theta))``, ``L`` from
:func:`fedbayes.evaluation.reference.negative_log_joint`, float64, a diagonal mass matrix adapted in
warm-up, every chain started at its own MAP (Adam from its own random start). The whitening of
:mod:`fedbayes.bench.truth` (a Laplace Hessian at one MAP) does not apply to a multimodal
posterior. Reported: the split R-hat and ESS over the weights (large: the chains sit in different
modes), the same over the test points' predictive probabilities (the function-space R-hat), and
each chain's own predictive's agreement and TV with the pooled one. Cached as ``hmc.npz`` and
``hmc.json`` (keyed by a fingerprint of the data, the model and the settings).

Rows: each method built from a config through :func:`fedbayes.runs.build.build_experiment`, as
``fedbayes run`` builds it, at its defaults (only ``name`` and ``covariance`` set, the prior matched
by :data:`fedbayes.bench.posterior.PRIOR_MATCH`, ``--samples`` draws in the marginalised
prediction), every client in every round, for ``--rounds`` rounds (``--rounds-of KEY=R``: another
number for one method); two predictives (:func:`predictives`): the one whose metrics a run reports,
with the run's resolved ``[evaluation]`` settings, and the posterior ``q_g`` itself, all weights
drawn, the network at each draw. Central references: the MAP (Newton from the runs' initial
parameters) and the full Laplace at it, sampled and linearised. Rows are cached in ``<out>/rows/``
(each method's predictive probabilities), so the table is rebuilt from them at no cost.

Run (from the repository root)::

    PYTHONPATH=src python benchmarks/bnn_truth.py --out runs/bnn_truth --rounds 100 --rounds-of fedep_nuts_full=20

Results: docs/results/posterior_quality.md, "A small Bayesian neural network against HMC".
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from fedbayes.bench import truth
from fedbayes.bench.posterior import PRIOR_MATCH
from fedbayes.config.schema import validate
from fedbayes.evaluation.metrics import classification_metrics
from fedbayes.evaluation.reference import laplace_covariance, negative_log_joint
from fedbayes.runs.build import DataSpec, build_experiment, build_model, prepare_split
from fedbayes.runs.folder import write_atomic

PRIOR_PRECISION = 1.0
MODEL = {"name": "mlp", "hidden": [8], "activation": "tanh"}
DATA = {"dataset": "breast_cancer", "num_clients": 10, "partition": "dirichlet", "alpha": 0.5}

# key -> (label, [algorithm] section); the VBNN runs the variational version of the same MLP
METHODS: dict[str, tuple[str, dict]] = {
    "fedep_laplace": ("FedEP (laplace)", {"name": "fedep", "method": "laplace"}),
    "fedep_laplace_full": ("FedEP (laplace, covariance full)", {"name": "fedep", "method": "laplace", "covariance": "full"}),
    "fedep_laplace_last_layer": ("FedEP (laplace, covariance last_layer)", {"name": "fedep", "method": "laplace", "covariance": "last_layer"}),
    "fedep_laplace_kron": ("FedEP (laplace, covariance kron)", {"name": "fedep", "method": "laplace", "covariance": "kron"}),
    "fedep_laplace_low_rank": ("FedEP (laplace, covariance low_rank)", {"name": "fedep", "method": "laplace", "covariance": "low_rank"}),
    "fedep_nuts_full": ("FedEP (nuts, covariance full)", {"name": "fedep", "method": "nuts", "covariance": "full"}),
    "pvi": ("PVI", {"name": "pvi"}),
    "pvi_full": ("PVI (covariance full)", {"name": "pvi", "covariance": "full"}),
    "pvi_std003": ("PVI (network_std 0.03, the start before 2026-11-30)", {"name": "pvi", "network_std": 0.03}),
    "fedlap_cov": ("FedLap-Cov", {"name": "fedlap_cov"}),
    "fedlap_cov_full": ("FedLap-Cov (covariance full)", {"name": "fedlap_cov", "covariance": "full"}),
    "fedlap_cov_last_layer": ("FedLap-Cov (covariance last_layer)", {"name": "fedlap_cov", "covariance": "last_layer"}),
    "fedlap_cov_low_rank": ("FedLap-Cov (covariance low_rank)", {"name": "fedlap_cov", "covariance": "low_rank"}),
    "fedlap_cov_kron": ("FedLap-Cov (covariance kron)", {"name": "fedlap_cov", "covariance": "kron"}),
    "vbnn": ("VBNN (mean-field)", {"name": "vbnn"}),
    "fedavg": ("FedAvg (point)", {"name": "fedavg"}),
}


# ----- function-space distances -------------------------------------------------------------------


def agreement(p: np.ndarray, q: np.ndarray) -> float:
    """The fraction of rows (test points) where ``argmax p = argmax q``; ``p, q``: ``[n, C]``."""
    p, q = np.asarray(p), np.asarray(q)
    if p.shape != q.shape or p.ndim != 2:
        raise ValueError(f"agreement needs two [n, C] arrays of one shape; got {p.shape} and {q.shape}")
    return float(np.mean(np.argmax(p, axis=1) == np.argmax(q, axis=1)))


def total_variation(p: np.ndarray, q: np.ndarray) -> float:
    """The mean over rows of ``1/2 sum_c |p_c - q_c|``; ``p, q``: ``[n, C]`` probabilities."""
    p, q = np.asarray(p, np.float64), np.asarray(q, np.float64)
    if p.shape != q.shape or p.ndim != 2:
        raise ValueError(f"total_variation needs two [n, C] arrays of one shape; got {p.shape} and {q.shape}")
    return float(np.mean(0.5 * np.sum(np.abs(p - q), axis=1)))


def predictive_metrics(probs: np.ndarray, y: np.ndarray) -> dict[str, float]:
    """Accuracy, NLL and ECE of the predictive probabilities ``[n, C]`` on labels ``y``."""
    log_p = jnp.log(jnp.clip(jnp.asarray(probs, jnp.float32), 1e-12, 1.0))
    m = classification_metrics(log_p, jnp.asarray(np.asarray(y, np.int32)))
    return {k: float(m[k]) for k in ("accuracy", "nll", "ece")}


def compare(probs: np.ndarray, reference: np.ndarray, y: np.ndarray) -> dict[str, float]:
    """A predictive's agreement and TV with the reference's, and its own metrics."""
    return {"agreement": agreement(probs, reference), "tv": total_variation(probs, reference), **predictive_metrics(probs, y)}


# ----- HMC ground truth ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class HMCSettings:
    """NUTS: chains, warm-up and kept draws per chain, target acceptance, maximum tree depth, seed;
    the random start's scale and the Adam steps that take each chain to its own MAP."""

    chains: int = 4
    warmup: int = 500
    draws: int = 1000
    target_accept: float = 0.8
    max_tree_depth: int = 10
    init_scale: float = 0.5
    map_steps: int = 2000
    seed: int = 0


def fingerprint(x, y, x_test, params0, prior_precision: float, settings: HMCSettings, model: dict) -> str:
    """A hash of the data, the parameter shapes, the prior, the model section and the settings
    (:func:`fedbayes.bench.truth.fingerprint`)."""
    return truth.fingerprint((x, y, x_test), prior_precision, settings, params0, model)


def _local_maps(loss, flat0: jax.Array, starts: jax.Array, steps: int) -> jax.Array:
    """Each start taken ``steps`` Adam steps (learning rate 0.01) down ``loss``: one MAP per chain."""
    import optax

    opt = optax.adam(0.01)

    def descend(z):
        def body(carry, _):
            z, s = carry
            g = jax.grad(loss)(z)
            u, s = opt.update(g, s, z)
            return (optax.apply_updates(z, u), s), None

        (z, _), _ = jax.lax.scan(body, (z, opt.init(z)), None, length=steps)
        return z

    return jax.jit(jax.vmap(descend))(starts)


def hmc_predictive(
    apply_fn: Callable,
    params0: Any,
    x,
    y,
    x_test,
    prior_precision: float,
    *,
    settings: HMCSettings = HMCSettings(),
    cache_dir: str | Path | None = None,
    model: dict | None = None,
    log: Callable[[str], None] = lambda s: None,
) -> tuple[np.ndarray, dict]:
    """NUTS on ``p(theta | x, y)``; returns the per-chain test predictives ``[chains, n_test, C]``
    (each the mean of softmax over its chain's draws; the pooled predictive is their mean) and the
    diagnostics; cached in ``cache_dir`` (``hmc.npz``, ``hmc.json``) under a :func:`fingerprint`."""
    key = fingerprint(x, y, x_test, params0, prior_precision, settings, model or {})
    folder = Path(cache_dir) if cache_dir is not None else None
    if folder is not None and (folder / "hmc.json").is_file() and (folder / "hmc.npz").is_file():
        try:
            meta = json.loads((folder / "hmc.json").read_text())
            if meta.get("fingerprint") == key:
                with np.load(folder / "hmc.npz") as z:
                    log(f"HMC: cached in {folder}")
                    return np.asarray(z["chain_probs"]), meta["diagnostics"]
        except (OSError, ValueError, KeyError):
            pass
    from numpyro.diagnostics import effective_sample_size, split_gelman_rubin
    from numpyro.infer import MCMC, NUTS

    start = time.perf_counter()
    with jax.enable_x64(True):
        flat0, unravel = ravel_pytree(jax.tree.map(lambda a: jnp.asarray(np.asarray(a, np.float64)), params0))
        loss_tree = negative_log_joint(apply_fn, x, y, prior_precision)

        def loss(z):
            return loss_tree(unravel(z))

        rng = np.random.default_rng(settings.seed)
        starts = jnp.asarray(settings.init_scale * rng.normal(size=(settings.chains, flat0.shape[0])))
        init = _local_maps(loss, flat0, starts, settings.map_steps)
        map_losses = [float(loss(z)) for z in init]
        kernel = NUTS(potential_fn=loss, dense_mass=False, target_accept_prob=settings.target_accept, max_tree_depth=settings.max_tree_depth)
        mcmc = MCMC(kernel, num_warmup=settings.warmup, num_samples=settings.draws, num_chains=settings.chains, chain_method="vectorized", progress_bar=False)
        mcmc.run(jax.random.key(settings.seed), init_params=init, extra_fields=("diverging", "num_steps"))
        samples = np.asarray(mcmc.get_samples(group_by_chain=True), np.float64)  # [chains, draws, P]
        extra = mcmc.get_extra_fields(group_by_chain=True)
        divergences = int(np.sum(np.asarray(extra["diverging"])))
        mean_steps = float(np.mean(np.asarray(extra["num_steps"])))
        x_test64 = jnp.asarray(np.asarray(x_test, np.float64))
        probs_of = jax.jit(jax.vmap(lambda z: jax.nn.softmax(apply_fn(unravel(z), x_test64), axis=-1)))
        draw_probs = np.stack([np.asarray(probs_of(jnp.asarray(c))) for c in samples])  # [chains, draws, n_test, C]
    seconds = time.perf_counter() - start
    chain_probs = draw_probs.mean(axis=1)
    pooled = chain_probs.mean(axis=0)
    multi = settings.chains > 1
    rhat_w = np.asarray(split_gelman_rubin(samples)) if multi else np.full(samples.shape[-1], np.nan)
    ess_w = np.asarray(effective_sample_size(samples))
    p1 = draw_probs[..., 1]  # [chains, draws, n_test]: the function-space quantities
    rhat_f = np.asarray(split_gelman_rubin(p1)) if multi else np.full(p1.shape[-1], np.nan)
    ess_f = np.asarray(effective_sample_size(p1))
    diagnostics = {
        "fingerprint": key,
        "seconds": round(seconds, 1),
        "settings": dataclasses.asdict(settings) | {"chain_method": "vectorized", "x64": True, "metric": "adapted diagonal", "init": "per-chain MAP (Adam)"},
        "num_params": int(flat0.shape[0]),
        "divergences": divergences,
        "mean_leapfrog_steps": round(mean_steps, 1),
        "map_losses": [round(v, 3) for v in map_losses],
        "weights": {"max_split_rhat": float(np.nanmax(rhat_w)), "median_split_rhat": float(np.nanmedian(rhat_w)), "min_ess": float(np.min(ess_w))},
        "function": {
            "max_split_rhat": float(np.nanmax(rhat_f)),
            "median_split_rhat": float(np.nanmedian(rhat_f)),
            "min_ess": float(np.nanmin(ess_f)),
            "median_ess": float(np.nanmedian(ess_f)),
        },
        "chains_vs_pooled": [{"agreement": agreement(c, pooled), "tv": total_variation(c, pooled)} for c in chain_probs],
    }
    log(
        f"HMC: {settings.chains} chains x ({settings.warmup} + {settings.draws}), weights R-hat max {diagnostics['weights']['max_split_rhat']:.3g}, "
        f"function R-hat max {diagnostics['function']['max_split_rhat']:.3g}, {divergences} divergences, {mean_steps:.0f} leapfrogs/draw, {seconds:.0f} s"
    )
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
        write_atomic(folder / "hmc.npz", lambda f: np.savez(f, chain_probs=chain_probs))
        write_atomic(folder / "hmc.json", json.dumps({"fingerprint": key, "diagnostics": diagnostics}, indent=1) + "\n")
    return chain_probs, diagnostics


# ----- the methods' rows --------------------------------------------------------------------------


def config(key: str, rounds: int, num_train: int, num_samples: int) -> dict:
    """The run config of method ``key`` at its defaults with the prior ``N(0, I)`` matched and
    ``num_samples`` draws (or stochastic passes) in its marginalised prediction."""
    _, algorithm = METHODS[key]
    model = {**MODEL, "variational": True} if algorithm["name"] == "vbnn" else dict(MODEL)
    raw: dict[str, Any] = {
        "name": key,
        "seed": 0,
        "rounds": rounds,
        "checkpoint_every": 0,
        "data": dict(DATA),
        "model": model,
        "algorithm": dict(algorithm),
        "client": {},
        "server": {"clients_per_round": DATA["num_clients"]},
        "evaluation": {"marginal_samples": num_samples},
    }
    for section, values in PRIOR_MATCH[algorithm["name"]](PRIOR_PRECISION, num_train, algorithm).items():
        raw.setdefault(section, {}).update(values)
    return raw


def predictives(exp, state, rounds: int, num_train: int, x_test) -> dict[str, tuple[np.ndarray, str]]:
    """A method's predictive probabilities on ``x_test``, ``name -> (probabilities, how)``:

    * ``"run"``: the predictive whose metrics a run reports (:func:`fedbayes.runs.build.build_predictive`:
      the marginalised one of a method with a posterior, with the run's resolved ``[evaluation]``
      settings, e.g. the linearised network over the last layer at a marglik prior precision for a
      Laplace/GGN posterior; a variational model's stochastic passes; FedAvg's point predictive);
    * ``"posterior"`` (a method with a posterior ``q_g``): ``q_g`` itself, all weights drawn
      (its dense precision where it has one) at the method's prior, the network at the drawn weights.
    """
    from fedbayes.evaluation.evaluators import dense_spread, make_marginal_probabilities
    from fedbayes.runs.build import build_predictive

    parts = build_model(exp.config, DataSpec.of(exp.dataset))
    alg, server, e = exp.algorithm, state.server_state, exp.config.evaluation
    x_test = np.asarray(x_test, np.float32)
    made = build_predictive(exp.config, alg, parts, None, num_train)(server, rounds)
    if "_marg" in made:
        how = f"{e.marginal_samples} draws; predictive {e.predictive}, weights {e.subset_of_weights}, prior precision {e.prior_precision}"
        out = {"run": (np.asarray(made["_marg"](x_test, 0)), how)}
    elif exp.config.model.variational:
        out = {"run": (np.asarray(made[""](x_test, 0)), f"{e.marginal_samples} stochastic forward passes")}
    else:
        out = {"run": (np.asarray(made[""](x_test, 0)), "point")}
    if alg.server_posterior is not None:
        mean, var = alg.server_posterior(server)
        how = "marginal variances"
        if alg.server_precision is not None:
            precision = alg.server_precision(server)
            structure = "dense precision" if getattr(precision, "ndim", None) == 2 else "dense last-layer precision, diagonal elsewhere"
            if getattr(exp.config.algorithm, "covariance", None) == "low_rank":
                structure = f"diagonal plus rank-{exp.config.algorithm.rank} precision in its basis"
            if getattr(exp.config.algorithm, "covariance", None) == "kron":
                structure = "precision diagonal in per-layer Kronecker eigenbases"
            var, how = dense_spread(mean, precision), structure
        probs = make_marginal_probabilities(parts.apply_fn, num_samples=e.marginal_samples)(jax.random.key(0), mean, var, x_test)
        out["posterior"] = (np.asarray(probs), f"{e.marginal_samples} draws, all weights, {how}, sampled network")
    return out


def run_method(key: str, rounds: int, num_train: int, x_test, num_samples: int, log) -> dict:
    """One method's row: ``rounds`` rounds, then its predictive probabilities on ``x_test``."""
    raw = config(key, rounds, num_train, num_samples)
    exp = build_experiment(validate(raw))
    sim = exp.simulator
    state = sim.init(exp.params)
    start = time.perf_counter()
    rejected = 0
    for r in range(1, rounds + 1):
        state, info = sim.run_round(state, donate=True)
        rejected += len(info.rejected)
        if r % 10 == 0:
            log(f"    {key}: round {r}, {time.perf_counter() - start:.0f} s")
    jax.block_until_ready(state.server_state)
    seconds = time.perf_counter() - start
    made = predictives(exp, state, rounds, num_train, x_test)
    if not all(np.all(np.isfinite(p)) for p, _ in made.values()):
        raise FloatingPointError("the predictive is not finite")
    log(f"  {METHODS[key][0]}: {rounds} rounds, {seconds:.0f} s")
    row = {"key": key, "label": METHODS[key][0], "rounds": rounds, "seconds": round(seconds, 1), "rejected_messages": rejected}
    row["predictives"] = {name: {"how": how, "probs": p.tolist()} for name, (p, how) in made.items()}
    return row


def method_rows(
    out: Path, rounds: int, methods: list[str], num_train: int, x_test, num_samples: int, log, rounds_of: dict[str, int] | None = None
) -> list[dict]:
    """Every method's row (its predictive probabilities), each cached in ``out/rows/<key>.json``;
    ``rounds_of``: another number of rounds for some methods."""
    rows = []
    for key in methods:
        rounds_here = (rounds_of or {}).get(key, rounds)
        cache = out / "rows" / f"{key}.json"
        stamp = {"config": config(key, rounds_here, num_train, num_samples)}
        if cache.is_file():
            cached = json.loads(cache.read_text())
            if cached.get("stamp") == stamp:
                log(f"  {cached['label']}: cached")
                rows.append(cached)
                continue
        try:
            row = run_method(key, rounds_here, num_train, x_test, num_samples, log)
        except Exception as exc:  # a method that does not build or run is a row that says why
            row = {"key": key, "label": METHODS[key][0], "error": f"{type(exc).__name__}: {exc}"}
            log(f"  {row['label']}: {row['error']}")
        row["stamp"] = stamp
        cache.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(cache, json.dumps(row) + "\n")
        rows.append(row)
    return rows


def central_rows(apply_fn, params0, x, y, x_test, num_samples: int) -> list[dict]:
    """The MAP (Newton in float64 from the runs' initial parameters) and the full Laplace at it, its
    predictive from the sampled network (as the runs' default) and from the network linearised at
    the MAP (:func:`fedbayes.evaluation.evaluators.marginal_metrics`)."""
    from fedbayes.evaluation.evaluators import dense_spread, make_marginal_probabilities, make_probabilities
    from fedbayes.evaluation.reference import map_estimate

    loss = negative_log_joint(apply_fn, x, y, PRIOR_PRECISION)
    theta = map_estimate(loss, params0, max_steps=200)
    x_test = np.asarray(x_test, np.float32)
    rows = [
        {"key": "central_map", "label": "central MAP", "predictives": {"run": {"how": "point", "probs": make_probabilities(apply_fn)(theta, x_test).tolist()}}}
    ]
    cov = laplace_covariance(loss, theta)
    precision = np.linalg.inv(0.5 * (cov + cov.T))
    spread = dense_spread(theta, jnp.asarray(precision, jnp.float32))
    laplace = {}
    for name, predictive in (("posterior", "sample"), ("linearised", "linearised")):
        probs = make_marginal_probabilities(apply_fn, num_samples=num_samples, predictive=predictive)(jax.random.key(0), theta, spread, x_test)
        how = f"{num_samples} draws, all weights, dense precision, " + ("network linearised at the MAP" if predictive == "linearised" else "sampled network")
        laplace[name] = {"how": how, "probs": np.asarray(probs).tolist()}
    rows.append({"key": "central_laplace_full", "label": "central Laplace at the MAP, full covariance", "predictives": laplace})
    return rows


def setup() -> tuple[Any, Any, Any]:
    """The data set, the client split and the model, exactly as the runs see them."""
    probe = validate(config("fedavg", 1, 1, 1))
    dataset, parts, _ = prepare_split(probe)
    return dataset, parts, build_model(probe, DataSpec.of(dataset))


def run(
    out: Path,
    rounds: int,
    settings: HMCSettings,
    methods: list[str],
    num_samples: int,
    log=print,
    rows_only: bool = False,
    rounds_of: dict[str, int] | None = None,
) -> dict | None:
    """HMC, the central rows and every method's row (each cached); writes ``bnn_truth.json`` and
    ``.md``. ``rows_only``: only the methods' rows (no HMC, no table), e.g. beside a running HMC."""
    out.mkdir(parents=True, exist_ok=True)
    dataset, parts, model = setup()
    x, y, x_test, y_test = dataset.x_train, dataset.y_train, dataset.x_test, dataset.y_test
    log(f"{dataset.num_train} train / {len(y_test)} test, client sizes {[len(p) for p in parts]}")
    if rows_only:
        method_rows(out, rounds, methods, dataset.num_train, x_test, num_samples, log, rounds_of)
        return None
    chain_probs, hmc = hmc_predictive(model.apply_fn, model.params, x, y, x_test, PRIOR_PRECISION, settings=settings, cache_dir=out, model=MODEL, log=log)
    reference = chain_probs.mean(axis=0)
    rows = [{"key": "hmc", "label": "HMC (reference)", **compare(reference, reference, y_test)}]
    rows += [{"key": f"hmc_chain_{i}", "label": f"HMC chain {i} alone", **compare(c, reference, y_test)} for i, c in enumerate(chain_probs)]
    central = out / "rows" / "central.json"
    stamp = {"samples": num_samples, "model": MODEL, "predictives": ["posterior", "linearised"]}
    if central.is_file() and json.loads(central.read_text()).get("stamp") == stamp:
        central_list = json.loads(central.read_text())["rows"]
    else:
        central_list = central_rows(model.apply_fn, model.params, x, y, x_test, num_samples)
        central.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(central, json.dumps({"stamp": stamp, "rows": central_list}) + "\n")
    for row in central_list + method_rows(out, rounds, methods, dataset.num_train, x_test, num_samples, log, rounds_of):
        shown = {k: v for k, v in row.items() if k not in ("predictives", "stamp")}
        if "predictives" in row:
            shown["predictives"] = {n: {"how": p["how"], **compare(np.asarray(p["probs"]), reference, y_test)} for n, p in row["predictives"].items()}
        rows.append(shown)
    result = {
        "setup": {
            "model": MODEL,
            "data": DATA,
            "prior": "N(0, I)",
            "rounds": rounds,
            "rounds_of": rounds_of or {},
            "samples": num_samples,
            "num_train": int(dataset.num_train),
        },
        "hmc": hmc,
        "rows": rows,
    }
    write_atomic(out / "bnn_truth.json", json.dumps(result, indent=1) + "\n")
    write_atomic(out / "bnn_truth.md", markdown(result))
    return result


def markdown(result: dict) -> str:
    """The rows as a markdown table, one line per predictive of a method."""
    lines = [
        "| method | rounds | predictive | agreement with HMC | TV to HMC | acc | NLL | ECE % | seconds |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        seconds = f"{r['seconds']:.0f}" if "seconds" in r else "-"
        if "error" in r:
            lines.append(f"| {r['label']} | - | not run: {r['error'][:160]} | - | - | - | - | - | - |")
            continue
        for name, p in r.get("predictives", {"-": {"how": "", **r}}).items():
            what = f"{name}: {p['how']}" if p["how"] else "-"
            cells = [
                r["label"],
                str(r.get("rounds", "-")),
                what,
                f"{p['agreement']:.3f}",
                f"{p['tv']:.4f}",
                f"{p['accuracy']:.4f}",
                f"{p['nll']:.4f}",
                f"{100 * p['ece']:.2f}",
                seconds,
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/bnn_truth"))
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--samples", type=int, default=100, help="weight draws per method's predictive")
    parser.add_argument("--chains", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=500)
    parser.add_argument("--draws", type=int, default=1000)
    parser.add_argument("--rounds-of", action="append", default=[], metavar="KEY=R", help="another number of rounds for one method (repeatable)")
    parser.add_argument("--rows-only", action="store_true", help="only the methods' rows (no HMC, no table)")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, of {', '.join(METHODS)}; empty: HMC only")
    args = parser.parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    bad = [m for m in methods if m not in METHODS]
    if bad:
        print(f"--methods: unknown {bad}; allowed: {', '.join(METHODS)}", file=sys.stderr)
        return 2
    for name in ("rounds", "samples", "chains", "warmup", "draws"):
        if getattr(args, name) < 1:
            print(f"--{name}: must be >= 1; got {getattr(args, name)}", file=sys.stderr)
            return 2
    rounds_of = {}
    for item in args.rounds_of:
        name, _, value = item.partition("=")
        if name not in METHODS or not value.isdigit() or int(value) < 1:
            print(f"--rounds-of: expected KEY=R with KEY one of {', '.join(METHODS)} and R >= 1; got {item!r}", file=sys.stderr)
            return 2
        rounds_of[name] = int(value)
    settings = HMCSettings(chains=args.chains, warmup=args.warmup, draws=args.draws)
    result = run(args.out, args.rounds, settings, methods, args.samples, log=lambda s: print(s, flush=True), rows_only=args.rows_only, rounds_of=rounds_of)
    if result is not None:
        print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
