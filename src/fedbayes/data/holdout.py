"""A validation split held out from the clients' training data (``data.validation_fraction``).

Hyperparameters chosen on the test set overstate how well they do on new data; ``fedbayes sweep``
therefore selects on a validation split by default. The split is taken **from each client's
training examples after partitioning**, not from the pooled training set before it:

* the partition (client sizes, label skew) is the one a run without a validation split gets, so
  the federation the hyperparameters are tuned on is the federation they are reported on; held
  out before partitioning, every partitioner would see a different number of examples and draw
  a different split;
* every client gives up the same fraction of its data, so the validation set follows the pooled
  training distribution (the mixture of the clients' data, weighted by their sizes), stratified by
  client, with natural (LEAF) partitions handled like computed ones;
* it is what a deployment can do: each client keeps some of its own data aside; no pool exists.

Client ``k`` holds out ``floor(f * n_k + 1/2)`` of its ``n_k`` examples, always keeping at least
one for training, drawn with :func:`fedbayes.protocol.validation_rng` ``(seed, k)``: the split of a
client depends on the seed and on that client's examples only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np


def held_out_count(num_examples: int, fraction: float) -> int:
    """How many of a client's ``num_examples`` are held out: ``floor(f n + 1/2)``, keeping one."""
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"fraction must be in [0, 1), got {fraction}")
    return int(min(np.floor(fraction * num_examples + 0.5), max(num_examples - 1, 0)))


def hold_out(parts: Sequence[np.ndarray], fraction: float, client_rng: Callable[[int], np.random.Generator]) -> tuple[list[np.ndarray], np.ndarray]:
    """Splits each client's examples into training and validation examples.

    Args:
      parts: client ``k``'s indices into the training set, for every ``k``.
      fraction: the fraction of each client's examples to hold out, in ``[0, 1)``.
      client_rng: ``k -> generator`` (:func:`fedbayes.protocol.validation_rng` with the run's seed).

    Returns:
      ``(train_parts, validation)``: each client's remaining indices, in their original order, and
      the sorted union of the held-out ones (disjoint from every training part).
    """
    train, held = hold_out_per_client(parts, fraction, client_rng)
    held = [h for h in held if len(h)]
    validation = np.sort(np.concatenate(held)) if held else np.zeros(0, dtype=np.int64)
    return train, validation


def hold_out_per_client(
    parts: Sequence[np.ndarray], fraction: float, client_rng: Callable[[int], np.random.Generator]
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """:func:`hold_out`, the held-out indices kept by client: ``(train_parts, held_parts)``, both
    in each client's original order (a client that holds out none has an empty part)."""
    train, held = [], []
    for k, part in enumerate(parts):
        part = np.asarray(part)
        count = held_out_count(len(part), fraction)
        if count == 0:
            train.append(part)
            held.append(part[:0])
            continue
        chosen = np.zeros(len(part), dtype=bool)
        chosen[client_rng(k).choice(len(part), size=count, replace=False)] = True
        train.append(part[~chosen])
        held.append(part[chosen])
    return train, held
