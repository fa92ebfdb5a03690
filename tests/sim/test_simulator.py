"""The simulator: exact per-client semantics, layouts agree with a plain per-client loop."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import digits_federation, logreg_setup, plain_loop_round, single_client_data

from fedbayes import protocol
from fedbayes.algorithms.admm import admm
from fedbayes.algorithms.base import Algorithm
from fedbayes.algorithms.fedavg import fedavg
from fedbayes.algorithms.feddyn import feddyn
from fedbayes.algorithms.fedpa import fedpa
from fedbayes.algorithms.fedprox import fedprox
from fedbayes.data.federation import Federation
from fedbayes.inference.sgd import LocalTrainer
from fedbayes.sim.scenario import Scenario
from fedbayes.sim.simulator import Simulator

SIZES = (37, 90, 213, 11, 150)  # unequal on purpose, incl. a client smaller than one batch


@pytest.mark.parametrize("layout", ["vmap", "sequential"])
def test_layouts_equal_plain_per_client_loop_with_server_momentum(layout):
    """FedAvgM (server optimizer state); the registered methods are compared with the plain loop
    in tests/algorithms/test_conformance.py."""
    fed = digits_federation(SIZES)
    _, params, trainer = logreg_setup(epochs=2, batch_size=16)
    alg = fedavg(trainer, optax.sgd(1.0, momentum=0.9))
    sim = Simulator(alg, fed, clients_per_round=3, seed=4, layout=layout)
    state = sim.init(params)
    for _ in range(2):  # two rounds: server optimizer and client state carry over
        ref_server, cohort, ref_states, _ = plain_loop_round(sim, state)
        state, info = sim.run_round(state)
        np.testing.assert_array_equal(info.cohort, cohort)
        for a, b in zip(jax.tree.leaves(state.server_state), jax.tree.leaves(ref_server)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)
        for cid, ref in zip(cohort, ref_states):
            for a, b in zip(jax.tree.leaves(jax.tree.map(lambda s: s[cid], state.client_states)), jax.tree.leaves(ref)):
                np.testing.assert_allclose(a, np.asarray(b), atol=1e-5, rtol=1e-5)


def _step_counter():
    """An 'algorithm' whose message is its client's number of local steps (loss gradient = 1, lr 1)."""
    trainer = LocalTrainer(lambda p, k, x, y, m: jnp.sum(p["w"]), optax.sgd(1.0), 3, 8)
    return fedavg(trainer, optax.sgd(1.0)), {"w": jnp.zeros(())}


