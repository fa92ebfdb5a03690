"""Posterior quality against ground truth: the code behind ``fedbayes bench posterior``.

Bayesian logistic regression (the ``logreg`` model, 2 classes, prior ``N(0, I)`` on every
parameter) on data split over clients by the library's Dirichlet(0.5) partition (10 clients, seed
0, all clients in every round). Each Bayesian method is built from a config through
:func:`fedbayes.runs.build.build_experiment`, as ``fedbayes run`` builds it, **at its defaults**:
only the data, the model, the prior (:data:`PRIOR_MATCH`), the number of rounds and the cohort
are set (and, where a method does not build at its defaults, the least that makes it build: the
identity and mcmc clients of FedEP/FedSEP run with ``preset = "paper"``, mcmc with 2 local
epochs; :data:`METHODS` says so per row). ``--client`` sets a common ``[client]`` section for
every method instead of the defaults. It runs round by round (:meth:`~fedbayes.sim.simulator.Simulator.run_round`); every
``check_every`` rounds its posterior ``q`` (``algorithm.server_posterior``) is compared with its
own family's centralised optimum, and the run stops once

    ||m_q - m_ref|| / ||m_ref|| <= 0.05   and   median_j v_q,j / v_ref,j in [0.8, 1.25]

(the bar this benchmark checks), or after ``max_rounds``. The family optima
(:mod:`fedbayes.evaluation.reference`, float64 on the pooled training data):

* ``diag_laplace``, ``N(theta*, 1 / diag H)``: FedEP/FedSEP with Laplace clients and
  FedLap-Cov (diagonal Laplace/GGN sites);
* ``laplace``, ``N(theta*, H^{-1})`` (its marginals): FedEP with Laplace clients and FedLap-Cov,
  both with ``covariance = "full"`` (dense sites, docs/algorithms.md §7.12, §10.1);
* ``ngvi``, ``N(theta*, 1 / P)`` with ``P = lambda + E_{N(theta*, 1/P)}[diag GGN]``: FedEP/FedSEP
  with NGVI clients, whose precision is the Fisher averaged over the approximation itself
  (:func:`~fedbayes.evaluation.reference.expected_fisher_laplace`);
* ``mfvi``, the exact mean-field Gaussian VI optimum: PVI;
* ``mfvi_point_bias``, the same with the bias a point without a prior
  (:func:`~fedbayes.evaluation.reference.mean_field_vi` with ``points``): the variational BNN, whose
  layer's bias is deterministic and outside its KL, so that this, not ``mfvi``, is the optimum of
  its objective (computed only when such a method is run; its central row also reports
  ``vs_mfvi``, how far the two optima are apart);
* ``full_vi``, the full-covariance Gaussian VI optimum (its marginals,
  :func:`~fedbayes.evaluation.reference.full_covariance_vi`): PVI with ``covariance = "full"``;
* ``low_rank_laplace``, ``N(theta*, (lambda I + diag((I - P) G (I - P)) + P G P)^{-1})`` (its
  marginals) with ``G`` the GGN of the pooled data at ``theta*`` and ``P = B B^T`` for the basis
  ``B`` the method holds at the check: FedLap-Cov with ``covariance = "low_rank"``, whose fixed
  point is that Laplace in its own basis (docs/algorithms.md §10.3);
* ``kron_laplace``, ``N(theta*, (U diag(lambda + diag(U^T G U)) U^T)^{-1})`` (its marginals) for the
  per-layer Kronecker eigenbases ``U`` the method holds at the check: FedLap-Cov with ``covariance =
  "kron"``, whose fixed point is that Laplace in its own bases (docs/algorithms.md §10.4);
* ``sep_laplace`` / ``sep_ngvi``, stochastic EP's own fixed point on the problem's split
  (:func:`~fedbayes.evaluation.reference.sep_fixed_point`, Laplace or NGVI factors, the cavity's
  power the method's ``sep_power``): what FedSEP converges to once its clients solve their tilted
  problems exactly. It is not one of
  :data:`METHODS`' families (FedSEP's rows are measured against EP's, the posterior a user asks
  for); ``benchmarks/sep_fixed_point.py`` runs FedSEP against it;
* ``map``, the MAP (means only): FedEP/FedSEP with identity or mcmc clients, whose variance is
  set by their ``scale`` hyperparameter and not by the data, and FedAvg (a point).

Ground truth: NUTS (:mod:`fedbayes.bench.truth`). Reported per method (a row): the mean's
relative L2 distance and the variance ratios (median [min, max] over coordinates) to NUTS and to
the family optimum, ``KL(NUTS-diag || q)`` summed over the coordinates, the exact test accuracy,
NLL and ECE of ``q``'s predictive (Gauss-Hermite on the logit difference,
:func:`~fedbayes.evaluation.reference.affine_predictive_metrics`; a method with a dense posterior,
``Algorithm.server_precision``, with its full covariance), the rounds to reach the bar and
the compute seconds to get there (every round blocked on its results; the first round's compile
included), plus the central references' own rows against NUTS.

Data sets (:data:`PROBLEMS`): ``breast_cancer`` (scikit-learn, 30 standardised features) and
``digits_3v8`` (scikit-learn's digits, the classes 3 and 8 of the library's stratified split,
pixels standardised on the training part, constant pixels dropped), written as a LEAF-format folder
so that the run config reads it as any local data set (``data.dataset = "leaf"``).

Results are cached per row (``<out>/<problem>/rows/<method>.json``, keyed by the config and the
stopping rule) and NUTS per problem (``<out>/<problem>/nuts.*``): an interrupted benchmark redoes
only what had not finished.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from fedbayes import gaussian_block, gaussian_kron, gaussian_lowrank
from fedbayes.bench.truth import NUTSSettings, nuts_reference
from fedbayes.config.schema import validate
from fedbayes.evaluation.distances import kl_diag, relative_l2, variance_ratio
from fedbayes.evaluation.reference import affine_predictive_metrics, laplace_covariance, mean_field_vi, negative_log_joint, references, sep_fixed_point
from fedbayes.gaussian_block import BlockGaussian, BlockPrecision
from fedbayes.gaussian_kron import KronSpread
from fedbayes.gaussian_lowrank import LowRankGaussian
from fedbayes.runs.build import DataSpec, build_experiment, build_model, prepare_split
from fedbayes.runs.folder import write_atomic
from fedbayes.sim.compiled import release_if_crowded

__all__ = [
    "FAMILIES",
    "FULL",
    "METHODS",
    "PRIOR_MATCH",
    "PROBLEMS",
    "QUICK",
    "Method",
    "PosteriorBenchSettings",
    "Problem",
    "markdown",
    "run_posterior_bench",
]

PRIOR_PRECISION = 1.0  # lambda: the prior N(0, I / lambda) on every parameter
MEAN_TOLERANCE = 0.05  # the bar: relative L2 of the mean to the family optimum ...
VARIANCE_BAND = (0.8, 1.25)  # ... and the median variance ratio to it
FAMILIES = (
    "diag_laplace",
    "laplace",
    "ngvi",
    "mfvi",
    "mfvi_point_bias",
    "full_vi",
    "low_rank_laplace",
    "kron_laplace",
    "sep_laplace",
    "sep_ngvi",
    "map",
    "truth",
)  # truth: NUTS's own moments (a moment-matching method's target)
LOGREG = {"name": "logreg"}
LINEAR_VARIATIONAL = {"name": "mlp", "hidden": [], "variational": True}


# ----- the prior, matched per method --------------------------------------------------------------


def _ep_prior(lam: float, n: int, algorithm: dict) -> dict:
    if algorithm.get("preset") == "paper":
        # the paper preset has no separate p0: weight decay is a prior of precision
        # weight_decay * n_k in client k's tilted distribution, weight_decay * N in all
        return {"algorithm": {"weight_decay": lam / n, "prior_precision": 0.0}}
    # the posterior preset: p0 = N(0, 1 / prior_precision), one factor of q_g; no weight decay on top
    return {"algorithm": {"prior_precision": lam, "weight_decay": 0.0}}


PRIOR_MATCH: dict[str, Callable[[float, int, dict], dict]] = {
    # method name -> (lambda, N, its [algorithm] section) -> the config sections that make its prior N(0, I / lambda) over N examples
    "fedep": _ep_prior,
    "fedsep": _ep_prior,
    "pvi": lambda lam, n, alg: {"algorithm": {"delta": lam}},  # p(theta) = N(0, 1/delta) on the sum-loss scale
    "fedlap_cov": lambda lam, n, alg: {"algorithm": {"delta": lam}},  # the same
    "vbnn": lambda lam, n, alg: {"algorithm": {"prior_variance": 1.0 / lam}},  # KL to N(0, prior_variance) per variational weight
    # FedAvg minimises the mean loss: decay lambda / N is the prior's share of it
    "fedavg": lambda lam, n, alg: {"client": {"weight_decay": lam / n}},
}
"""The config settings that give each method the prior ``N(0, I / lambda)`` on ``N`` examples."""


@dataclasses.dataclass(frozen=True)
class Method:
    """One row: a method at its defaults.

    Attributes:
        key: a short id (the row's cache file name).
        label: the row's name.
        algorithm: the ``[algorithm]`` section without the prior (name and client method only).
        family: whose optimum it targets: one of :data:`FAMILIES`.
        model: the ``[model]`` section (logistic regression unless the method needs a variational model).
        kernel_only: compare only the kernel (a variational layer's bias is deterministic).
        client: ``[client]`` settings a method needs to build at all (else the defaults).
    """

    key: str
    label: str
    algorithm: dict
    family: str
    model: dict = dataclasses.field(default_factory=lambda: dict(LOGREG))
    kernel_only: bool = False
    client: dict = dataclasses.field(default_factory=dict)


def _ep_methods(name: str, label: str) -> list[Method]:
    # laplace and ngvi at the defaults (the posterior preset); identity and mcmc have no
    # data-driven variance (it is 1 / (scale * (initial_precision + weight_decay) * N), a
    # hyperparameter) and build only with the paper preset's settings, so they run with it
    rows = [Method(f"{name}_{m}", f"{label} ({m})", {"name": name, "method": m}, family) for m, family in (("laplace", "diag_laplace"), ("ngvi", "ngvi"))]
    # (mcmc estimates its variance from one iterate per epoch: it needs 2 epochs)
    rows += [
        Method(
            f"{name}_{m}",
            f"{label} ({m}, preset paper{', 2 epochs' if m == 'mcmc' else ''})",
            {"name": name, "method": m, "preset": "paper"},
            "map",
            client={"epochs": 2} if m == "mcmc" else {},
        )
        for m in ("identity", "mcmc")
    ]
    return rows


METHODS: tuple[Method, ...] = (
    *_ep_methods("fedep", "FedEP"),
    *_ep_methods("fedsep", "FedSEP"),
    Method("fedep_laplace_full", "FedEP (laplace, covariance full)", {"name": "fedep", "method": "laplace", "covariance": "full"}, "laplace"),
    Method("fedep_laplace_kron", "FedEP (laplace, covariance kron)", {"name": "fedep", "method": "laplace", "covariance": "kron"}, "kron_laplace"),
    Method(
        "fedep_laplace_low_rank", "FedEP (laplace, covariance low_rank)", {"name": "fedep", "method": "laplace", "covariance": "low_rank"}, "low_rank_laplace"
    ),
    Method("fedep_ngvi_full", "FedEP (ngvi, covariance full)", {"name": "fedep", "method": "ngvi", "covariance": "full"}, "full_vi"),
    Method("fedsep_ngvi_full", "FedSEP (ngvi, covariance full)", {"name": "fedsep", "method": "ngvi", "covariance": "full"}, "full_vi"),
    Method(
        "fedep_nuts_full",
        "FedEP (nuts, covariance full)",
        {"name": "fedep", "method": "nuts", "covariance": "full"},
        "truth",
    ),
    Method("pvi", "PVI", {"name": "pvi"}, "mfvi"),
    Method("pvi_natural", "PVI (local_vi natural)", {"name": "pvi", "local_vi": "natural"}, "mfvi"),
    Method("pvi_sgd", "PVI (local_vi sgd)", {"name": "pvi", "local_vi": "sgd"}, "mfvi"),
    Method("pvi_full", "PVI (covariance full)", {"name": "pvi", "covariance": "full"}, "full_vi"),
    Method("fedlap_cov", "FedLap-Cov", {"name": "fedlap_cov"}, "diag_laplace"),
    Method("fedlap_cov_full", "FedLap-Cov (covariance full)", {"name": "fedlap_cov", "covariance": "full"}, "laplace"),
    Method("fedlap_cov_low_rank", "FedLap-Cov (covariance low_rank)", {"name": "fedlap_cov", "covariance": "low_rank"}, "low_rank_laplace"),
    Method("fedlap_cov_kron", "FedLap-Cov (covariance kron)", {"name": "fedlap_cov", "covariance": "kron"}, "kron_laplace"),
    Method("vbnn", "VBNN (linear, kernel only)", {"name": "vbnn"}, "mfvi_point_bias", model=dict(LINEAR_VARIATIONAL), kernel_only=True),
    Method("fedavg", "FedAvg (point)", {"name": "fedavg"}, "map"),
)


# ----- data ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Problem:
    """A data set and its split.

    Attributes:
        name: the problem's name (its folder under ``--out``).
        data: ``folder -> [data] section`` (without the split); ``folder`` is the problem's folder,
            where :attr:`write` puts local files.
        split: the split's keys of the ``[data]`` section.
        write: ``folder -> None``: writes the data files the section reads (None: nothing to write).
    """

    name: str
    data: Callable[[Path], dict]
    split: dict = dataclasses.field(default_factory=lambda: {"num_clients": 10, "partition": "dirichlet", "alpha": 0.5})
    write: Callable[[Path], None] | None = None


def write_leaf(folder: Path, x_train, y_train, x_test, y_test) -> None:
    """Writes a LEAF-format folder (one user per split) that ``data.dataset = "leaf"`` reads.

    float32 values print exactly as JSON numbers (``repr`` of a float round-trips), so the loader
    gets back the same float32 features."""
    for split, x, y in (("train", x_train, y_train), ("test", x_test, y_test)):
        (folder / split).mkdir(parents=True, exist_ok=True)
        rows = np.asarray(x, np.float32).reshape(len(x), -1).astype(np.float64).tolist()
        blob = {"users": ["all"], "num_samples": [len(rows)], "user_data": {"all": {"x": rows, "y": [int(v) for v in y]}}}
        write_atomic(folder / split / "data.json", json.dumps(blob))


def _write_digits_3v8(folder: Path) -> None:
    from fedbayes.data.sklearn_data import load_digits

    d = load_digits()
    pick_train, pick_test = np.isin(d.y_train, (3, 8)), np.isin(d.y_test, (3, 8))
    x_train = d.x_train[pick_train].reshape(int(pick_train.sum()), -1).astype(np.float64)
    x_test = d.x_test[pick_test].reshape(int(pick_test.sum()), -1).astype(np.float64)
    mean, std = x_train.mean(axis=0), x_train.std(axis=0)
    keep = std > 0  # a pixel constant on the training part carries no information: dropped
    x_train = (x_train[:, keep] - mean[keep]) / std[keep]
    x_test = (x_test[:, keep] - mean[keep]) / std[keep]
    write_leaf(folder / "data", x_train, (d.y_train[pick_train] == 8).astype(int), x_test, (d.y_test[pick_test] == 8).astype(int))


PROBLEMS: dict[str, Problem] = {
    "breast_cancer": Problem("breast_cancer", lambda folder: {"dataset": "breast_cancer"}),
    "digits_3v8": Problem(
        "digits_3v8",
        lambda folder: {"dataset": "leaf", "data_dir": str(folder / "data"), "num_classes": 2},
        write=_write_digits_3v8,
    ),
}


# ----- settings -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PosteriorBenchSettings:
    """How long to run and how well to sample.

    Attributes:
        max_rounds: the most rounds a method runs before its row is reported as not reaching the bar.
        check_every: rounds between comparisons with the family optimum.
        nuts: the NUTS settings.
        client: ``[client]`` settings for every method (default: none, the methods' defaults),
            e.g. a larger local budget to separate a method's fixed point from its local solver.
        stop_at_bar: end a method's run at the first check that meets the bar (the default);
            ``False`` runs all ``max_rounds`` rounds, and the row also says how far the method
            strayed after first meeting it (``after_bar``): whether it stays there.
        clients_per_round: the cohort a round (default: every client, the benchmark's setting).
        seed: the runs' seed (the split and NUTS stay the problem's).
    """

    max_rounds: int = 1000
    check_every: int = 10
    nuts: NUTSSettings = NUTSSettings()
    client: dict = dataclasses.field(default_factory=dict)
    stop_at_bar: bool = True
    clients_per_round: int | None = None
    seed: int = 0


FULL = PosteriorBenchSettings()
QUICK = PosteriorBenchSettings(max_rounds=60, check_every=5, nuts=NUTSSettings(chains=4, warmup=300, draws=500))


# ----- one problem --------------------------------------------------------------------------------


def _config(
    problem: Problem, folder: Path, method: Method, num_train: int, rounds: int, client: dict | None = None, settings: PosteriorBenchSettings | None = None
) -> dict:
    raw: dict[str, Any] = {
        "name": method.key,
        "seed": 0 if settings is None else settings.seed,
        "rounds": rounds,
        "checkpoint_every": 0,
        "data": {**problem.data(folder), **problem.split},
        "model": dict(method.model),
        "algorithm": dict(method.algorithm),
        "client": {**method.client, **(client or {})},  # settings for every method win over a method's own
    }
    for section, values in PRIOR_MATCH[method.algorithm["name"]](PRIOR_PRECISION, num_train, method.algorithm).items():
        raw.setdefault(section, {}).update(values)
    cohort = None if settings is None else settings.clients_per_round
    raw["server"] = {"clients_per_round": problem.split["num_clients"] if cohort is None else cohort}
    return raw


def _bias_leaves(params: Any) -> Any:
    """A bool pytree like ``params``: True at the leaves named ``bias``."""
    return jax.tree_util.tree_map_with_path(lambda path, _: getattr(path[-1], "key", None) == "bias", params)


def _kernel(tree: Any) -> Any:
    """The kernel leaf of a one-layer model (``{"dense": {"kernel", "bias"}}``)."""
    (layer,) = tree.values()
    return layer["kernel"]


def _posterior(exp, server_state) -> tuple[Any, Any | None]:
    """``(mean, variance)`` of the server's posterior; variance None for a point method. A
    variational layer gives its kernel's mean and forward-pass variance."""
    alg = exp.algorithm
    if alg.server_posterior is not None:
        return alg.server_posterior(server_state)
    params = alg.server_params(server_state)
    if exp.config.model.variational:
        from fedbayes.models import variational

        (layer,) = params.values()
        mean = {"dense": {"kernel": layer["kernel" + variational.MEAN_SUFFIX], "bias": layer["bias"]}}
        forward = variational.clamped_variance if exp.config.algorithm.variant == "paper" else variational.variance  # what the forward pass uses
        var = {"dense": {"kernel": forward(layer["kernel" + variational.LOGVAR_SUFFIX]), "bias": jnp.zeros_like(layer["bias"])}}
        return mean, var
    return params, None


def _compare(mean, var, ref_mean, ref_var, kernel_only: bool) -> dict:
    pick = _kernel if kernel_only else (lambda t: t)
    out: dict[str, Any] = {"mean_rel_l2": relative_l2(pick(mean), pick(ref_mean))}
    if var is not None and ref_var is not None:
        out["var_ratio"] = list(variance_ratio(pick(var), pick(ref_var)))
    return out


def _reached(family: str, comparison: dict) -> bool:
    if comparison["mean_rel_l2"] > MEAN_TOLERANCE:
        return False
    if family == "map":
        return True
    low, high = VARIANCE_BAND
    return low <= comparison["var_ratio"][0] <= high


def _row_stats(label, mean, var, nuts, apply_fn, x_test, y_test, kernel_only=False, covariance=None) -> dict:
    """A row's distances to NUTS and its predictive's metrics; ``covariance``: a dense posterior's
    ``[P, P]`` covariance, whose predictive keeps the correlations (else the marginals')."""
    vs_nuts = _compare(mean, var, nuts.mean, nuts.variance, kernel_only)
    pick = _kernel if kernel_only else (lambda t: t)
    row = {"label": label, "vs_nuts": vs_nuts}
    if var is not None:
        row["kl_nuts_q"] = kl_diag(pick(nuts.mean), pick(nuts.variance), pick(mean), pick(var))
    row["predictive"] = affine_predictive_metrics(apply_fn, mean, None if covariance is not None else var, x_test, y_test, covariance=covariance)
    return row


def _dense_covariance(exp, server_state) -> np.ndarray | None:
    """The ``[P, P]`` covariance of a dense posterior (``Algorithm.server_precision``), in float64; else None."""
    if exp.algorithm.server_precision is None:
        return None
    precision = exp.algorithm.server_precision(server_state)
    if isinstance(precision, BlockPrecision):  # the [P, P] matrix of a last-layer structure
        precision = gaussian_block.precision_matrix(BlockGaussian(exp.algorithm.server_params(server_state), precision))
    elif isinstance(precision, LowRankGaussian):  # the [P, P] matrix of a low-rank structure
        precision = gaussian_lowrank.precision_matrix(precision)
    elif isinstance(precision, KronSpread):  # the [P, P] matrix of a Kronecker-factored structure
        precision = gaussian_kron.in_bases(precision.bases).precision_matrix(precision.precision)
    precision = np.asarray(precision, np.float64)
    cov = np.linalg.inv(0.5 * (precision + precision.T))
    return 0.5 * (cov + cov.T)


def _low_rank_marginals(hessian: np.ndarray, basis: Any, like: Any) -> Any:
    """The marginal variances of the Laplace in a low-rank structure: ``hessian`` is ``G + lambda I``
    at the MAP (float64), ``basis`` the ``[P, r]`` orthonormal basis; shaped like ``like``."""
    b = np.asarray(basis, np.float64)
    ggn = hessian - PRIOR_PRECISION * np.eye(len(hessian))
    proj = b @ b.T
    rest = (np.eye(len(ggn)) - proj) @ ggn @ (np.eye(len(ggn)) - proj)
    precision = PRIOR_PRECISION * np.eye(len(ggn)) + np.diag(np.diag(rest)) + proj @ ggn @ proj
    _, unravel = ravel_pytree(like)
    return unravel(jnp.asarray(np.diag(np.linalg.inv(precision)), jnp.float32))


def _kron_marginals(hessian: np.ndarray, bases: Any, like: Any) -> Any:
    """The marginal variances of the Laplace in a Kronecker-factored structure: ``hessian`` is ``G +
    lambda I`` at the MAP (float64), ``bases`` the per-leaf eigenbases; shaped like ``like``."""
    u = np.asarray(gaussian_kron.dense_rotation(like, bases), np.float64)
    eigenvalues = np.diag(u.T @ hessian @ u)  # lambda I is lambda in every basis
    _, unravel = ravel_pytree(like)
    return unravel(jnp.asarray(np.square(u) @ (1.0 / eigenvalues), jnp.float32))


def _run_method(
    problem: Problem, folder: Path, method: Method, refs, nuts, dataset, apply_fn, settings: PosteriorBenchSettings, log, extra: dict | None = None
) -> dict:
    """One method's row; ``extra`` holds the families computed only when asked for (``sep_*``,
    ``mfvi_point_bias``) as ``family -> (mean, variance)``."""
    raw = _config(problem, folder, method, dataset.num_train, settings.max_rounds, settings.client, settings)
    release_if_crowded()  # one process runs every method's rows
    exp = build_experiment(validate(raw))
    hessian = None
    if method.family in ("low_rank_laplace", "kron_laplace"):  # its reference moves with the method's basis: from the full Laplace's Hessian at each check
        hessian = np.linalg.inv(laplace_covariance(negative_log_joint(apply_fn, dataset.x_train, dataset.y_train, PRIOR_PRECISION), refs.map))
    family_mean, family_var = {
        "diag_laplace": refs.diag_laplace,
        "laplace": refs.laplace_marginals,
        "ngvi": refs.ngvi,
        "mfvi": refs.mfvi,
        "full_vi": (refs.full_vi[0], _marginals(refs.full_vi)),
        "low_rank_laplace": (refs.map, None),
        "kron_laplace": (refs.map, None),
        "map": (refs.map, None),
        "truth": (nuts.mean, nuts.variance),
        **(extra or {}),
    }[method.family]
    sim = exp.simulator
    state = sim.init(exp.params)
    seconds, first_round_s, trajectory, reached_at, comparison, rejected, steps = 0.0, None, [], None, None, 0, []
    mean = var = None
    for r in range(1, settings.max_rounds + 1):
        start = time.perf_counter()
        state, info = sim.run_round(state, donate=True)
        jax.block_until_ready(state.server_state)
        rejected += len(info.rejected)
        steps.append(float(np.mean(info.clients["steps"])))  # local steps per client this round (the cost of "right")
        spent = time.perf_counter() - start
        seconds += spent
        first_round_s = spent if first_round_s is None else first_round_s
        if r % settings.check_every and r != settings.max_rounds:
            continue
        mean, var = _posterior(exp, state.server_state)
        if hessian is not None:
            marginals = _kron_marginals if method.family == "kron_laplace" else _low_rank_marginals
            basis = state.server_state.basis
            family_var = marginals(hessian, basis.bases if method.family == "kron_laplace" else basis, mean)
        comparison = _compare(mean, var, family_mean, family_var, method.kernel_only)
        if not all(bool(np.all(np.isfinite(np.asarray(leaf)))) for leaf in jax.tree.leaves((mean, var))):
            raise FloatingPointError(f"the server posterior is not finite at round {r}")
        point = {"round": r, **comparison}
        if info.server and "damping" in info.server:  # the damping this round's clients used
            point["damping"] = float(info.server["damping"])
        trajectory.append(point)
        if reached_at is None and _reached(method.family, comparison):
            reached_at = r
            if settings.stop_at_bar:
                break
    covariance = _dense_covariance(exp, state.server_state)
    row = _row_stats(method.label, mean, var, nuts, apply_fn, dataset.x_test, dataset.y_test, method.kernel_only, covariance=covariance)
    if covariance is not None:
        row["predictive_marginals"] = affine_predictive_metrics(apply_fn, mean, var, dataset.x_test, dataset.y_test)  # the old, marginal-only predictive
    row.update(
        key=method.key,
        family=method.family,
        vs_family=comparison,
        rounds=trajectory[-1]["round"],
        reached_round=reached_at,
        seconds=round(seconds, 2),
        first_round_s=round(first_round_s, 2),
        rejected_messages=rejected,
        steps_per_client_round=round(float(np.mean(steps)), 1),
        trajectory=trajectory,
        config=raw,
    )
    if reached_at is not None and not settings.stop_at_bar:
        row["after_bar"] = _after_bar(trajectory, reached_at, method.family)
    log(
        f"  {method.label}: round {row['rounds']}{' (reached)' if reached_at else ''}, vs family {comparison['mean_rel_l2']:.3f}"
        + (f", var x{comparison['var_ratio'][0]:.3g}" if "var_ratio" in comparison else "")
        + f", {seconds:.1f} s"
    )
    return row


def _marginals(mean_cov) -> Any:
    """The marginal variances of a ``(mean, [P, P] covariance)`` pair, shaped like the mean."""
    mean, cov = mean_cov
    _, unravel = ravel_pytree(mean)
    return unravel(jnp.asarray(np.diag(cov), jnp.float32))


def _after_bar(trajectory: list[dict], reached_at: int, family: str) -> dict:
    """How far a method strayed from its family optimum at the checks after it first met the bar:
    the largest mean distance, the variance ratios' range (median over parameters at each check),
    and the share of those checks that still meet the bar."""
    later = [t for t in trajectory if t["round"] > reached_at]
    out = {"checks": len(later), "max_mean_rel_l2": max((t["mean_rel_l2"] for t in later), default=None)}
    if later and family != "map":
        ratios = [t["var_ratio"][0] for t in later]
        out["var_ratio_range"] = [min(ratios), max(ratios)]
    out["share_meeting_bar"] = sum(_reached(family, t) for t in later) / len(later) if later else None
    return out


def _stopping_rule(settings: PosteriorBenchSettings) -> dict:
    rule = {"max_rounds": settings.max_rounds, "check_every": settings.check_every, "mean_tolerance": MEAN_TOLERANCE, "variance_band": list(VARIANCE_BAND)}
    if not settings.stop_at_bar:  # a row cached under the usual rule stays valid
        rule["stop_at_bar"] = False
    return rule


def run_problem(problem: Problem, out: Path, settings: PosteriorBenchSettings, methods: Sequence[Method] = METHODS, log=lambda s: None) -> dict:
    """Every method's row on one problem, with the references' and NUTS's rows; cached in ``out/<name>``."""
    folder = Path(out) / problem.name
    folder.mkdir(parents=True, exist_ok=True)
    if problem.write is not None:
        problem.write(folder)
    # the data and the model exactly as the runs see them (a FedAvg config: no method-specific data)
    probe = validate(_config(problem, folder, Method("probe", "probe", {"name": "fedavg"}, "map"), 1, 1))
    dataset, parts, _ = prepare_split(probe)
    model = build_model(probe, DataSpec.of(dataset))
    x, y = dataset.x_train, dataset.y_train
    log(
        f"{problem.name}: {dataset.num_train} train / {len(dataset.y_test)} test examples, {x.reshape(len(x), -1).shape[1]} features, client sizes {[len(p) for p in parts]}"
    )
    # the references' objectives are convex: a start of zeros fixes only their structure (from the
    # model's random start Newton stalled at 3e-8 on one problem's mean-field optimum)
    refs = references(model.apply_fn, jax.tree.map(jnp.zeros_like, model.params), x, y, PRIOR_PRECISION)
    nuts = nuts_reference(
        model.apply_fn, model.params, x, y, PRIOR_PRECISION, x_test=dataset.x_test, y_test=dataset.y_test, settings=settings.nuts, cache_dir=folder, log=log
    )
    rows = []
    nuts_row = {"label": "NUTS (ground truth)", "key": "nuts", "vs_nuts": {"mean_rel_l2": 0.0, "var_ratio": [1.0, 1.0, 1.0]}, "kl_nuts_q": 0.0}
    nuts_row["predictive"] = nuts.diagnostics["predictive"]
    rows.append(nuts_row)
    central = (
        ("central_map", "central MAP (point)", refs.map, None, "map"),
        ("central_laplace_marginals", "central Laplace, full covariance (marginals; predictive with the full covariance)", *refs.laplace_marginals, None),
        ("central_diag_laplace", "central Laplace, diagonal precision 1/diag(H)", *refs.diag_laplace, "diag_laplace"),
        ("central_mfvi", "central mean-field VI (exact optimum)", *refs.mfvi, "mfvi"),
        (
            "central_full_vi",
            "central full-covariance VI (optimum; marginals; predictive with the full covariance)",
            refs.full_vi[0],
            _marginals(refs.full_vi),
            None,
        ),
        ("central_ngvi", "central NGVI fixed point (Fisher averaged over q, at the MAP)", *refs.ngvi, "ngvi"),
    )
    # SEP's fixed point depends on the split and the cavity's power: computed only for a method measured against it
    sep = {}
    for family in sorted({m.family for m in methods if m.family.startswith("sep_")}):
        powers = {m.algorithm.get("sep_power", "data_fraction") for m in methods if m.family == family}
        if len(powers) > 1:
            raise ValueError(f"the {family} methods of one run must share algorithm.sep_power; got {sorted(powers)}")
        tilted = family.removeprefix("sep_")
        sep[tilted] = sep_fixed_point(
            model.apply_fn, jax.tree.map(jnp.zeros_like, model.params), x, y, parts, PRIOR_PRECISION, tilted=tilted, power=powers.pop()
        )
    central += tuple(
        (f"central_sep_{tilted}", f"central SEP fixed point ({tilted} factors, this split)", *fixed_point, f"sep_{tilted}")
        for tilted, fixed_point in sep.items()
    )
    extra = {f"sep_{tilted}": fixed_point for tilted, fixed_point in sep.items()}
    if any(m.family == "mfvi_point_bias" for m in methods):
        zeros = jax.tree.map(jnp.zeros_like, model.params)
        extra["mfvi_point_bias"] = mean_field_vi(model.apply_fn, zeros, x, y, PRIOR_PRECISION, points=_bias_leaves(zeros))
        central += (
            (
                "central_mfvi_point_bias",
                "central mean-field VI, the bias a point without a prior (exact optimum)",
                *extra["mfvi_point_bias"],
                "mfvi_point_bias",
            ),
        )
    for key, label, mean, var, family in central:
        row = _row_stats(label, mean, var, nuts, model.apply_fn, dataset.x_test, dataset.y_test, kernel_only=key == "central_mfvi_point_bias")
        if key == "central_laplace_marginals":  # its predictive keeps the correlations: the full Laplace's
            cov = laplace_covariance(negative_log_joint(model.apply_fn, x, y, PRIOR_PRECISION), refs.map)
            row["predictive"] = affine_predictive_metrics(model.apply_fn, mean, None, dataset.x_test, dataset.y_test, covariance=cov)
        if key == "central_full_vi":
            row["predictive"] = affine_predictive_metrics(model.apply_fn, mean, None, dataset.x_test, dataset.y_test, covariance=refs.full_vi[1])
        row.update(key=key, family=family, vs_family={"mean_rel_l2": 0.0, **({"var_ratio": [1.0, 1.0, 1.0]} if var is not None else {})} if family else None)
        if key == "central_mfvi_point_bias":  # how far the VBNN's objective's optimum is from the all-Gaussian one
            row["vs_mfvi"] = _compare(mean, var, *refs.mfvi, True)
        if key.startswith("central_sep_"):  # how far SEP's approximation is from EP's (the pooled data's) with the same factors
            row["vs_ep_family"] = _compare(mean, var, *(refs.diag_laplace if family == "sep_laplace" else refs.ngvi), False)
        rows.append(row)
    rule = _stopping_rule(settings)
    for method in methods:
        cache = folder / "rows" / f"{method.key}.json"
        raw = _config(problem, folder, method, dataset.num_train, settings.max_rounds, settings.client, settings)
        try:
            full = validate(raw).model_dump(mode="json")  # every default written out: a changed default reruns the row
        except Exception:  # noqa: BLE001  (the row's own run reports why it does not build)
            full = raw
        if cache.is_file():
            cached = json.loads(cache.read_text())
            if cached.get("resolved_config") == full and cached.get("rule") == rule:
                log(f"  {method.label}: cached")
                rows.append(cached)
                continue
        try:
            row = _run_method(problem, folder, method, refs, nuts, dataset, model.apply_fn, settings, log, extra)
        except Exception as exc:  # a method that cannot be built or run is a row that says why
            row = {"label": method.label, "key": method.key, "family": method.family, "error": f"{type(exc).__name__}: {exc}", "config": raw}
            log(f"  {method.label}: {row['error']}")
        row["rule"] = rule
        row["resolved_config"] = full
        cache.parent.mkdir(exist_ok=True)
        write_atomic(cache, json.dumps(row, indent=1, default=float) + "\n")
        rows.append(row)
    return {
        "problem": problem.name,
        "num_train": int(dataset.num_train),
        "num_test": int(len(dataset.y_test)),
        "num_features": int(x.reshape(len(x), -1).shape[1]),
        "client_sizes": [int(len(p)) for p in parts],
        "num_params": int(sum(np.size(leaf) for leaf in jax.tree.leaves(model.params))),
        "nuts": nuts.diagnostics,
        "rows": rows,
    }


def check_client(client: dict | None, method: Method) -> None:
    """Raises ValueError, one line naming the field, when ``client`` (the ``[client]`` settings
    for every method, ``--client``) with ``method``'s own is not a valid ``[client]`` section."""
    from pydantic import ValidationError

    from fedbayes.config.schema import ClientConfig, format_validation_error

    if client is not None and not isinstance(client, dict):
        raise ValueError(f"--client must be a JSON object of [client] settings; got {client!r}")
    try:
        ClientConfig(**{**method.client, **(client or {})})
    except ValidationError as exc:
        raise ValueError("--client: " + format_validation_error(exc, ClientConfig, "client.").removeprefix("config error: ")) from None


def run_posterior_bench(
    out: str | Path,
    settings: PosteriorBenchSettings = FULL,
    problems: Sequence[str] | None = None,
    methods: Sequence[str] | None = None,
    *,
    extra_problems: dict[str, Problem] | None = None,
    log: Callable[[str], None] = lambda s: None,
) -> dict:
    """Runs the benchmark; writes ``out/posterior_quality.json`` and ``.md``; returns the JSON.

    Raises:
        ValueError: for an unknown problem or method name (the message lists the allowed ones).
    """
    known = {**PROBLEMS, **(extra_problems or {})}
    names = list(problems or PROBLEMS)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown data set(s) {unknown}; allowed: {', '.join(known)}")
    by_key = {m.key: m for m in METHODS}
    chosen = list(methods) if methods else list(by_key)
    bad = [m for m in chosen if m not in by_key]
    if bad:
        raise ValueError(f"unknown method(s) {bad}; allowed: {', '.join(by_key)}")
    for key in chosen:
        check_client(settings.client, by_key[key])
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    result = {
        "setup": {
            "model": "logreg (2-class softmax)",
            "prior": f"N(0, {1 / PRIOR_PRECISION:g} I) on every parameter",
            "seed": 0,
            "rule": _stopping_rule(settings),
            "nuts": dataclasses.asdict(settings.nuts),
            "client": settings.client or "the defaults",
        },
        "problems": [run_problem(known[n], out, settings, [by_key[m] for m in chosen], log) for n in names],
    }
    write_atomic(out / "posterior_quality.json", json.dumps(result, indent=1, default=float) + "\n")
    write_atomic(out / "posterior_quality.md", markdown(result))
    return result


# ----- report -------------------------------------------------------------------------------------


def _num(v: float | None, digits: int = 3) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return f"{v:.{digits}g}" if abs(v) >= 1e3 or (abs(v) < 1e-3 and v != 0) else f"{v:.{digits}f}"


def _ratio(r: list | None) -> str:
    return "-" if not r else f"{r[0]:.3g} [{r[1]:.2g}, {r[2]:.2g}]"


FAMILY_NAMES = {
    "diag_laplace": "diag. Laplace",
    "laplace": "full Laplace (marginals)",
    "ngvi": "NGVI fixed point",
    "mfvi": "MFVI",
    "mfvi_point_bias": "MFVI, the bias a point",
    "sep_laplace": "SEP fixed point (Laplace)",
    "sep_ngvi": "SEP fixed point (NGVI)",
    "full_vi": "full-covariance VI (marginals)",
    "low_rank_laplace": "low-rank Laplace in its basis (marginals)",
    "kron_laplace": "Kronecker-factored Laplace in its bases (marginals)",
    "map": "MAP (mean only)",
}


def _row_md(row: dict) -> str:
    if "error" in row:
        return f"| {row['label']} | {FAMILY_NAMES.get(row.get('family'), '-')} | not run: {row['error'][:160]} |" + " - |" * 11
    fam = row.get("vs_family") or {}
    if row.get("reached_round"):
        meets = "yes"
    elif "rounds" in row:
        meets = "no"
    else:
        meets = "-"
    rounds = str(row.get("reached_round") or (f"> {row['rounds']}" if "rounds" in row else "-"))
    seconds = "-"
    if "seconds" in row:
        seconds = f"{row['seconds']:.1f} ({row['first_round_s']:.1f})"
        seconds = seconds if row.get("reached_round") else f"[{seconds}]"
    pred = row.get("predictive", {})
    cells = [
        row["label"],
        FAMILY_NAMES.get(row.get("family"), "-"),
        meets,
        rounds,
        _num(row.get("steps_per_client_round"), 1) if "steps_per_client_round" in row else "-",
        seconds,
        _num(fam.get("mean_rel_l2")),
        _ratio(fam.get("var_ratio")),
        _num(row["vs_nuts"]["mean_rel_l2"]),
        _ratio(row["vs_nuts"].get("var_ratio")),
        _num(row.get("kl_nuts_q")),
        _num(pred.get("accuracy"), 4),
        _num(pred.get("nll"), 4),
        _num(100 * pred["ece"], 2) if "ece" in pred else "-",
    ]
    return "| " + " | ".join(cells) + " |"


def markdown(result: dict) -> str:
    """The benchmark's tables, one per problem, in markdown."""
    lines = [
        "Bar: mean within "
        f"{MEAN_TOLERANCE} relative L2 of the family optimum and median variance ratio in [{VARIANCE_BAND[0]}, {VARIANCE_BAND[1]}] "
        "(MAP family: the mean only). Rounds: the first checked round that meets it (`> R`: not met in R rounds; the row then "
        "shows round R). Seconds: compute time to that round, each round blocked on its results, with the first round's (its compile, "
        "unless XLA's persistent cache held it) in brackets; in square brackets when the bar was not met.",
        "",
    ]
    header = (
        "| method | family optimum | meets bar | rounds | local steps per client and round | seconds | mean rel. L2 vs family | var ratio vs family median [min, max] "
        "| mean rel. L2 vs NUTS | var ratio vs NUTS median [min, max] | KL(NUTS-diag ‖ q) | acc | NLL | ECE % |"
    )
    for problem in result["problems"]:
        n = problem["nuts"]
        lines += [
            f"### {problem['problem']}",
            "",
            f"{problem['num_train']} training / {problem['num_test']} test examples, {problem['num_features']} features, "
            f"{problem['num_params']} parameters; client sizes {problem['client_sizes']}. NUTS: "
            f"{n['settings']['chains']} chains x ({n['settings']['warmup']} warm-up + {n['settings']['draws']} draws), "
            f"max split R-hat {_num(n['max_split_rhat'], 5)}, min ESS {n['min_ess']:.0f}, {n['divergences']} divergences.",
            "",
            header,
            "|" + "---|" * (header.count("|") - 1),
        ]
        lines += [_row_md(row) for row in problem["rows"]]
        rejected = [f"{row['label']} {row['rejected_messages']}" for row in problem["rows"] if row.get("rejected_messages")]
        if rejected:
            lines += ["", "Client messages rejected by the server's checks (over all rounds run): " + "; ".join(rejected) + "."]
        after = [_after_bar_md(row) for row in problem["rows"] if row.get("after_bar")]
        if after:
            lines += ["", "Run past the bar to the last round (`--keep-going`; the row's distances are the last round's): " + "; ".join(after) + "."]
        lines.append("")
    return "\n".join(lines)


def _after_bar_md(row: dict) -> str:
    a = row["after_bar"]
    text = f"{row['label']} at the {a['checks']} checks after round {row['reached_round']}: mean rel. L2 at most {_num(a['max_mean_rel_l2'])}"
    if "var_ratio_range" in a:
        text += f", median variance ratio {_num(a['var_ratio_range'][0])}-{_num(a['var_ratio_range'][1])}"
    if a["share_meeting_bar"] is not None:
        text += f", {100 * a['share_meeting_bar']:.0f}% of them meeting the bar"
    return text
