"""The client-inference protocol: how a client approximates its tilted distribution.

A site method (FedEP, FedSEP, PVI) gives its client a cavity ``q_{\\k}`` (the global without the
client's own site) and asks for a Gaussian approximation of the tilted distribution
``p(D_k | theta) q_{\\k}(theta)``. Every such client inference method is one pure function of the
same shape, as blackjax's kernels are (key first, ``(state, info)`` out):

    infer(key, start, cavity, data) -> (q, info)

so the methods plug into the algorithms interchangeably and one conformance test runs each under
``jit`` and ``vmap`` (tests/inference/test_base.py). ``start`` is where the inference starts: the
parameters of the sampler's first iterate for FedEP's tilted methods
(:func:`fedbayes.inference.tilted.make_tilted_inference`), the Gaussian whose mean and standard
deviations the variational parameters start from for PVI's
(:func:`fedbayes.inference.vi.reparameterised_vi`).

A dual method (FedLap, FedLap-Cov, FedLap-Func) asks instead for a point: the minimiser of its
client's mean loss plus a penalty, by a :class:`LocalSolver` (:func:`fedbayes.inference.sgd.run_sgd`,
or an exact solver in tests).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import jax

from fedbayes.typing import Info, PyTree

if TYPE_CHECKING:  # annotations only: importing fedbayes.inference stays light (no flax)
    from collections.abc import Callable

    from fedbayes.data.batches import ClientData
    from fedbayes.gaussian import DiagGaussian
    from fedbayes.inference.sgd import LocalTrainer

__all__ = ["CavityInference", "Info", "LocalSolver"]


class CavityInference(Protocol):
    """``(key, start, cavity, data) -> (q, info)``: a diagonal Gaussian approximation ``q`` of the
    tilted distribution ``p(D_k | theta) cavity(theta)`` and the inference's info (its training
    info: ``loss`` and the like)."""

    def __call__(self, key: jax.Array, start: PyTree, cavity: DiagGaussian, data: ClientData) -> tuple[DiagGaussian, Info]: ...


class LocalSolver(Protocol):
    """``(key, start, data, trainer, penalty) -> (params, info)``: the client's parameters after
    minimising ``trainer``'s mean loss plus ``penalty(params)`` (``None``: nothing added) from
    ``start``, and its training info; :func:`fedbayes.inference.sgd.run_sgd` is one."""

    def __call__(
        self, key: jax.Array, start: PyTree, data: ClientData, trainer: LocalTrainer, penalty: Callable[[PyTree], jax.Array] | None = None
    ) -> tuple[PyTree, Info]: ...