@pytest.mark.parametrize("layout", ["vmap", "sequential"])
def test_every_client_takes_exactly_its_own_steps(layout):
    sizes = (1, 7, 8, 9, 40, 17)
    fed = digits_federation(sizes)
    alg, params = _step_counter()
    sim = Simulator(alg, fed, clients_per_round=len(sizes), seed=0, layout=layout)
    state = sim.init(params)
    prepared = sim.prepare_round(0)
    slots = prepared.slots
    program = jax.jit(sim.round_program)
    # run the compiled round and read each client's message through a weight vector e_k
    for k in range(len(slots)):
        if slots[k] < 0:
            continue
        onehot = np.zeros(len(slots), np.float32)
        onehot[k] = 1.0
        args = prepared.args._replace(weights=jax.device_put(onehot, sim.sharded))
        new_server, _, ok, _, _ = program(state.server_state, (), *args)
        assert -float(new_server.params["w"]) == 3 * -(-sizes[slots[k]] // 8), slots[k]


def test_sampling_is_seeded_uniform_without_replacement():
    fed = digits_federation((20,) * 12)
    alg, params = _step_counter()
    sim = Simulator(alg, fed, clients_per_round=5, seed=7)
    a = [sim.sample_cohort(r) for r in range(50)]
    b = [Simulator(alg, fed, clients_per_round=5, seed=7).sample_cohort(r) for r in range(3)]
    for c in a:
        assert len(set(c.tolist())) == 5 and c.min() >= 0 and c.max() < 12
    np.testing.assert_array_equal(a[0], b[0])
    assert len({tuple(c) for c in a}) > 10
    counts = np.bincount(np.concatenate(a), minlength=12)
    assert counts.min() > 0  # every client is sampled at some point in 50 rounds


def test_fedprox_with_mu_zero_equals_fedavg():
    fed = digits_federation(SIZES)
    _, params, trainer = logreg_setup()
    out = []
    for alg in (fedavg(trainer, optax.sgd(1.0)), fedprox(trainer, optax.sgd(1.0), mu=0.0)):
        sim = Simulator(alg, fed, clients_per_round=4, seed=1)
        state = sim.init(params)
        for _ in range(2):
            state, _ = sim.run_round(state)
        out.append(sim.server_params(state))
    for a, b in zip(jax.tree.leaves(out[0]), jax.tree.leaves(out[1])):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_fedprox_pulls_clients_towards_the_server():
    fed = digits_federation(SIZES)
    _, params, trainer = logreg_setup(lr=0.5, epochs=3)
    norms = []
    for mu in (0.0, 1.0):  # lr * mu = 0.5 keeps local SGD stable
        sim = Simulator(fedprox(trainer, optax.sgd(1.0), mu=mu), fed, clients_per_round=5, seed=1)
        state, _ = sim.run_round(sim.init(params))
        delta = optax.tree.sub(sim.server_params(state), params)
        norms.append(float(optax.tree.norm(delta)))
    assert norms[1] < 0.5 * norms[0]


def test_feddyn_equals_admm_under_full_participation():
    """docs/algorithms.md §4.2: with full participation, FedDyn (alpha = rho, no weight decay) == ADMM (delta = 0)."""
    fed = digits_federation(SIZES)
    _, params, trainer = logreg_setup()
    k = fed.num_clients
    out = []
    for alg in (feddyn(trainer, optax.sgd(1.0), alpha=0.5, num_clients=k), admm(trainer, optax.sgd(1.0), rho=0.5, num_clients=k)):
        sim = Simulator(alg, fed, clients_per_round=k, seed=2, weighting="uniform")
        state = sim.init(params)
        for _ in range(3):
            state, _ = sim.run_round(state)
        out.append(sim.server_params(state))
    for a, b in zip(jax.tree.leaves(out[0]), jax.tree.leaves(out[1])):
        np.testing.assert_allclose(a, b, atol=1e-5)  # same math, different summation order


def test_one_step_fedavg_is_weighted_average_of_client_models():
    """docs/algorithms.md §2: server SGD with lr 1 == sum_k (n_k / n) theta_k."""
    fed = digits_federation(SIZES)
    _, params, trainer = logreg_setup(epochs=1)
    sim = Simulator(fedavg(trainer, optax.sgd(1.0)), fed, clients_per_round=5, seed=0)
    state = sim.init(params)
    _, cohort, _, _ = plain_loop_round(sim, state)
    new, _ = sim.run_round(state)
    # client models from the loop reference: theta_k = theta - g_k
    alg = sim.algorithm
    thetas = []
    for cid in cohort:
        data = single_client_data(sim, 0, cid)
        g, _, _ = alg.client_update(protocol.client_key(sim.seed, 0, int(cid)), params, (), data)
        thetas.append(optax.tree.sub(params, g))
    w = fed.sizes[cohort] / fed.sizes[cohort].sum()
    avg = jax.tree.map(lambda *ls: sum(wi * l for wi, l in zip(w, ls)), *thetas)
    for a, b in zip(jax.tree.leaves(sim.server_params(new)), jax.tree.leaves(avg)):
        np.testing.assert_allclose(a, b, atol=1e-5)


def _poisoned(alg: Algorithm, bad_size: int) -> Algorithm:
    """Wraps an algorithm so that the client of size ``bad_size`` (sizes are distinct) sends NaNs."""

    def client_update(key, message, state, data):
        m, s, info = alg.client_update(key, message, state, data)
        bad = data.num_examples == bad_size
        m = jax.tree.map(lambda a: jnp.where(bad, jnp.nan, a), m)
        return m, s, info

    return alg._replace(client_update=client_update)


@pytest.mark.parametrize("layout", ["vmap", "sequential"])
def test_rejected_message_is_not_applied_and_state_is_kept(layout):
    fed = digits_federation(SIZES)
    _, params, trainer = logreg_setup()
    k = fed.num_clients
    base = admm(trainer, optax.sgd(1.0), rho=0.1, num_clients=k)
    sim_bad = Simulator(_poisoned(base, SIZES[1]), fed, clients_per_round=k, seed=0, layout=layout)
    state0 = sim_bad.init(params)
    before = jax.tree.map(np.copy, state0.client_states)
    state, info = sim_bad.run_round(state0)
    for a, b in zip(jax.tree.leaves(state0.client_states), jax.tree.leaves(before)):
        np.testing.assert_array_equal(a, b)  # run_round is pure: the caller's state is untouched
    assert info.rejected.tolist() == [1]
    assert all(np.isfinite(np.asarray(l)).all() for l in jax.tree.leaves(state.server_state))
    for a, b in zip(jax.tree.leaves(state.client_states), jax.tree.leaves(state0.client_states)):
        np.testing.assert_array_equal(a[1], b[1])  # the rejected client's state is unchanged
        assert not np.array_equal(np.delete(a, 1, axis=0), np.delete(b, 1, axis=0))  # the others moved
    # In place (donate=True, written device block by device block), the same states result, and
    # the accepted clients' rows are those of a plain per-client loop.
    donated, _ = sim_bad.run_round(sim_bad.init(params), donate=True)
    for a, b in zip(jax.tree.leaves(donated.client_states), jax.tree.leaves(state.client_states)):
        np.testing.assert_array_equal(a, b)
    _, cohort, ref_states, _ = plain_loop_round(sim_bad, sim_bad.init(params))
    for cid, ref in zip(cohort, ref_states):
        if cid != 1:
            for a, b in zip(jax.tree.leaves(jax.tree.map(lambda t: t[cid], donated.client_states)), jax.tree.leaves(ref)):
                np.testing.assert_allclose(a, np.asarray(b), atol=1e-5, rtol=1e-5)
    # the server equals a run in which client 1 had weight zero: ADMM keeps its old contribution
    sim_ok = Simulator(base, fed, clients_per_round=k, seed=0, layout=layout)
    ref_state, _ = sim_ok.run_round(sim_ok.init(params))
    assert not np.allclose(jax.tree.leaves(ref_state.server_state)[0], jax.tree.leaves(state.server_state)[0])
    sim_ff = Simulator(_poisoned(base, SIZES[1]), fed, clients_per_round=k, seed=0, layout=layout, fail_fast=True)
    with pytest.raises(RuntimeError, match=r"clients \[1\]"):
        sim_ff.run_round(sim_ff.init(params))


def test_invalid_arguments_raise_clear_errors():
    fed = digits_federation(SIZES)
    alg, params = _step_counter()
    with pytest.raises(ValueError, match="clients_per_round"):
        Simulator(alg, fed, clients_per_round=6)
    with pytest.raises(ValueError, match="weighting"):
        Simulator(alg, fed, clients_per_round=2, weighting="bogus")
    with pytest.raises(ValueError, match="layout"):
        Simulator(alg, fed, clients_per_round=2, layout="bogus")
    empty = Federation(fed.x, fed.y, (fed.client_indices[0], np.zeros(0, np.int64)))
    with pytest.raises(ValueError, match="at least one example"):
        Simulator(alg, empty, clients_per_round=1)


def test_a_scenario_checks_its_knobs_and_draws_failures_by_seed():
    with pytest.raises(ValueError, match=r"dropout must be in \[0, 1\)"):
        Scenario(dropout=1.0).check()
    with pytest.raises(ValueError, match="deadline must be >= 1"):
        Scenario(deadline=0).check()
    assert not Scenario().fails_clients and Scenario(deadline=3).fails_clients
    np.testing.assert_array_equal(Scenario(attackers=[1, 3]).attacker_mask(5), [False, True, False, True, False])
    cohort = np.arange(8)
    steps = lambda c: np.array([1, 2, 3, 4, 5, 6, 7, 8])[c]  # noqa: E731
    dropped, late = Scenario(dropout=0.5, deadline=4).failed_clients(3, 2, cohort, steps)
    again, _ = Scenario(dropout=0.5, deadline=4).failed_clients(3, 2, cohort, steps)
    np.testing.assert_array_equal(dropped, again)
    np.testing.assert_array_equal(dropped, protocol.dropout_rng(3, 2).random(8) < 0.5)
    np.testing.assert_array_equal(late, ~dropped & (steps(cohort) > 4))
    none = Scenario().failed_clients(3, 2, cohort, steps)
    assert not none[0].any() and not none[1].any()


def test_bytes_are_counted_from_message_shapes():
    fed = digits_federation(SIZES)
    _, params, trainer = logreg_setup()
    sim = Simulator(fedavg(trainer, optax.sgd(1.0)), fed, clients_per_round=3, seed=0)
    _, info = sim.run_round(sim.init(params))
    per = (64 * 10 + 10) * 4
    assert info.bytes_down == 3 * per and info.bytes_up == 3 * per


@pytest.mark.parametrize("layout", ["vmap", "sequential"])
def test_round_compiles_once_across_changing_cohorts(layout):
    fed = digits_federation(SIZES)
    _, params, trainer = logreg_setup(epochs=1)
    sim = Simulator(admm(trainer, optax.sgd(1.0), rho=0.1, num_clients=fed.num_clients), fed, clients_per_round=3, seed=0, layout=layout)
    state = sim.init(params)
    cohorts = set()
    for _ in range(4):
        state, info = sim.run_round(state)
        cohorts.add(tuple(info.cohort))
    assert len(cohorts) > 1
    # one compile per size class of the cohort's order buffer, not one per round
    assert sim.num_compiled_rounds() <= len({len(sim.gather(r, sim.layout_cohort(sim.sample_cohort(r)))[2]) for r in range(4)})


def test_device_assignment_is_balanced_with_a_fixed_shape():
    from fedbayes.sim.simulator import lpt_assign

    rng = np.random.default_rng(0)
    for _ in range(50):
        costs = rng.lognormal(5, 1.5, 10)
        groups = lpt_assign(costs, 2)
        assert sorted(sum(groups, [])) == list(range(10))
        assert [len(g) for g in groups] == [5, 5]  # the same shape every round
        loads = [costs[g].sum() for g in groups]
        # within the largest item of a perfect split (LPT's guarantee, with the slot cap)
        assert max(loads) - costs.sum() / 2 <= costs.max() + 1e-9


def test_round_compiler_options_keep_ynnpack_for_dots_only_on_cpu():
    # XLA:CPU's YNNPACK reductions over short axes were ~40x slower than XLA's loops (FedEP's
    # mean over its samples; docs/results/bench.md); the round keeps YNNPACK for dots only.
    from fedbayes.sim.simulator import round_compiler_options

    assert round_compiler_options("gpu") is None
    opts = round_compiler_options("cpu")
    assert opts is None or opts == {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"}


@pytest.mark.parametrize("layout", ["vmap", "sequential"])
def test_a_round_with_no_accepted_message_leaves_the_server_state(layout):
    """Nothing was learned: FedPA's round counter and its server optimizer's state (Adam's count
    and moments) stay as they were, in run_round and in the pipelined rounds (docs: the protocol's
    end of a round, fedbayes.protocol.finish_round)."""
    fed = digits_federation(SIZES)
    _, params, trainer = logreg_setup(epochs=2, batch_size=16)
    honest = fedpa(trainer, optax.adam(0.1), rho=0.5, burn_in_rounds=1)
    refuse = honest._replace(message_ok=lambda server_state, message: jnp.bool_(False))
    sim = Simulator(refuse, fed, clients_per_round=3, seed=0, layout=layout)
    state = sim.init(params)
    before = jax.tree.map(np.asarray, state.server_state)
    new, info = sim.run_round(state)
    assert sorted(info.rejected.tolist()) == sorted(info.cohort.tolist()) and info.server["num_accepted"] == 0
    assert new.round == 1
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(new.server_state)):
        np.testing.assert_array_equal(np.asarray(b), a)
    for streamed, _ in sim.rounds(sim.init(params), 3):
        for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(streamed.server_state)):
            np.testing.assert_array_equal(np.asarray(b), a)
    # The same round with the messages accepted moves the counter and the optimizer's state.
    sim_ok = Simulator(honest, fed, clients_per_round=3, seed=0, layout=layout)
    moved, _ = sim_ok.run_round(sim_ok.init(params))
    assert int(moved.server_state.round) == int(before.round) + 1
    assert not all(np.array_equal(np.asarray(b), a) for a, b in zip(jax.tree.leaves(before.opt_state), jax.tree.leaves(moved.server_state.opt_state)))


