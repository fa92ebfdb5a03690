"""The trained model of a run folder: ``model.npz`` and :func:`load_run`.

``model.npz`` is a plain NumPy archive (``numpy.load`` reads it; fedbayes is not needed). Keys are
the parameters' tree paths joined by ``/`` under a prefix:

* ``params/<path>``: the server's point estimate (what the metrics evaluate), e.g.
  ``params/Dense_0/kernel``;
* ``posterior_mean/<path>`` and ``posterior_variance/<path>``: the diagonal Gaussian posterior
  ``q_g`` of the Bayesian methods (FedEP, FedSEP, PVI), absent for the others (a dense ``q_g``:
  its mean and marginal variances);
* ``posterior_precision``: a dense ``q_g``'s ``[D, D]`` precision over the parameters raveled in
  :func:`jax.flatten_util.ravel_pytree` order (FedEP, FedSEP, PVI and FedLap-Cov with ``covariance = "full"``),
  absent otherwise;
* ``posterior_precision_last_layer``: a last-layer ``q_g``'s (``covariance = "last_layer"``) dense
  ``[B, B]`` precision over its last layer (:func:`fedbayes.gaussian_block.last_layer_key`), raveled
  as that layer's subtree; the other weights' precisions are ``1 / posterior_variance``;
* ``posterior_precision_diag/<path>``, ``posterior_precision_factors`` and
  ``posterior_precision_weights``: a low-rank ``q_g``'s (``covariance = "low_rank"``) precision
  ``diag(d) + U diag(s) U^T``: ``d`` shaped like the parameters, ``U`` ``[D, r]`` over them raveled
  in :func:`jax.flatten_util.ravel_pytree` order, ``s`` ``[r]``;
* ``posterior_precision_eigenvalues/<path>``, ``posterior_precision_left/<path>`` and
  ``posterior_precision_right/<path>``: a Kronecker-factored ``q_g``'s (``covariance = "kron"``)
  precision ``U diag(s) U^T``: per leaf the eigenvalues ``s`` (the leaf's shape) and the two
  orthonormal bases ``L`` and ``R`` of ``U = L kron R`` over the leaf read as ``[m, n]`` (a side
  absent where it is the identity, e.g. a bias's left; :mod:`fedbayes.gaussian_kron`).

``load_run(DIR)`` returns ``(config, params, metrics)``: the run's :class:`~fedbayes.config.schema.RunConfig`
(its ``[algorithm]`` table as stored), the parameters as the nested dict the model's ``apply`` takes,
and the ``metrics.jsonl`` records.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np

from fedbayes import gaussian_block
from fedbayes.gaussian_block import BlockPrecision
from fedbayes.gaussian_kron import KronBasis, KronSpread
from fedbayes.gaussian_lowrank import LowRankGaussian
from fedbayes.runs import folder
from fedbayes.tree import to_named_arrays

MODEL_FILE = folder.MODEL
LAST_LAYER_PRECISION = "posterior_precision_last_layer"
LOW_RANK_DIAG, LOW_RANK_FACTORS, LOW_RANK_WEIGHTS = "posterior_precision_diag", "posterior_precision_factors", "posterior_precision_weights"
KRON_EIGENVALUES, KRON_LEFT, KRON_RIGHT = "posterior_precision_eigenvalues", "posterior_precision_left", "posterior_precision_right"
PREFIXES = ("params", "posterior_mean", "posterior_variance")


def flatten(tree: Any, prefix: str) -> dict[str, np.ndarray]:
    """``{prefix/<tree path>: array}`` for every leaf of ``tree`` (:func:`fedbayes.tree.to_named_arrays`)."""
    return to_named_arrays(tree, prefix)


def unflatten(arrays: dict[str, np.ndarray], prefix: str) -> dict:
    """The nested dict of the keys under ``prefix/`` (the inverse of :func:`flatten` for dicts)."""
    out: dict = {}
    for key, value in arrays.items():
        if not key.startswith(prefix + "/"):
            continue
        node = out
        parts = key[len(prefix) + 1 :].split("/")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return out


def save_model(path: str | Path, algorithm, server_state) -> Path:
    """Writes ``model.npz`` (atomically) from an algorithm's server state."""
    arrays = flatten(algorithm.server_params(server_state), "params")
    if algorithm.server_posterior is not None:
        mean, variance = algorithm.server_posterior(server_state)
        arrays.update(flatten(mean, "posterior_mean"))
        arrays.update(flatten(variance, "posterior_variance"))
    if getattr(algorithm, "server_precision", None) is not None:
        precision = algorithm.server_precision(server_state)
        if isinstance(precision, BlockPrecision):
            arrays[LAST_LAYER_PRECISION] = np.asarray(precision.dense)
        elif isinstance(precision, KronSpread):
            arrays.update(flatten(precision.precision, KRON_EIGENVALUES))
            for name, basis in flatten_bases(precision.precision, precision.bases).items():
                if basis.left is not None:
                    arrays[f"{KRON_LEFT}/{name}"] = np.asarray(basis.left)
                if basis.right is not None:
                    arrays[f"{KRON_RIGHT}/{name}"] = np.asarray(basis.right)
        elif isinstance(precision, LowRankGaussian):
            arrays.update(flatten(precision.diag, LOW_RANK_DIAG))
            arrays[LOW_RANK_FACTORS] = np.asarray(precision.factors)
            arrays[LOW_RANK_WEIGHTS] = np.asarray(precision.weights)
        else:
            arrays["posterior_precision"] = np.asarray(precision)
    return folder.write_atomic(path, lambda f: np.savez(f, **arrays))


