"""FedPA: the shrinkage delta's dynamic programme, the IASG sampler and the algorithm (docs/algorithms.md §6.10)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import digits_federation, logreg_setup
from hypothesis import given
from hypothesis import strategies as st

from fedbayes.algorithms.fedavg import fedavg
from fedbayes.algorithms.fedpa import dense_shrinkage_delta, fedpa, shrinkage_delta, shrinkage_rho
from fedbayes.algorithms.server_opt import make_server_optimizer
from fedbayes.data.batches import ClientData, layout_orders
from fedbayes.inference import LocalTrainer, epoch_samples, iasg, run_sgd
from fedbayes.sim.simulator import Simulator


def _problem(seed, num, dim, dtype=np.float64, spread=1.0):
    rng = np.random.default_rng(seed)
    samples = rng.normal(size=(num, dim)) * spread * rng.uniform(0.1, 2.0, size=dim)
    theta = rng.normal(size=dim)
    return samples.astype(dtype), theta.astype(dtype)


def _rel(a, b):
    return float(np.linalg.norm(np.asarray(a) - np.asarray(b)) / max(np.linalg.norm(np.asarray(b)), 1e-300))


# Few distinct shapes (each new shape compiles the eager ops again); the values vary freely.
@given(
    num=st.sampled_from([1, 2, 3, 5, 8, 13, 20]),
    dim=st.sampled_from([1, 2, 17, 120, 500]),
    rho=st.sampled_from([0.0, 1e-3, 0.01, 0.5, 1.0, 5.0]),
    seed=st.integers(0, 2**31 - 1),
)
def test_dp_equals_dense_solve_float64(num, dim, rho, seed):
    samples, theta = _problem(seed, num, dim)
    with jax.enable_x64(True):
        got = shrinkage_delta(jnp.asarray(samples), jnp.asarray(theta), rho)
        want = dense_shrinkage_delta(jnp.asarray(samples), jnp.asarray(theta), rho)
        assert got.dtype == jnp.float64
    assert _rel(got, want) < 1e-8


@pytest.mark.parametrize("num,dim,rho", [(1, 7, 0.1), (2, 50, 1.0), (5, 200, 0.1), (12, 500, 0.01), (20, 300, 0.05)])
def test_dp_equals_dense_solve_float32(num, dim, rho):
    samples, theta = _problem(num * 7 + dim, num, dim, np.float32, spread=0.3)
    got = shrinkage_delta(jnp.asarray(samples), jnp.asarray(theta), rho)
    assert got.dtype == jnp.float32
    with jax.enable_x64(True):
        want = dense_shrinkage_delta(jnp.asarray(samples, jnp.float64), jnp.asarray(theta, jnp.float64), rho)
    assert _rel(got, want) < 1e-4


def test_dp_is_not_the_identity_covariance():
    # The shrinkage really acts: with rho > 0 and several samples the delta differs from theta - mean.
    samples, theta = _problem(3, 6, 20)
    with jax.enable_x64(True):
        got = shrinkage_delta(jnp.asarray(samples), jnp.asarray(theta), 1.0)
    assert _rel(got, theta - samples.mean(0)) > 0.1


@pytest.mark.parametrize("num,rho", [(1, 0.5), (1, 0.0), (7, 0.0)])
def test_one_sample_or_zero_rho_is_fedavg_delta(num, rho):
    samples, theta = _problem(1, num, 30)
    with jax.enable_x64(True):
        got = shrinkage_delta(jnp.asarray(samples), jnp.asarray(theta), rho)
    np.testing.assert_allclose(got, theta - samples.mean(0), rtol=1e-12, atol=1e-12)


def test_any_time_property():
    # The delta after t samples equals the dense solve on the first t samples (docs/algorithms.md §6.10 test 6).
    samples, theta = _problem(4, 9, 15)
    with jax.enable_x64(True):
        for t in range(1, 10):
            got = shrinkage_delta(jnp.asarray(samples[:t]), jnp.asarray(theta), 0.3)
            want = dense_shrinkage_delta(jnp.asarray(samples[:t]), jnp.asarray(theta), 0.3)
            assert _rel(got, want) < 1e-10


def test_pytree_samples_equal_flat():
    samples, theta = _problem(5, 6, 12)
    tree_samples = {"a": samples[:, :5].reshape(6, 5, 1), "b": samples[:, 5:]}
    tree_theta = {"a": theta[:5].reshape(5, 1), "b": theta[5:]}
    with jax.enable_x64(True):
        got = shrinkage_delta(jax.tree.map(jnp.asarray, tree_samples), jax.tree.map(jnp.asarray, tree_theta), 0.2)
        flat = shrinkage_delta(jnp.asarray(samples), jnp.asarray(theta), 0.2)
    np.testing.assert_allclose(np.concatenate([got["a"].reshape(-1), got["b"]]), flat, rtol=1e-12)


def test_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="leading sample axis"):
        shrinkage_delta(jnp.zeros((3, 4)), jnp.zeros(5), 0.1)


def test_jit_and_vmap():
    samples, theta = _problem(6, 5, 40, np.float32)
    batch_s = jnp.stack([jnp.asarray(samples), jnp.asarray(samples[::-1] * 2)])
    batch_t = jnp.stack([jnp.asarray(theta), jnp.asarray(-theta)])
    rhos = jnp.array([0.1, 2.0], jnp.float32)
    got = jax.jit(jax.vmap(shrinkage_delta))(batch_s, batch_t, rhos)
    for i in range(2):
        np.testing.assert_allclose(got[i], shrinkage_delta(batch_s[i], batch_t[i], float(rhos[i])), rtol=2e-5, atol=1e-6)
    auto = jax.jit(jax.vmap(lambda s, t: shrinkage_delta(s, t, "oas")))(batch_s, batch_t)
    assert auto.shape == batch_t.shape and bool(jnp.all(jnp.isfinite(auto)))


def test_million_parameters_without_a_d_squared_matrix():
    # O(l d) memory: a dense d x d covariance at d = 10^6 would need 4 TB.
    dim, num = 1_000_000, 10
    key = jax.random.key(0)
    samples = jax.random.normal(key, (num, dim), jnp.float32)
    theta = jnp.ones(dim, jnp.float32)
    g = jax.jit(lambda s, t: shrinkage_delta(s, t, 0.01))(samples, theta)
    assert g.shape == (dim,) and bool(jnp.all(jnp.isfinite(g)))
    # Orthogonally to the centred samples Sigma_l is rho_l I, so there the delta is
    # (1 + (l-1) rho) times the orthogonal part of theta - mean.
    mean = samples.mean(0)
    centred = samples - mean[None]
    resid = (theta - mean) - centred.T @ jnp.linalg.lstsq(centred.T, theta - mean)[0]
    g_resid = jnp.vdot(resid, g) / jnp.vdot(resid, resid)
    np.testing.assert_allclose(float(g_resid), 1 + (num - 1) * 0.01, rtol=1e-3)


def _oas_rblw_reference(samples):
    num, dim = samples.shape
    s = np.cov(samples, rowvar=False, bias=True)
    tr, tr2 = np.trace(s), np.trace(s @ s)
    rblw = min(((num - 2) / num * tr2 + tr**2) / ((num + 2) * (tr2 - tr**2 / dim)), 1.0)
    oas = min(((1 - 2 / dim) * tr2 + tr**2) / ((num + 1 - 2 / dim) * (tr2 - tr**2 / dim)), 1.0)
    return oas, rblw


@pytest.mark.parametrize("num,dim", [(3, 5), (8, 40), (20, 10)])
def test_rho_from_samples_matches_chen_et_al(num, dim):
    samples, theta = _problem(num + dim, num, dim)
    oas, rblw = _oas_rblw_reference(samples)
    with jax.enable_x64(True):
        for method, s in (("oas", oas), ("rblw", rblw)):
            rho = float(shrinkage_rho(jnp.asarray(samples), method))
            np.testing.assert_allclose(1.0 / (1.0 + (num - 1) * rho), s, rtol=1e-9)
            got = shrinkage_delta(jnp.asarray(samples), jnp.asarray(theta), method)
            assert _rel(got, dense_shrinkage_delta(jnp.asarray(samples), jnp.asarray(theta), rho)) < 1e-9


def test_rho_from_identical_samples_is_zero():
    samples = jnp.ones((4, 6))
    assert float(shrinkage_rho(samples, "oas")) == 0.0
    with pytest.raises(ValueError, match="oas, rblw"):
        shrinkage_rho(samples, "ledoit")


# ----- the sampler -------------------------------------------------------------------------------


def _client(num_epochs=3, batch_size=16, n=90):
    fed = digits_federation(sizes=(n,))
    model, params, trainer = logreg_setup(lr=0.1, epochs=num_epochs, batch_size=batch_size, momentum=0.5)
    order, offsets, _ = layout_orders(0, 0, [0], [fed.client_indices[0]], num_epochs, batch_size)
    data = ClientData(jnp.asarray(fed.x), jnp.asarray(fed.y), jnp.asarray(order), jnp.int32(offsets[0]), jnp.int32(n))
    return params, trainer, data


def test_epoch_samples_follow_the_sgd_trajectory():
    params, trainer, data = _client()
    key = jax.random.key(0)
    samples, last, _ = jax.jit(lambda p, d: epoch_samples(key, p, d, trainer, skip_epochs=1))(params, data)
    np.testing.assert_array_equal(jax.tree.leaves(last)[0], jax.tree.leaves(jax.jit(lambda p, d: run_sgd(key, p, d, trainer)[0])(params, data))[0])
    assert jax.tree.leaves(samples)[0].shape[0] == 2
    # Without averaging, sample j is the last iterate of epoch j + skip.
    snaps, _, _ = jax.jit(lambda p, d: epoch_samples(key, p, d, trainer, skip_epochs=0, average=False))(params, data)
    np.testing.assert_array_equal(jax.tree.leaves(snaps)[0][-1], jax.tree.leaves(last)[0])
    one = LocalTrainer(trainer.loss_fn, trainer.optimizer, 1, trainer.batch_size)
    first = jax.jit(lambda p, d: run_sgd(key, p, d, one)[0])(params, data)
    np.testing.assert_allclose(jax.tree.leaves(snaps)[0][0], jax.tree.leaves(first)[0], rtol=1e-6, atol=1e-7)


def test_iasg_averages_iterates():
    # On f(x) = x^2 / 2 with plain SGD lr a, x_{s+1} = (1 - a) x_s: averages are known in closed form.
    a, x0 = 0.1, 1.0
    grad = lambda p, _: p  # noqa: E731
    samples, last = iasg(jnp.float32(x0), lambda s: (s,), grad, optax.sgd(a), burn_in_steps=3, steps_per_sample=4, num_samples=2, discard_steps=1)
    traj = x0 * (1 - a) ** np.arange(0, 20)
    np.testing.assert_allclose(samples, [traj[4:8].mean(), traj[9:13].mean()], rtol=1e-6)
    np.testing.assert_allclose(last, traj[13], rtol=1e-6)


@pytest.mark.parametrize("burn_in,per_sample,discard", [(0, 1, 0), (3, 5, 2), (2, 17, 0)])
def test_iasg_average_is_the_mean_of_the_recorded_iterates(burn_in, per_sample, discard):
    # The sampler sums weighted updates, not iterates; with momentum and a curved, noisy objective
    # it must still give each stretch's plain mean iterate (float64: only round-off may differ).
    with jax.enable_x64():
        opt = optax.sgd(0.05, momentum=0.7)
        h = jnp.asarray([1.0, 3.0, 0.5])
        noise = jax.random.normal(jax.random.key(3), (64, 3), jnp.float64)

        def grad(p, s):
            return {"w": h * p["w"] + jnp.sin(p["w"]) + noise[s % 64]}

        p0 = {"w": jnp.asarray([1.0, -2.0, 0.5])}
        samples, last = iasg(p0, lambda s: (s,), grad, opt, burn_in_steps=burn_in, steps_per_sample=per_sample, num_samples=3, discard_steps=discard)
        p, state, iterates = p0, opt.init(p0), []
        for s in range(burn_in + 3 * (per_sample + discard)):
            updates, state = opt.update(grad(p, s), state, p)
            p = optax.apply_updates(p, updates)
            iterates.append(np.asarray(p["w"]))
        want = [np.mean(iterates[burn_in + j * (per_sample + discard) : burn_in + j * (per_sample + discard) + per_sample], axis=0) for j in range(3)]
        np.testing.assert_allclose(samples["w"], np.stack(want), rtol=1e-12, atol=1e-13)
        np.testing.assert_allclose(last["w"], iterates[-1], rtol=1e-14)  # compiled vs eager: FMA round-off


# ----- the algorithm -------------------------------------------------------------------------------


def _sim(algorithm, fed, **kw):
    return Simulator(algorithm, fed, clients_per_round=3, seed=4, **kw)


def test_burn_in_rounds_equal_fedavg_bit_for_bit():
    fed = digits_federation()
    _, params, trainer = logreg_setup(epochs=3, momentum=0.5)
    server = make_server_optimizer("momentum", 0.7)
    sims = [_sim(fedavg(trainer, server), fed), _sim(fedpa(trainer, server, rho=0.5, burn_in_rounds=2), fed)]
    states = [s.init(params) for s in sims]
    for _ in range(2):
        states = [s.run_round(st)[0] for s, st in zip(sims, states)]
    for a, b in zip(jax.tree.leaves(sims[0].server_params(states[0])), jax.tree.leaves(sims[1].server_params(states[1]))):
        np.testing.assert_array_equal(a, b)
    # The third round samples: now the two differ.
    states = [s.run_round(st)[0] for s, st in zip(sims, states)]
    diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(*(jax.tree.leaves(s.server_params(st)) for s, st in zip(sims, states))))
    assert diff > 1e-4


def test_sampling_round_applies_the_weighted_shrinkage_deltas():
    fed = digits_federation(sizes=(40, 70))
    _, params, trainer = logreg_setup(epochs=4, batch_size=16)
    algo = fedpa(trainer, optax.sgd(1.0), rho=0.3)
    sim = Simulator(algo, fed, clients_per_round=2, seed=1)
    state = sim.init(params)
    new, _ = sim.run_round(state)
    # Recompute the two clients by hand with the same shuffles.
    deltas = []
    for k, n in enumerate((40, 70)):
        order, offsets, _ = layout_orders(1, 0, [k], [fed.client_indices[k]], 4, 16)
        data = ClientData(jnp.asarray(fed.x), jnp.asarray(fed.y), jnp.asarray(order), jnp.int32(0), jnp.int32(n))
        samples, _, _ = epoch_samples(jax.random.key(0), params, data, trainer, skip_epochs=1)
        deltas.append(shrinkage_delta(samples, params, 0.3))
    want = jax.tree.map(lambda p, d0, d1: p - (40 * d0 + 70 * d1) / 110, params, *deltas)
    for a, b in zip(jax.tree.leaves(sim.server_params(new)), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5)


def test_vmap_layout_equals_sequential():
    fed = digits_federation()
    _, params, trainer = logreg_setup(epochs=3)
    algo = fedpa(trainer, optax.sgd(1.0), rho="oas")
    out = []
    for layout in ("sequential", "vmap"):
        sim = _sim(algo, fed, layout=layout)
        state = sim.init(params)
        for _ in range(2):
            state, _ = sim.run_round(state)
        out.append(jax.tree.leaves(sim.server_params(state)))
    for a, b in zip(*out):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_fedpa_argument_errors():
    _, _, trainer = logreg_setup(epochs=1)
    with pytest.raises(ValueError, match="local epochs"):
        fedpa(trainer, optax.sgd(1.0))
    _, _, trainer = logreg_setup(epochs=2)
    with pytest.raises(ValueError, match="rho"):
        fedpa(trainer, optax.sgd(1.0), rho=-1.0)
    with pytest.raises(ValueError, match="rho"):
        fedpa(trainer, optax.sgd(1.0), rho="ledoit")
