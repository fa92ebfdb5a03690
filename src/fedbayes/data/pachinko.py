"""The two-level Pachinko (LDA) partition of CIFAR-100 (Reddi et al. 2021, "Adaptive Federated
Optimization", App. C.1; TFF's ``fed_cifar100``; docs/algorithms.md §14.3), for users who have
CIFAR-100's Python batches but not TFF's file.

Each client ``i`` draws a distribution over the coarse labels ``theta_i ~ Dir(alpha 1_20)``
(``alpha`` = 0.1) and, for each coarse label ``c``, one over its fine labels
``phi_ic ~ Dir(beta 1_5)`` (``beta`` = 10). Each of its examples draws a coarse label from
``theta_i``, a fine label from ``phi_ic``, and takes a random unused example of that fine label
(without replacement). A fine label with no examples left is removed from every distribution
(the rest renormalised), and a coarse label with none of its fine labels left likewise. Clients
are filled one after the other; every client gets ``examples_per_client`` examples.
"""

from __future__ import annotations

import numpy as np

from fedbayes.data.partition import PartitionError

__all__ = ["pachinko"]


def _draw(rng: np.random.Generator, weights: np.ndarray, alive: np.ndarray) -> int:
    """One index drawn from ``weights`` restricted to ``alive`` and renormalised."""
    w = np.where(alive, weights, 0.0)
    if w.sum() <= 0:  # the live entries' mass underflowed to 0: uniform over them
        w = alive.astype(np.float64)
    return int(rng.choice(len(w), p=w / w.sum()))


def pachinko(
    fine: np.ndarray,
    coarse: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    *,
    examples_per_client: int | None = None,
    alpha: float = 0.1,
    beta: float = 10.0,
) -> list[np.ndarray]:
    """Indices of each client's examples, ``num_clients`` arrays of ``examples_per_client``.

    Args:
      fine, coarse: ``[N]`` fine and coarse labels; each fine label belongs to one coarse label.
      num_clients: clients to fill.
      rng: the generator (seeded by the caller).
      examples_per_client: default ``N // num_clients``.
      alpha, beta: the coarse and fine Dirichlet concentrations (0.1 and 10).

    Raises:
      PartitionError: the clients need more examples than there are, or a fine label appears
        under two coarse labels.
    """
    fine, coarse = np.asarray(fine), np.asarray(coarse)
    n = len(fine)
    per = n // num_clients if examples_per_client is None else examples_per_client
    if per < 1 or per * num_clients > n:
        raise PartitionError(f"{num_clients} clients of {per} examples need {per * num_clients} examples; the data has {n}")
    coarse_ids = np.unique(coarse)
    children = [np.unique(fine[coarse == c]) for c in coarse_ids]
    if sum(len(ch) for ch in children) != len(np.unique(fine)):
        raise PartitionError("each fine label must belong to exactly one coarse label")
    width = max(len(ch) for ch in children)
    sentinel = int(fine.max()) + 1  # pads the shorter rows: never has examples left
    kids = np.stack([np.pad(ch, (0, width - len(ch)), constant_values=sentinel) for ch in children])  # [coarse, fine]
    pools = {int(f): list(rng.permutation(np.flatnonzero(fine == f))) for f in np.unique(fine)}
    left = np.zeros(sentinel + 1, np.int64)
    for f, pool in pools.items():
        left[f] = len(pool)
    parts = []
    for _ in range(num_clients):
        theta = rng.dirichlet(np.full(len(kids), alpha))
        phis = np.stack([np.pad(rng.dirichlet(np.full(len(ch), beta)), (0, width - len(ch))) for ch in children])
        mine = []
        for _ in range(per):
            alive = left[kids] > 0
            c = _draw(rng, theta, alive.any(axis=1))
            f = int(kids[c, _draw(rng, phis[c], alive[c])])
            mine.append(pools[f].pop())
            left[f] -= 1
        parts.append(np.sort(np.asarray(mine, np.int64)))
    return parts
