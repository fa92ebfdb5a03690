"""On-demand (generated) federations: same results as pooled data, any number of clients."""

import jax
import numpy as np
import optax
import pytest

from fedbayes.algorithms.admm import admm
from fedbayes.algorithms.fedavg import fedavg
from fedbayes.data import Federation, GeneratedFederation, heavy_tailed_sizes, synthetic_heavy_tailed_federation
from fedbayes.data.synthetic import synthetic_leaf_client
from fedbayes.inference.sgd import LocalTrainer
from fedbayes.models import init_params, loss_fn, make_model
from fedbayes.sim.simulator import Simulator


def _trainer():
    model = make_model("logreg", 10)
    return LocalTrainer(loss_fn(model, "classification"), optax.sgd(0.05), 2, 16), init_params(model, jax.random.key(0), (60,))


@pytest.mark.parametrize("layout", ["sequential", "vmap"])
def test_generated_federation_equals_the_same_data_pooled(layout):
    sizes = np.array([30, 5, 77, 12, 50, 41])
    gen = GeneratedFederation(sizes, lambda c: synthetic_leaf_client(c, 3, 1.0, 1.0, int(sizes[c])), (60,))
    parts = [gen.client_data(c) for c in range(len(sizes))]
    starts = np.cumsum([0, *sizes[:-1]])
    pooled = Federation(np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]), tuple(np.arange(s, s + n) for s, n in zip(starts, sizes)))
    trainer, params = _trainer()
    out = []
    for fed in (gen, pooled):
        alg = admm(trainer, optax.sgd(1.0), rho=0.1, num_clients=len(sizes))
        sim = Simulator(alg, fed, clients_per_round=4, seed=1, layout=layout)
        state = sim.init(params)
        for _ in range(3):
            state, info = sim.run_round(state)
        out.append(state)
    for a, b in zip(jax.tree.leaves(out[0]), jax.tree.leaves(out[1])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)  # same math; sums may reassociate


def test_heavy_tailed_sizes_match_the_requested_moments():
    s = heavy_tailed_sizes(200_000, np.random.default_rng(0))
    assert s.min() >= 1
    assert abs(s.mean() - 400) < 20  # sampling error of the mean at n = 2e5 is about 3
    assert 1000 < s.std() < 1700  # the sample std of a heavy tail converges slowly


def test_stackoverflow_scale_federation_runs_rounds():
    fed = synthetic_heavy_tailed_federation(seed=0)
    assert fed.num_clients == 342_477
    trainer, params = _trainer()
    sim = Simulator(fedavg(trainer, optax.sgd(1.0)), fed, clients_per_round=10, seed=0)
    state = sim.init(params)
    for _ in range(2):
        state, info = sim.run_round(state)
        assert len(info.cohort) == 10 and info.cohort.max() < fed.num_clients
        assert 0.0 <= info.padding_waste <= 0.2 + 1e-9
    assert all(np.isfinite(np.asarray(leaf)).all() for leaf in jax.tree.leaves(sim.server_params(state)))
