"""What goes wrong in a simulated federation: client failures, stragglers and attacks.

A :class:`Scenario` gathers the simulator's knobs for them (``server.dropout``,
``server.deadline``, ``attack``); :class:`~fedbayes.sim.simulator.Simulator` takes one.

Failures (:meth:`Scenario.failed_clients`): each sampled client fails with probability
``dropout`` (one uniform draw per cohort client from :func:`fedbayes.protocol.dropout_rng`, so
reproducible by seed), and one whose local step count ``E * ceil(n_k / B)`` exceeds
``deadline`` misses the round (a straggler). A failed client sends nothing and keeps its state.

Attacks, for measuring robust aggregation (``attack = {fraction, kind, scale}``):

A fixed set of ``floor(fraction * K)`` clients, drawn once per run from
:func:`fedbayes.protocol.attackers_rng` (so it depends on the seed only), misbehaves whenever
sampled. Message attacks replace the attacker's honest message after its client update and
before the server step (the server cannot tell): the simulator applies them with
:func:`message_attack`'s function on the cohort's stacked messages.

* ``"scaled"``: every floating value times ``scale`` (default 10).
* ``"sign_flip"``: every floating value negated (times ``scale``, default 1).
* ``"nan"``: every floating value NaN (the method's ``message_ok`` rejects it: a test of the
  validation, not of the rule).
* ``"huge_precision"``: Gaussian messages only. The attacker claims a confident, wrong posterior:
  precision ``(1 + scale) Lambda_g`` (default ``scale`` 1000) around ``-m_g`` (the global mean
  negated), i.e. ``Delta Lambda = scale Lambda_g``, ``Delta eta = -(Lambda_g + Delta Lambda) m_g
  - eta_g``. Under the plain sum it takes nearly all the weight of the Gaussian product.
* ``"label_flip"``: the attackers' training labels become ``C - 1 - y`` (data poisoning; honest
  computation on bad data): :func:`flip_labels`, applied to the federation's labels.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fedbayes import protocol
from fedbayes.aggregators import is_floating
from fedbayes.aggregators.robust import map_gaussians
from fedbayes.gaussian import DiagGaussian

PyTree = Any

KINDS = ("scaled", "sign_flip", "nan", "huge_precision", "label_flip")
MESSAGE_KINDS = ("scaled", "sign_flip", "nan", "huge_precision")
DEFAULT_SCALE = {"scaled": 10.0, "sign_flip": 1.0, "nan": 1.0, "huge_precision": 1000.0, "label_flip": 1.0}

__all__ = ["DEFAULT_SCALE", "KINDS", "MESSAGE_KINDS", "Scenario", "attacker_ids", "flip_labels", "message_attack"]


class Scenario(NamedTuple):
    """The simulated federation's failures and attacks (the default: none).

    Attributes:
      dropout: probability that a sampled client fails in a round, in ``[0, 1)``.
      deadline: local steps a sampled client may take; one with more misses the round; ``None``:
        no deadline.
      attack: ``(messages, attackers, broadcast) -> messages`` (:func:`message_attack`), applied
        to the cohort's messages before the server step; ``None``: no message attack.
      attackers: the client ids that attack (:func:`attacker_ids`).
    """

    dropout: float = 0.0
    deadline: int | None = None
    attack: Callable[[PyTree, jax.Array, PyTree], PyTree] | None = None
    attackers: Sequence[int] = ()

    def check(self) -> None:
        """Raises ValueError naming the knob that is out of range."""
        if not 0 <= self.dropout < 1:
            raise ValueError(f"dropout must be in [0, 1); got {self.dropout}")
        if self.deadline is not None and self.deadline < 1:
            raise ValueError(f"deadline must be >= 1 local steps (or None); got {self.deadline}")

    @property
    def fails_clients(self) -> bool:
        """Whether clients can fail (dropout or a deadline)."""
        return self.dropout > 0 or self.deadline is not None

    def attacker_mask(self, num_clients: int) -> np.ndarray:
        """``[num_clients]`` booleans, true for the attackers."""
        mask = np.zeros(num_clients, np.bool_)
        mask[np.asarray(self.attackers, np.int64)] = True
        return mask

    def failed_clients(self, seed: int, round_idx: int, cohort: np.ndarray, steps: Callable[[np.ndarray], np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """``(dropped, late)``: boolean masks over the (sorted) cohort of the clients that fail
        round ``round_idx`` (``dropout``) and of those that miss the ``deadline``; ``steps(cohort)``
        gives each cohort client's local step count (only called with a deadline)."""
        dropped = np.zeros(len(cohort), np.bool_)
        if self.dropout > 0:
            dropped = protocol.dropout_rng(seed, round_idx).random(len(cohort)) < self.dropout
        late = np.zeros(len(cohort), np.bool_)
        if self.deadline is not None:
            late = ~dropped & (np.asarray(steps(cohort)) > self.deadline)
        return dropped, late


