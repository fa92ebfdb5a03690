"""Personalisation: each client's own model, scored on its own held-out examples.

A client's personalised model comes from what its method leaves it (docs/algorithms.md §13.8):

* a method whose clients keep a Gaussian site ``t_k`` (FedEP, PVI, FedLap-Cov) gives client ``k``
  the posterior ``q_k ∝ q_g t_k^w`` (``Algorithm.personal_posterior``,
  :func:`fedbayes.algorithms.sites.personalised`);
* every other method: :func:`fine_tune`, a few epochs of the client's own optimizer on its own
  training examples from the global model (FedAvg with local fine-tuning, the standard baseline).

Both are scored against the global model on the client's own test examples
(:func:`client_scores`), and the scores are summarised over clients by their mean and by the mean
of the worst 10% of clients (:func:`over_clients`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fedbayes.data.batches import ClientData, size_class
from fedbayes.evaluation.metrics import accuracy, ece, nll
from fedbayes.inference.sgd import LocalTrainer, run_sgd

__all__ = ["HIGHER_IS_BETTER", "WORST_FRACTION", "client_scores", "fine_tune", "fine_tune_order", "make_fine_tune", "over_clients"]

WORST_FRACTION = 0.1  # the worst clients' share in over_clients
HIGHER_IS_BETTER = {"accuracy": True, "nll": False, "ece": False}
_TINY = 1e-30  # a probability that underflowed to 0 scores -log(1e-30) = 69, not inf


def fine_tune_order(positions: np.ndarray, num_epochs: int, batch_size: int, rng: np.random.Generator) -> np.ndarray:
    """The order buffer of one client's fine-tuning (:mod:`fedbayes.data.batches`): ``num_epochs``
    permutations of its ``positions`` from ``rng``, one after the other, padded with zeros to a
    size class (at least one batch of tail, so that few shapes compile)."""
    positions = np.asarray(positions)
    used = num_epochs * len(positions)
    order = np.zeros(size_class(used + batch_size), dtype=np.int32)
    if used:
        order[:used] = np.concatenate([rng.permutation(positions) for _ in range(num_epochs)])
    return order


def make_fine_tune(trainer: LocalTrainer):
    """``fine_tune(key, params, x, y, order, num_examples) -> params``, jitted: :func:`fedbayes.inference.sgd.run_sgd`
    from ``params`` over the client's laid-out epochs (``trainer.num_epochs`` of them, a fixed
    budget: ``trainer.tol`` must be 0)."""
    if trainer.tol != 0:
        raise ValueError(f"fine-tuning runs a fixed number of epochs; got a trainer with tol={trainer.tol}")

    @jax.jit
    def fine_tune(key, params, x, y, order, num_examples):
        data = ClientData(x, y, order, jnp.zeros((), jnp.int32), jnp.asarray(num_examples, jnp.int32))
        return run_sgd(key, params, data, trainer)[0]

    return fine_tune


def fine_tune(key: jax.Array, params: Any, x: Any, y: Any, positions: np.ndarray, trainer: LocalTrainer, rng: np.random.Generator) -> Any:
    """The global model ``params`` after ``trainer.num_epochs`` epochs of ``trainer``'s optimizer
    (started afresh) on the client's training examples ``positions`` of ``(x, y)``, shuffled by
    ``rng``; step ``s`` passes ``fold_in(key, s)`` to the loss. The loss is the client's training
    loss with nothing added: the global model is only the start (FedAvg + fine-tuning)."""
    order = fine_tune_order(positions, trainer.num_epochs, trainer.batch_size, rng)
    return make_fine_tune(trainer)(key, params, x, y, jnp.asarray(order), len(positions))


def client_scores(probs: np.ndarray, labels: np.ndarray, num_bins: int = 15) -> dict[str, float]:
    """Accuracy, NLL (natural log; a probability of 0 counts as 1e-30) and ECE (``num_bins``
    equal-width bins) of ``probs [n, C]`` on ``labels``: :mod:`fedbayes.evaluation.metrics`'s."""
    labels = jnp.asarray(labels)
    if labels.shape[0] == 0:
        raise ValueError("no examples to score")
    probs = jnp.asarray(probs, jnp.float32)
    return {
        "accuracy": float(accuracy(probs, labels)),
        "nll": float(nll(probs, labels, eps=_TINY)),
        "ece": float(ece(probs, labels, num_bins=num_bins)),
    }


def over_clients(values: Sequence[float], higher_is_better: bool, worst_fraction: float = WORST_FRACTION) -> dict[str, float]:
    """A score summarised over clients: the unweighted ``mean`` (every client counts once, whatever
    its size) and ``worst10``, the mean over the worst ``ceil(worst_fraction K)`` of the ``K``
    clients (the lowest accuracies, the highest NLLs and ECEs; at least one client)."""
    v = np.asarray(values, dtype=np.float64)
    if v.size == 0:
        raise ValueError("no clients to summarise")
    count = max(1, math.ceil(worst_fraction * v.size - 1e-9))
    ordered = np.sort(v) if higher_is_better else np.sort(v)[::-1]
    return {"mean": float(v.mean()), "worst10": float(ordered[:count].mean())}