@pytest.mark.parametrize("layout", ["vmap", "sequential"])
def test_no_collective_runs_inside_a_client_loop(layout):
    """A vmap over a cohort sharded across devices turned each client loop's stopping test into an
    all-reduce; XLA:CPU ran it beside a collective that did not wait for the loops and, with as
    many threads as devices, deadlocked (aborted after 40 s on 2 cores). Both layouts split the
    cohort by hand, so the round's loops hold no cross-device collective."""
    import re

    assert len(jax.devices()) == 2  # tests run with two host devices (conftest)
    fed = digits_federation(SIZES)
    _, params, trainer = logreg_setup(epochs=2, batch_size=16)
    sim = Simulator(fedavg(trainer, optax.sgd(1.0)), fed, clients_per_round=4, seed=0, layout=layout)
    state = sim.init(params)
    hlo = jax.jit(sim.round_program).lower(state.server_state, (), *sim.prepare_round(0).args).compile().as_text()
    # One block per computation of the compiled module, by name.
    blocks = {m.group(1): m.group(0) for m in re.finditer(r"^%([\w.\-]+) \(.*?^}", hlo, re.M | re.S)}
    loops = re.findall(r"condition=%([\w.\-]+), body=%([\w.\-]+)", hlo)
    assert loops, "the round has client loops"
    collective = re.compile(r" (all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all)(-start)?\(")
    seen, todo = set(), [name for pair in loops for name in pair]
    while todo:  # the loops' computations and all they call (nested loops, fusions)
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        block = blocks[name]
        assert not collective.search(block), f"{layout}: a collective inside a client loop ({name})"
        todo.extend(re.findall(r"(?:calls|to_apply|condition|body)=%([\w.\-]+)", block))
    assert collective.search(hlo), "the server step sums over the devices"