def load_model(path: str | Path) -> dict[str, dict]:
    """``{"params": ..., "posterior_mean": ..., "posterior_variance": ..., "posterior_precision": ...}``
    (the posterior's when present; ``posterior_precision`` the dense ``[D, D]`` array, a
    last-layer posterior's :class:`~fedbayes.gaussian_block.BlockPrecision`, or a low-rank one's
    :class:`~fedbayes.gaussian_lowrank.LowRankGaussian` with a zero mean)."""
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    out = {p: unflatten(arrays, p) for p in PREFIXES if any(k.startswith(p + "/") for k in arrays)}
    if "posterior_precision" in arrays:
        out["posterior_precision"] = arrays["posterior_precision"]
    if LOW_RANK_FACTORS in arrays and LOW_RANK_WEIGHTS in arrays:
        diag = unflatten(arrays, LOW_RANK_DIAG)
        out["posterior_precision"] = LowRankGaussian(_zeros(diag), diag, arrays[LOW_RANK_FACTORS], arrays[LOW_RANK_WEIGHTS])
    if any(k.startswith(KRON_EIGENVALUES + "/") for k in arrays):
        eigenvalues = unflatten(arrays, KRON_EIGENVALUES)
        names = flatten(eigenvalues, "")
        bases = [KronBasis(arrays.get(f"{KRON_LEFT}/{n}"), arrays.get(f"{KRON_RIGHT}/{n}")) for n in names]
        treedef = jax.tree.structure(eigenvalues)
        out["posterior_precision"] = KronSpread(eigenvalues, jax.tree.unflatten(treedef, bases))
    if LAST_LAYER_PRECISION in arrays and "posterior_variance" in out:
        variance = out["posterior_variance"]
        rest, _ = gaussian_block.split(variance)
        out["posterior_precision"] = BlockPrecision(
            {k: _reciprocal(v) for k, v in rest.items()}, arrays[LAST_LAYER_PRECISION], gaussian_block.last_layer_key(variance)
        )
    return out


def flatten_bases(like: Any, bases: Any) -> dict[str, KronBasis]:
    """``{<tree path>: KronBasis}`` for each leaf of ``like`` (the names of :func:`flatten`)."""
    names = list(flatten(like, ""))
    return dict(zip(names, jax.tree.leaves(bases, is_leaf=lambda x: isinstance(x, KronBasis)), strict=True))


def _zeros(tree):
    if isinstance(tree, dict):
        return {k: _zeros(v) for k, v in tree.items()}
    return np.zeros_like(np.asarray(tree))


def _reciprocal(tree):
    if isinstance(tree, dict):
        return {k: _reciprocal(v) for k, v in tree.items()}
    return 1.0 / np.asarray(tree)


def load_run(run_dir: str | Path):
    """``(config, params, metrics)`` of a finished run folder.

    Reads files only: it loads neither the simulator nor the run loop, nor any method's module.
    ``config.algorithm`` is the stored ``[algorithm]`` table (a
    :class:`~fedbayes.config.schema.StoredAlgorithm`: its ``name`` and each stored setting as an
    attribute), not validated against the method's settings;
    ``fedbayes.config.schema.read_stored(DIR / "config.toml")`` reads the config with them validated
    (importing the method's module).

    Example::

        config, params, metrics = fedbayes.load_run("runs/digits_fedprox")
        model = fedbayes.models.make_model(config.model.name, 10)
        logits = model.apply({"params": params}, x)

    Raises:
      FileNotFoundError: the folder holds no ``config.toml`` or no ``model.npz`` (an unfinished run).
    """
    from fedbayes.config.schema import read_stored

    run_dir = Path(run_dir)
    for name in (folder.CONFIG, folder.MODEL):
        if not (run_dir / name).is_file():
            raise FileNotFoundError(f"{run_dir} holds no {name}; is it a finished fedbayes run folder?")
    config = read_stored(run_dir / folder.CONFIG, method=False)  # as the run meant it (an older run's unset keys); no method imported
    params = load_model(run_dir / folder.MODEL)["params"]
    return config, params, folder.read_metrics(run_dir / folder.METRICS)
