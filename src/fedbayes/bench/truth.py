"""Ground truth for ``fedbayes bench posterior``: NUTS on the pooled data, cached on disk.

The posterior of a model with a softmax likelihood and the prior ``N(0, I / lambda)`` on every
parameter, ``p(theta | D) ∝ exp(-L(theta))`` with ``L`` from
:func:`fedbayes.evaluation.reference.negative_log_joint` (the same code that defines the
centralised references), sampled by NumPyro's No-U-Turn sampler (Hoffman and Gelman 2014, "The
No-U-Turn Sampler") in float64, target acceptance 0.9, with a **dense metric**: NUTS runs on
``z = L^T (theta - theta*)``, where ``L L^T = H`` is the Cholesky factor of the Hessian of ``L`` at
the MAP ``theta*`` (a fixed dense mass matrix ``H``, the full Laplace approximation's precision),
and a diagonal mass matrix is adapted on top of it in warm-up. NumPyro's own ``dense_mass=True`` is
not used: with NumPyro 0.22 and JAX 0.10.2 its transitions never meet the U-turn criterion, so
every one runs to the maximum tree depth (docs/results/posterior_quality.md, "Ground truth"). The chains start at ``z ~ N(0, 4 I)``
(the MAP plus two Laplace standard deviations).
Reported: the per-coordinate mean and variance of all draws ("NUTS-diag"), the largest split
R-hat and the smallest effective sample size over the coordinates (``numpyro.diagnostics``), the
number of divergent transitions, and the exact predictive of the draws on a test set (the mean
of the predictive probabilities over every draw).

NumPyro is an optional dependency (``pip install -e '.[truth]' (from the fedbayes clone)``); it is imported only here.
The result is cached as ``nuts.npz`` (moments) and ``nuts.json`` (diagnostics, settings and a
fingerprint of the data and settings) in a folder; a call with the same fingerprint reads it back.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from fedbayes.evaluation.metrics import classification_metrics
from fedbayes.evaluation.reference import affine_logit_difference, map_estimate, negative_log_joint
from fedbayes.runs.folder import write_atomic

__all__ = ["NUTSSettings", "NUTSResult", "fingerprint", "nuts_reference"]


@dataclasses.dataclass(frozen=True)
class NUTSSettings:
    """How NUTS samples: chains, warm-up and kept draws per chain, target acceptance, seed."""

    chains: int = 4
    warmup: int = 1500
    draws: int = 3000
    target_accept: float = 0.9
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class NUTSResult:
    """NUTS moments (float64 pytrees shaped like the parameters) and diagnostics."""

    mean: Any
    variance: Any
    diagnostics: dict[str, Any]


def fingerprint(arrays, prior_precision: float, settings, params0, *extra) -> str:
    """A hash of a ground truth's inputs: the ``arrays`` (dtype, shape and bytes, in order), the
    prior, the sampler's ``settings`` (a dataclass), the parameters' shapes and any ``extra``
    JSON-able items; a cache is reused only under the same hash."""
    h = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(str((a.dtype, a.shape)).encode())
        h.update(a.tobytes())
    shapes = [(str(p), tuple(np.shape(leaf))) for p, leaf in jax.tree_util.tree_leaves_with_path(params0)]
    h.update(json.dumps([repr(prior_precision), dataclasses.asdict(settings), repr(shapes), *extra], sort_keys=True).encode())
    return h.hexdigest()


def _read_cache(folder: Path, fingerprint: str, unravel) -> NUTSResult | None:
    meta_path, arrays_path = folder / "nuts.json", folder / "nuts.npz"
    if not (meta_path.is_file() and arrays_path.is_file()):
        return None
    try:
        meta = json.loads(meta_path.read_text())
        if meta.get("fingerprint") != fingerprint:
            return None
        with np.load(arrays_path) as z:
            mean, var = z["mean"], z["variance"]
    except (OSError, ValueError, KeyError):
        return None
    with jax.enable_x64(True):
        return NUTSResult(_np_tree(unravel(jnp.asarray(mean))), _np_tree(unravel(jnp.asarray(var))), meta["diagnostics"])


def _np_tree(tree):
    return jax.tree.map(lambda a: np.asarray(a, np.float64), tree)


def nuts_reference(
    apply_fn: Callable[[Any, jax.Array], jax.Array],
    params0: Any,
    x: Any,
    y: Any,
    prior_precision: float,
    *,
    x_test: Any,
    y_test: Any,
    settings: NUTSSettings = NUTSSettings(),
    cache_dir: str | Path | None = None,
    log: Callable[[str], None] = lambda s: None,
) -> NUTSResult:
    """NUTS on ``p(theta | x, y)`` with the prior ``N(0, I / prior_precision)``; cached in ``cache_dir``.

    The test predictive (``diagnostics["predictive"]``: accuracy, NLL, ECE) needs a model whose
    logit difference is affine in the parameters with 2 classes (logistic regression).

    Raises:
        ImportError: NumPyro is not installed (the message names the extra).
    """
    flat0, unravel = ravel_pytree(params0)
    key = fingerprint((x, y, x_test, y_test), prior_precision, settings, params0)
    folder = Path(cache_dir) if cache_dir is not None else None
    if folder is not None:
        cached = _read_cache(folder, key, unravel)
        if cached is not None:
            log(f"NUTS: cached in {folder}")
            return cached
    try:
        from numpyro.diagnostics import effective_sample_size, split_gelman_rubin
        from numpyro.infer import MCMC, NUTS
    except ImportError as err:
        raise ImportError("fedbayes bench posterior needs NumPyro for its NUTS ground truth: pip install -e '.[truth]' (from the fedbayes clone)") from err

    loss = negative_log_joint(apply_fn, x, y, prior_precision)
    theta = map_estimate(loss, params0)
    affine = affine_logit_difference(apply_fn, params0, x_test)
    start = time.perf_counter()
    with jax.enable_x64(True):
        flat_map, unravel64 = ravel_pytree(jax.tree.map(lambda a: jnp.asarray(np.asarray(a, np.float64)), theta))
        hessian = np.asarray(jax.jit(jax.hessian(lambda z: loss(unravel64(z))))(flat_map))
        inv_chol_t = jnp.asarray(np.linalg.inv(np.linalg.cholesky(0.5 * (hessian + hessian.T))).T)  # L^-T

        def to_theta(z):
            return flat_map + inv_chol_t @ z

        rng = np.random.default_rng(settings.seed)
        init = jnp.asarray(2.0 * rng.normal(size=(settings.chains, flat_map.shape[0])))
        kernel = NUTS(potential_fn=lambda z: loss(unravel64(to_theta(z))), dense_mass=False, target_accept_prob=settings.target_accept)
        mcmc = MCMC(
            kernel,
            num_warmup=settings.warmup,
            num_samples=settings.draws,
            num_chains=settings.chains,
            chain_method="vectorized",
            progress_bar=False,
        )
        mcmc.run(jax.random.key(settings.seed), init_params=init, extra_fields=("diverging",))
        whitened = np.asarray(mcmc.get_samples(group_by_chain=True), np.float64)  # [chains, draws, P]
        samples = np.asarray(flat_map)[None, None, :] + whitened @ np.asarray(inv_chol_t).T
        divergences = int(np.sum(np.asarray(mcmc.get_extra_fields(group_by_chain=True)["diverging"])))
        seconds = time.perf_counter() - start
        flat = samples.reshape(-1, samples.shape[-1])
        mean, var = flat.mean(axis=0), flat.var(axis=0, ddof=1)
        rhat = np.asarray(split_gelman_rubin(samples)) if settings.chains > 1 else np.full(flat.shape[1], np.nan)
        ess = np.asarray(effective_sample_size(samples))
        # the predictive of the draws: p(y = 1 | x) = mean over draws of sigmoid(a^T theta + c)
        logit = flat @ affine.a.T + affine.c[None, :]  # [draws, n_test]
        log_p1 = jax.scipy.special.logsumexp(jax.nn.log_sigmoid(jnp.asarray(logit)), axis=0) - np.log(logit.shape[0])
        log_p0 = jax.scipy.special.logsumexp(jax.nn.log_sigmoid(-jnp.asarray(logit)), axis=0) - np.log(logit.shape[0])
        metrics = classification_metrics(jnp.stack([log_p0, log_p1], axis=-1), jnp.asarray(np.asarray(y_test, np.int64)))
        predictive = {k: float(metrics[k]) for k in ("accuracy", "nll", "ece")}
        mean_tree, var_tree = _np_tree(unravel64(jnp.asarray(mean))), _np_tree(unravel64(jnp.asarray(var)))
    diagnostics = {
        "max_split_rhat": float(np.nanmax(rhat)) if np.any(np.isfinite(rhat)) else None,
        "min_ess": float(np.min(ess)),
        "divergences": divergences,
        "seconds": round(seconds, 1),
        "num_draws": int(flat.shape[0]),
        "settings": dataclasses.asdict(settings)
        | {"chain_method": "vectorized", "x64": True, "metric": "Laplace Hessian (dense, fixed) + adapted diagonal", "init": "MAP + 2 Laplace sd"},
        "predictive": predictive,
    }
    log(
        f"NUTS: {settings.chains} chains x ({settings.warmup} + {settings.draws}), max R-hat {diagnostics['max_split_rhat']}, min ESS {diagnostics['min_ess']:.0f}, {divergences} divergences, {seconds:.0f} s"
    )
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
        write_atomic(folder / "nuts.npz", lambda f: np.savez(f, mean=mean, variance=var))
        write_atomic(folder / "nuts.json", json.dumps({"fingerprint": key, "diagnostics": diagnostics}, indent=2) + "\n")
    return NUTSResult(mean_tree, var_tree, diagnostics)