def attacker_ids(seed: int, num_clients: int, fraction: float) -> np.ndarray:
    """The run's attacking clients: ``floor(fraction * K)`` distinct ids, sorted."""
    if not 0 <= fraction < 1:
        raise ValueError(f"attack.fraction must be in [0, 1); got {fraction}")
    count = int(np.floor(fraction * num_clients + 1e-9))
    if count == 0:
        return np.zeros(0, np.int64)
    return protocol.sample_without_replacement(protocol.attackers_rng(seed), num_clients, count)


def flip_labels(y: np.ndarray, indices: np.ndarray, num_classes: int) -> np.ndarray:
    """A copy of ``y`` with the labels at ``indices`` replaced by ``num_classes - 1 - y``."""
    out = np.array(y, copy=True)
    out[indices] = (num_classes - 1 - out[indices]).astype(out.dtype)
    return out


def _rows(mask: jax.Array, x: jax.Array) -> jax.Array:
    return mask.reshape((-1,) + (1,) * (x.ndim - 1))


def _huge_precision(scale: float):
    def fake(d: DiagGaussian, q: DiagGaussian) -> DiagGaussian:
        def full(r, x):  # the reference broadcast to the stacked message's shape
            return jnp.broadcast_to(jnp.reshape(r, (1,) * (x.ndim - jnp.ndim(r)) + jnp.shape(r)), x.shape).astype(x.dtype)

        lam_g = jax.tree.map(lambda lam, x: full(jnp.where(lam > 0, lam, 1.0), x), q.precision, d.precision)
        eta_g = jax.tree.map(full, q.precision_mean, d.precision_mean)
        d_lam = jax.tree.map(lambda lg: scale * lg, lam_g)
        d_eta = jax.tree.map(lambda lg, dl, eg: -(lg + dl) * (eg / lg) - eg, lam_g, d_lam, eta_g)
        return DiagGaussian(precision_mean=d_eta, precision=d_lam)

    return fake


def message_attack(kind: str, scale: float | None = None):
    """``(messages, attackers, broadcast) -> messages``: the rows where ``attackers`` (``[M]``
    bool) is true replaced by the attack ``kind`` (module docstring); ``broadcast`` is the
    round's server message (``huge_precision`` reads ``q_g`` from it).

    Raises:
      ValueError: ``kind`` is not a message attack.
    """
    if kind not in MESSAGE_KINDS:
        raise ValueError(f"attack.kind must be one of {', '.join(MESSAGE_KINDS)} for a message attack; got {kind!r}")
    s = DEFAULT_SCALE[kind] if scale is None else float(scale)

    def attack(messages: PyTree, attackers: jax.Array, broadcast: PyTree) -> PyTree:
        if kind == "huge_precision":
            fake = map_gaussians(_huge_precision(s), messages, broadcast)
            if fake is None:
                from fedbayes.errors import BadInputError

                raise BadInputError(
                    "config error: attack.kind: 'huge_precision' needs a method with Gaussian messages (fedep, fedsep, ...); use scaled, sign_flip, nan or label_flip"
                )
        elif kind == "scaled":
            fake = jax.tree.map(lambda x: x * jnp.asarray(s, x.dtype) if is_floating(x) else x, messages)
        elif kind == "sign_flip":
            fake = jax.tree.map(lambda x: -x * jnp.asarray(s, x.dtype) if is_floating(x) else x, messages)
        else:
            fake = jax.tree.map(lambda x: jnp.full_like(x, jnp.nan) if is_floating(x) else x, messages)
        return jax.tree.map(lambda f, x: jnp.where(_rows(attackers, x), f, x) if is_floating(x) else x, fake, messages)

    return attack
