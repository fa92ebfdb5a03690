"""Small federations and models shared by the tests."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits

from fedbayes import protocol, tree
from fedbayes.data.batches import ClientData, layout_orders, size_class
from fedbayes.data.federation import Federation
from fedbayes.inference.sgd import LocalTrainer
from fedbayes.models import init_params, loss_fn, make_model
from fedbayes.sim.simulator import Simulator

# One round on digits, 4 clients all sampled, with a validation split: the config the tests of a
# run's held-out examples (conformal calibration, personalisation) start from.
HELD_OUT_RUN = {
    "rounds": 1,
    "checkpoint_every": 0,
    "data": {"dataset": "digits", "num_clients": 4, "partition": "dirichlet", "alpha": 0.5, "validation_fraction": 0.1},
    "model": {"name": "logreg"},
    "server": {"clients_per_round": 4},
}

# A small run on digits (a few seconds), for the CLI tests: format with rounds, top (top-level keys),
# algorithm and extra (more [algorithm] keys).
DIGITS_RUN = """
name = "rel"
rounds = {rounds}
checkpoint_every = 2
{top}
[data]
dataset = "digits"
num_clients = 6
partition = "dirichlet"
alpha = 0.5
[model]
name = "logreg"
[client]
lr = 0.1
batch_size = 16
[server]
clients_per_round = 3
[algorithm]
name = "{algorithm}"
{extra}
"""


def digits_federation(sizes=(37, 90, 213, 11, 150), seed=0) -> Federation:
    """Digits split into clients of the given (unequal) sizes."""
    d = load_digits()
    x = (d.images[..., None] / 16.0).astype(np.float32)
    y = d.target.astype(np.int32)
    perm = np.random.default_rng(seed).permutation(len(x))[: sum(sizes)]
    parts = np.split(perm, np.cumsum(sizes)[:-1])
    return Federation(x, y, tuple(parts))


def digits_vbnn_run(rounds=4, sim_kwargs=None, **vbnn_kwargs):
    """A variational MLP (32) trained by the VBNN on scikit-learn's digits, 4 iid clients, all every
    round, ``rounds`` rounds with no message rejected; returns ``(apply, server params, dataset)``."""
    from fedbayes.algorithms.vbnn import vbnn
    from fedbayes.data import load_dataset, partition
    from fedbayes.models.variational import apply_with_key

    data = load_dataset("digits")
    parts = partition("iid", data.y_train, 4, np.random.default_rng(0))
    model = make_model("mlp", data.num_classes, variational=True, hidden=(32,))
    apply = apply_with_key(model)
    trainer = LocalTrainer(None, optax.sgd(0.05, momentum=0.9), num_epochs=2, batch_size=32)
    algorithm = vbnn(trainer, apply, total_examples=len(data.y_train), **vbnn_kwargs)
    sim = Simulator(algorithm, Federation(data.x_train, data.y_train, tuple(parts)), clients_per_round=4, seed=0, **(sim_kwargs or {}))
    state = sim.init(init_params(model, jax.random.key(0), data.feature_shape))
    for _ in range(rounds):
        state, info = sim.run_round(state)
        assert len(info.rejected) == 0
    return apply, sim.server_params(state), data


def logreg_setup(lr=0.1, epochs=2, batch_size=16, momentum=None):
    """A logistic-regression trainer on digits and its initial parameters."""
    model = make_model("logreg", 10)
    params = init_params(model, jax.random.key(1), (8, 8, 1))
    trainer = LocalTrainer(loss_fn(model, "classification"), optax.sgd(lr, momentum=momentum), epochs, batch_size)
    return model, params, trainer


def single_client_data(sim: Simulator, round_idx: int, cid: int) -> ClientData:
    """One client's data built alone (its own order buffer at offset 0), not as part of a cohort."""
    ix = sim.federation.client_indices[cid]
    epochs, batch = sim.algorithm.local_epochs, sim.algorithm.local_batch_size
    # One buffer length for every client of the federation (the tail is padding the client never
    # reads), so that a plain loop compiles the client update once rather than once per client size.
    length = size_class(epochs * max(len(i) for i in sim.federation.client_indices) + batch)
    order, offsets, _ = layout_orders(sim.seed, round_idx, [cid], [ix], epochs, batch, length=length)
    return ClientData(jnp.asarray(sim.federation.x), jnp.asarray(sim.federation.y), jnp.asarray(order), jnp.int32(offsets[0]), jnp.int32(len(ix)))


def plain_loop_round(sim: Simulator, state, client_update=None):
    """Reference: one round as a Python loop over the cohort, one client at a time, no vmap,
    through the public round protocol (cohort, keys, weights, server step). Returns the new server
    state, the cohort, each client's new state and the acceptance flags. ``client_update``
    replaces the algorithm's (e.g. one that poisons a client)."""
    alg = sim.algorithm
    cohort = protocol.sample_cohort(sim.seed, state.round, sim.federation.num_clients, sim.clients_per_round)
    message = alg.broadcast(state.server_state)
    msgs, new_states = [], []
    update = jax.jit(client_update or alg.client_update)  # one client at a time; jit only to keep tests fast
    for cid in cohort:
        data = single_client_data(sim, state.round, cid)
        cstate = jax.tree.map(lambda a: a[cid], state.client_states)
        m, s, _ = update(protocol.client_key(sim.seed, state.round, int(cid)), message, cstate, data)
        msgs.append(m)
        new_states.append(s)
    w = jnp.asarray(protocol.client_weights(sim.sizes[cohort], sim.weighting))
    server, ok, _ = jitted_server_step(alg)(protocol.server_key(sim.seed, state.round), state.server_state, tree.stack(msgs), w)
    return server, cohort, new_states, np.asarray(ok)


def jitted_server_step(alg, aggregator=None):
    """:func:`fedbayes.protocol.server_step` of ``alg`` as one compiled program ``(key, state, messages,
    weights)``: run op by op, a dense method's step dispatches hundreds of small programs, each
    compiled once per process."""
    return jax.jit(lambda key, state, messages, weights: protocol.server_step(key, alg, state, messages, weights, aggregator))
