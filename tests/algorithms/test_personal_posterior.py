"""Personalised posteriors of the site methods (docs/algorithms.md §13.8): ``q_k ∝ q_g t_k^w`` in
float64 algebra, its policy for an improper coordinate, and, on a conjugate model whose exact
sites are the clients' likelihoods, PVI's and FedEP's hook give the posterior of the pooled data
with the client's own data counted twice."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedbayes import gaussian
from fedbayes.algorithms.fedep import fedep, fedsep
from fedbayes.algorithms.pvi import pvi
from fedbayes.algorithms.sites import personal_moments, personalised
from fedbayes.data.federation import Federation
from fedbayes.gaussian import DiagGaussian
from fedbayes.inference import LocalTrainer
from fedbayes.inference.sgd import training_info
from fedbayes.sim.simulator import Simulator

DIM = 3


def _random_gaussian(rng, dim=DIM, low=0.5, high=3.0) -> DiagGaussian:
    lam = rng.uniform(low, high, dim)
    return DiagGaussian(precision_mean=jnp.asarray(lam * rng.normal(size=dim)), precision=jnp.asarray(lam))


def test_personalised_is_the_global_times_the_site_to_the_weight_in_float64():
    rng = np.random.default_rng(0)
    with jax.enable_x64(True):
        q, site = _random_gaussian(rng), _random_gaussian(rng)
        for w in (0.0, 0.5, 1.0, 2.0):
            q_k, kept = personalised(q, site, w)
            assert int(kept) == 0
            np.testing.assert_allclose(q_k.precision, q.precision + w * site.precision, rtol=1e-15)
            np.testing.assert_allclose(q_k.precision_mean, q.precision_mean + w * site.precision_mean, rtol=1e-15)
        # w = 1 is the product of the two factors; w = 0 is the global itself
        one, _ = personalised(q, site, 1.0)
        np.testing.assert_allclose(gaussian.mean(one), gaussian.mean(gaussian.product(q, site)), rtol=1e-14)
        mean, variance = personal_moments(q, site, 0.0, jnp.zeros(DIM))
        np.testing.assert_allclose(mean, gaussian.mean(q), rtol=1e-15)
        np.testing.assert_allclose(variance, gaussian.variance(q), rtol=1e-15)


def test_an_improper_coordinate_keeps_the_global_and_is_counted():
    with jax.enable_x64(True):
        q = DiagGaussian(precision_mean=jnp.array([1.0, 2.0, 3.0]), precision=jnp.array([2.0, 2.0, 2.0]))
        site = DiagGaussian(precision_mean=jnp.array([0.5, 0.5, 0.5]), precision=jnp.array([1.0, -3.0, -1.0]))
        q_k, kept = personalised(q, site, 1.0)
        assert int(kept) == 1  # 2 - 3 < 0 keeps q_g there; 2 - 1 > 0 stays personal
        np.testing.assert_allclose(q_k.precision, [3.0, 2.0, 1.0])
        np.testing.assert_allclose(q_k.precision_mean, [1.5, 2.0, 3.5])


# ----- a conjugate model: each client's likelihood is a diagonal Gaussian factor ----------------------


def _clients(a_diags, b_vecs) -> Federation:
    """One 'example' per client holding its likelihood exp(-theta^T diag(a) theta / 2 + b^T theta)."""
    x = np.concatenate([np.asarray(b_vecs), np.asarray(a_diags)], axis=1).astype(np.float32)
    return Federation(x, np.zeros(len(a_diags), np.int32), tuple(np.array([k]) for k in range(len(a_diags))))


def _exact_tilted(key, start, cavity, data):
    """The exact tilted distribution cavity x likelihood (diagonal, so in the family)."""
    del key, start
    row = data.x[data.order[data.offset]]
    b, a = row[:DIM], row[DIM:]
    return DiagGaussian(precision_mean=cavity.precision_mean + b, precision=cavity.precision + a), training_info(jnp.zeros(()), 0)


def _null_trainer():
    return LocalTrainer(lambda p, k, x, y, m: jnp.zeros(()), optax.sgd(0.0), 1, 1)


def _problem():
    rng = np.random.default_rng(1)
    k = 4
    return rng.uniform(0.5, 3.0, (k, DIM)), rng.normal(size=(k, DIM))


def _expected(a, b, delta, k):
    """The posterior of prior N(0, 1/delta) and every client's data, client k's counted twice."""
    lam = delta + a.sum(0) + a[k]
    return (b.sum(0) + b[k]) / lam, 1.0 / lam


def _check(algo, fed, delta, a, b):
    sim = Simulator(algo, fed, clients_per_round=fed.num_clients, seed=0)
    state, info = sim.run_round(sim.init(jnp.zeros(DIM, jnp.float32)))
    assert len(info.rejected) == 0
    for k in range(fed.num_clients):
        own = jax.tree.map(lambda s, _k=k: s[_k], state.client_states)
        mean, variance = algo.personal_posterior(state.server_state, own, 1.0)
        want_mean, want_var = _expected(a, b, delta, k)
        # 1e-5: float32 states and messages
        np.testing.assert_allclose(mean, want_mean, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(variance, want_var, rtol=1e-5)
        mean0, variance0 = algo.personal_posterior(state.server_state, own, 0.0)
        g_mean, g_var = algo.server_posterior(state.server_state)
        np.testing.assert_array_equal(mean0, g_mean)
        np.testing.assert_array_equal(variance0, g_var)


def test_pvi_personal_posterior_on_a_conjugate_model_counts_the_clients_data_twice():
    a, b = _problem()
    delta = 0.7
    algo = pvi(_null_trainer(), optax.sgd(1.0), prior_precision=delta, damping=1.0, local=_exact_tilted)
    _check(algo, _clients(a, b), delta, a, b)  # one synchronous round at rho = 1 makes every site its likelihood


def test_fedep_personal_posterior_on_a_conjugate_model_counts_the_clients_data_twice_and_fedsep_has_none():
    a, b = _problem()
    fed = _clients(a, b)
    common = dict(total_examples=int(sum(fed.sizes)), num_clients=fed.num_clients, damping=1.0, alpha_cov=1.0, init="uniform")
    _check(fedep(_null_trainer(), optax.sgd(1.0), _exact_tilted, **common), fed, 0.0, a, b)  # flat prior: q_g = prod_k t_k
    assert fedsep(_null_trainer(), optax.sgd(1.0), _exact_tilted, **common).personal_posterior is None  # no site: fine-tuning instead
