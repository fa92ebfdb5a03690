"""A finished run's personalised models (``evaluation.personal_fraction``): ``personal.json``.

Each client keeps ``evaluation.personal_fraction`` of its examples as its own test set
(:func:`fedbayes.runs.build.personal_split`; never trained on). After the last round every client
with such examples gets its personalised model (:mod:`fedbayes.evaluation.personal`): by default
(``evaluation.personal_by = "fine_tune"``) the global model fine-tuned for
``evaluation.personal_epochs`` epochs of the client optimizer on the client's training examples;
with ``personal_by = "site"``, for a method whose clients keep a Gaussian site, the posterior
``q_k ∝ q_g t_k^w`` read from the client store (``w = evaluation.personal_weight``).
Both the global and the personalised model are scored on the client's own test examples; a method
with a posterior is scored by its point predictive (the mean) and by its marginalised predictive
(``evaluation.predictive`` with ``evaluation.marginal_samples`` draws of the same key for the global
and the personalised posterior, restricted to ``evaluation.subset_of_weights``, at the method's own
prior precision: ``evaluation.prior_precision``'s search is not rerun per client).

``summary.json``'s ``final`` gets the means over clients and the worst 10% of clients
(:func:`summary_fields`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fedbayes import protocol
from fedbayes.data.batches import size_class
from fedbayes.evaluation import personal as pe
from fedbayes.evaluation.evaluators import make_marginal_probabilities, make_probabilities, restrict_to_subset
from fedbayes.sim.store import as_store

__all__ = ["NAMES", "SITE", "FINE_TUNE", "build_personalisation", "summary_fields"]

SITE = "site"  # q_k ∝ q_g t_k^w from the client's stored site
FINE_TUNE = "fine_tune"  # the global model fine-tuned on the client's training examples
SOURCES = {
    SITE: "q_k ∝ q_g t_k^w, the global posterior times the client's own site (pFedBayes's client posterior with the site for the likelihood)",
    FINE_TUNE: "the global model after personal_epochs epochs of the client optimizer on the client's own training examples",
}
NAMES = {"": "point", "_marg": "marginal"}  # a predictive's suffix -> its name in personal.json
_FINE_TUNE_TAG, _MARGINAL_TAG = 0x70657273, 0x6D617267  # folded into the evaluation key of the last round


def _padded(x: np.ndarray) -> np.ndarray:
    """``x`` padded with zero rows to a size class, so that clients of similar size share one compile."""
    n = len(x)
    return np.concatenate([x, np.zeros((size_class(n, 64) - n, *x.shape[1:]), x.dtype)])


def build_personalisation(config, algorithm, model, dataset, federation, personal: Sequence[np.ndarray]) -> Callable[[Any, Any, int], dict]:
    """``(server state, client states, round) -> personal.json's body``.

    Args:
      config: the run's config.
      algorithm: its :class:`~fedbayes.algorithms.base.Algorithm`.
      model: :class:`~fedbayes.runs.build.ModelParts` (apply function and client trainer).
      dataset: the run's dataset (test labels: the true ones).
      federation: the clients' training examples as trained (fine-tuning reads them).
      personal: each client's own test examples, indices into the training set.
    """
    e = config.evaluation
    site = algorithm.personal_posterior is not None and e.personal_by == "site"
    point = make_probabilities(model.apply_fn, batch_size=config.eval_batch_size)
    marginal = None
    if algorithm.server_posterior is not None:
        marginal = make_marginal_probabilities(model.apply_fn, num_samples=e.marginal_samples, batch_size=config.eval_batch_size, predictive=e.predictive)
    tune = None if site else pe.make_fine_tune(model.trainer._replace(num_epochs=e.personal_epochs, tol=0.0, max_steps=0))

    def body(server_state, client_states, round_idx: int) -> dict:
        clients = [k for k, held in enumerate(personal) if len(held)]
        key = protocol.evaluation_key(config.seed, round_idx)
        params = algorithm.server_params(server_state)
        posterior = None
        if marginal is not None:
            mean, variance = algorithm.server_posterior(server_state)
            posterior = (mean, restrict_to_subset(variance, e.subset_of_weights))
        store = as_store(client_states) if site else None
        x_dev, y_dev = (jnp.asarray(federation.x), jnp.asarray(federation.y)) if tune is not None else (None, None)
        scores: dict[str, dict[str, list[dict]]] = {s: {"global": [], "personal": []} for s in (("", "_marg") if posterior is not None else ("",))}
        for k in clients:
            x = _padded(dataset.x_train[personal[k]])
            n, y = len(personal[k]), dataset.y_train[personal[k]]

            def score(probs, _n=n, _y=y):
                return pe.client_scores(probs[:_n], _y, config.ece_bins)

            scores[""]["global"].append(score(point(params, x)))
            if site:
                state_k = jax.tree.map(lambda a: a[0], store.gather(np.array([k]), round_idx))
                mean_k, variance_k = algorithm.personal_posterior(server_state, state_k, e.personal_weight)
                scores[""]["personal"].append(score(point(mean_k, x)))
            else:
                start = jax.random.fold_in(jax.random.fold_in(key, _FINE_TUNE_TAG), k)
                order = pe.fine_tune_order(federation.client_indices[k], e.personal_epochs, model.trainer.batch_size, protocol.fine_tune_rng(config.seed, k))
                tuned = tune(start, params, x_dev, y_dev, jnp.asarray(order), len(federation.client_indices[k]))
                scores[""]["personal"].append(score(point(tuned, x)))
            if posterior is not None:
                draws = jax.random.fold_in(jax.random.fold_in(key, _MARGINAL_TAG), k)  # the same draws for both: a paired comparison
                scores["_marg"]["global"].append(score(marginal(draws, *posterior, x)))
                if site:
                    scores["_marg"]["personal"].append(score(marginal(draws, mean_k, restrict_to_subset(variance_k, e.subset_of_weights), x)))
                else:  # the fine-tuned model is a point: its marginalised predictive is itself
                    scores["_marg"]["personal"].append(scores[""]["personal"][-1])
        out: dict[str, Any] = {
            "source": SOURCES[SITE if site else FINE_TUNE],
            "personalisation": SITE if site else FINE_TUNE,
            "round": round_idx,
            "fraction": e.personal_fraction,
            "clients": clients,
            "test_per_client": [len(personal[k]) for k in clients],
            "worst_fraction": pe.WORST_FRACTION,
            "note": "mean: every client counts once; worst10: the mean over the worst ceil(0.1 K) clients (lowest accuracy, highest NLL and ECE)",
            "predictives": {},
        }
        out["weight" if site else "epochs"] = e.personal_weight if site else e.personal_epochs
        for suffix, record in scores.items():
            entry: dict[str, Any] = {}
            for which, per_client in record.items():
                entry[which] = {m: pe.over_clients([c[m] for c in per_client], better) for m, better in pe.HIGHER_IS_BETTER.items()}
            entry["per_client"] = {which: per_client for which, per_client in record.items()}
            out["predictives"][NAMES[suffix]] = entry
        return out

    return body


def summary_fields(body: dict) -> dict[str, float]:
    """The numbers ``summary.json``'s ``final`` gets (and so the comparison tables): for each
    predictive (``_marg`` for the marginalised) the global model's and the personalised model's
    accuracy, NLL and ECE on the clients' own test examples, mean over clients (``client_*``,
    ``personal_*``) and the worst 10% of clients' accuracy (``*_accuracy_worst10``)."""
    out = {}
    for suffix, name in NAMES.items():
        record = body["predictives"].get(name)
        if record is None:
            continue
        for prefix, which in (("client", "global"), ("personal", "personal")):
            for metric in pe.HIGHER_IS_BETTER:
                out[f"{prefix}_{metric}{suffix}"] = record[which][metric]["mean"]
            out[f"{prefix}_accuracy_worst10{suffix}"] = record[which]["accuracy"]["worst10"]
    return out
