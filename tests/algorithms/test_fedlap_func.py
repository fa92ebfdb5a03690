"""FedLap-Func (Swaroop, Khan and Doshi-Velez, "Connecting Federated ADMM to Bayes", Sec. 3.4,
Eq. 17): memory sets, soft labels, the server's optimisation over the memory points, and the
method against FedLap (tau = 0 is FedLap bit for bit)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import digits_federation, logreg_setup

from fedbayes import protocol
from fedbayes.algorithms import fedlap_memory as memory
from fedbayes.data.batches import ClientData, layout_orders

SIZES = (37, 90, 213, 11, 150)


def _first_epoch_data(fed, cid, round_idx=0, seed=3, epochs=2):
    ix = fed.client_indices[cid]
    order, offsets, _ = layout_orders(seed, round_idx, [cid], [ix], epochs, 16)
    return ClientData(jnp.asarray(fed.x), jnp.asarray(fed.y), jnp.asarray(order), jnp.int32(offsets[0]), jnp.int32(len(ix)))


@pytest.mark.parametrize("m", [1, 2])
def test_memory_is_the_first_m_examples_of_each_class_in_the_first_epoch_shuffle(m):
    fed = digits_federation(SIZES)
    cid, round_idx, seed = 3, 4, 3  # client 3 has 11 examples: some classes are missing
    positions, weights = jax.jit(memory.select_memory, static_argnums=(1, 2))(_first_epoch_data(fed, cid, round_idx, seed), 10, m)
    # The reference, from the client's NumPy shuffle stream of that round.
    ix = fed.client_indices[cid]
    perm = protocol.shuffle_rng(seed, round_idx, cid).permutation(ix)
    labels = fed.y[ix]
    for c in range(10):
        chosen = [p for p in perm if fed.y[p] == c][:m]
        n_c = int(np.sum(labels == c))
        for j in range(m):
            slot = c * m + j
            if j < len(chosen):
                assert positions[slot] == chosen[j] and fed.y[positions[slot]] == c
                assert weights[slot] == pytest.approx(n_c / min(m, n_c))
            else:
                assert weights[slot] == 0.0
    # The weights of a class add up to its count: tau_x stands for the class's examples.
    assert float(jnp.sum(weights)) == pytest.approx(len(ix))


def test_function_space_loss_is_the_weighted_soft_cross_entropy():
    model, params, _ = logreg_setup()
    apply_fn = lambda p, x: model.apply({"params": p}, x)  # noqa: E731
    fed = digits_federation(SIZES)
    x = jnp.asarray(fed.x[:4])
    w = jnp.asarray([2.0, 0.0, 1.0, 0.5])
    t = jax.nn.softmax(jax.random.normal(jax.random.key(0), (4, 10)))
    got = memory.function_space_loss(apply_fn, params, x, w, t)
    log_p = jax.nn.log_softmax(apply_fn(params, x))
    want = sum(-float(w[i]) * float(jnp.sum(t[i] * log_p[i])) for i in range(4))
    assert float(got) == pytest.approx(want, rel=1e-5)
    # At its own soft labels the cross-entropy is stationary (zero gradient): the paper's
    # argument that the function-space terms vanish at a fixed point.
    own = memory.soft_labels(apply_fn, params, x)
    g = jax.grad(lambda p: memory.function_space_loss(apply_fn, p, x, w, own))(params)
    assert max(float(jnp.max(jnp.abs(a))) for a in jax.tree.leaves(g)) < 1e-6


def _memory_of(apply_fn, params, fed, cids, tau_key):
    inputs = jnp.asarray(np.concatenate([fed.x[fed.client_indices[c][:10]] for c in cids]))
    weights = jnp.ones((inputs.shape[0],), jnp.float32)
    labels = jax.nn.softmax(3.0 * jax.random.normal(tau_key, (inputs.shape[0], 10)))
    return memory.Memory(inputs, weights, labels)


def test_server_optimisation_with_tau_zero_returns_the_anchor_bit_for_bit():
    model, params, _ = logreg_setup()
    apply_fn = lambda p, x: model.apply({"params": p}, x)  # noqa: E731
    mem = _memory_of(apply_fn, params, digits_federation(SIZES), [0, 1], jax.random.key(1))
    anchor = jax.tree.map(lambda a: a + 0.3, params)
    w, _ = jax.jit(lambda a, m: memory.optimise_global(apply_fn, a, m, delta=2.0, tau=0.0, steps=50, lr=1e-2))(anchor, mem)
    for a, b in zip(jax.tree.leaves(w), jax.tree.leaves(anchor)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_server_optimisation_reaches_the_minimiser_of_eq_17():
    model, params, _ = logreg_setup()
    apply_fn = lambda p, x: model.apply({"params": p}, x)  # noqa: E731
    mem = _memory_of(apply_fn, params, digits_federation(SIZES), [0, 1], jax.random.key(1))
    delta, tau = 5.0, 0.5
    w, info = jax.jit(lambda a, m: memory.optimise_global(apply_fn, a, m, delta=delta, tau=tau, steps=3000, lr=1e-2))(params, mem)

    def objective(p):
        d = jax.tree.map(jnp.subtract, p, params)
        return 0.5 * delta * sum(jnp.sum(x * x) for x in jax.tree.leaves(d)) + tau * memory.function_space_loss(apply_fn, p, *mem)

    g = jax.grad(objective)(w)
    g0 = jax.grad(objective)(params)
    gnorm = lambda t: float(jnp.sqrt(sum(jnp.sum(x * x) for x in jax.tree.leaves(t))))  # noqa: E731
    # 1e-2: Adam at a fixed learning rate hovers near the minimiser
    assert gnorm(g) < 1e-2 * gnorm(g0)
    assert float(objective(w)) < float(objective(params))
    assert float(info["server_fn_loss"]) < float(memory.function_space_loss(apply_fn, params, *mem))


# ----- the method ---------------------------------------------------------------------------------
import importlib  # noqa: E402

from typer.testing import CliRunner  # noqa: E402

from fedbayes import tree  # noqa: E402
from fedbayes.cli import app  # noqa: E402
from fedbayes.runs.folder import read_metrics  # noqa: E402
from fedbayes.sim.simulator import Simulator  # noqa: E402

# The modules, not the factories that fedbayes.algorithms re-exports under the same names.
func = importlib.import_module("fedbayes.algorithms.fedlap_func")
fedlap_module = importlib.import_module("fedbayes.algorithms.fedlap")
FEATURES = jax.ShapeDtypeStruct((8, 8, 1), np.float32)
SEED, ROUNDS, COHORT = 3, 4, 3


def _run(sim, params, rounds=ROUNDS):
    state = sim.init(params)
    states, infos = [state], []
    for _ in range(rounds):
        state, info = sim.run_round(state)
        states.append(state)
        infos.append(info)
    return states, infos


@pytest.fixture(scope="module")
def runs():
    """FedLap and FedLap-Func (tau = 0 and tau = 1), 3 of 5 clients a round, 4 rounds, one seed."""
    fed = digits_federation(SIZES)
    model, params, trainer = logreg_setup(epochs=2, batch_size=16)
    apply_fn = lambda p, x: model.apply({"params": p}, x)  # noqa: E731
    algs = {
        "fedlap": fedlap_module.fedlap(trainer, delta=5.0, damping=0.2),
        **{tau: func.fedlap_func(trainer, apply_fn, FEATURES, delta=5.0, damping=0.2, tau=tau, server_steps=20, server_lr=1e-2) for tau in (0.0, 1.0)},
    }
    return fed, {k: _run(Simulator(a, fed, clients_per_round=COHORT, seed=SEED), params) for k, a in algs.items()}


def _assert_equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_tau_zero_is_fedlap_bit_for_bit(runs):
    _, r = runs
    for lap_state, func_state in zip(r["fedlap"][0], r[0.0][0]):
        _assert_equal(func_state.server_state.lap, lap_state.server_state)
        _assert_equal(func_state.server_state.params, lap_state.server_state.params)
        _assert_equal(func_state.client_states.site, lap_state.client_states)
    # ... and yet memory was drawn and the server optimised over it (the comparison is not vacuous).
    assert all(info.server["memory_points"] > 0 for info in r[0.0][1])


def test_tau_positive_changes_the_result(runs):
    _, r = runs
    lap_w, func_w = r["fedlap"][0][-1].server_state.params, r[1.0][0][-1].server_state.params
    assert max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in zip(jax.tree.leaves(lap_w), jax.tree.leaves(func_w))) > 1e-3
    # the server moved w_g away from FedLap's sum of sites towards the soft labels
    final = r[1.0][0][-1].server_state
    assert any(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) > 1e-3 for a, b in zip(jax.tree.leaves(final.params), jax.tree.leaves(final.lap.params)))


def test_memory_sets_are_drawn_once_from_the_seeded_shuffle_of_the_first_round(runs):
    fed, r = runs
    states, infos = r[1.0]
    first = {}
    for info in infos:
        for cid in info.cohort:
            first.setdefault(int(cid), info.round)
    assert len(first) < len(SIZES) or len({i.round for i in infos}) > 1
    for cid in range(len(SIZES)):
        memories = [jax.tree.map(lambda a: np.asarray(a)[cid], s.client_states.memory) for s in states]
        if cid not in first:
            assert np.all(memories[-1].weights == 0)
            continue
        # the reference: the first example of each class in the client's first-epoch shuffle
        ix = fed.client_indices[cid]
        perm = protocol.shuffle_rng(SEED, first[cid], cid).permutation(ix)
        for c in range(10):
            chosen = [p for p in perm if fed.y[p] == c][:1]
            if chosen:
                np.testing.assert_array_equal(memories[-1].inputs[c], fed.x[chosen[0]])
                assert memories[-1].weights[c] == np.sum(fed.y[ix] == c)
            else:
                assert memories[-1].weights[c] == 0 and not np.any(memories[-1].inputs[c])
        # kept from then on, whatever rounds followed
        for m in memories[first[cid] + 1 :]:
            np.testing.assert_array_equal(m.inputs, memories[-1].inputs)
            np.testing.assert_array_equal(m.weights, memories[-1].weights)
    # the same seed draws the same memory whatever tau is
    _assert_equal(r[0.0][0][-1].client_states.memory.inputs, states[-1].client_states.memory.inputs)


def test_bytes_count_the_memory_points_and_soft_labels(runs):
    _, r = runs
    slots, classes = 10, 10  # one point per class
    lap_info, func_info = r["fedlap"][1][0], r[1.0][1][0]
    per_client_up = slots * (8 * 8 * 1 + 1 + classes) * 4  # points, tau_x, soft labels (float32)
    assert func_info.bytes_up - lap_info.bytes_up == COHORT * per_client_up
    assert func_info.bytes_down - lap_info.bytes_down == COHORT * 4  # the round index
    site = tree.tree_bytes(r["fedlap"][0][0].server_state.params)
    assert lap_info.bytes_up == COHORT * site


def test_cli_run_writes_metrics_and_the_model(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text(
        'name = "lapfunc"\nrounds = 2\ncheckpoint_every = 0\n[data]\ndataset = "digits"\nnum_clients = 4\n'
        'partition = "dirichlet"\nalpha = 0.5\n[model]\nname = "logreg"\n[client]\nlr = 0.1\nbatch_size = 16\n'
        '[server]\nclients_per_round = 4\n[algorithm]\nname = "fedlap_func"\ndelta = 5.0\ntau = 0.5\nserver_steps = 10\n'
    )
    out = tmp_path / "out"
    res = CliRunner().invoke(app, ["run", str(config), "--out", str(out)])
    assert res.exit_code == 0, res.output
    recs = read_metrics(out / "metrics.jsonl")
    assert [r["round"] for r in recs] == [0, 1, 2] and np.isfinite(recs[-1]["accuracy"])
    assert recs[-1]["bytes_up"] > 0 and recs[-1]["bytes_down"] > 0
    model = np.load(out / "model.npz")
    assert {"params/dense/kernel", "params/dense/bias"} <= set(model.files)

    # bad settings: one line naming the field, before any work
    bad = (("algorithm.tau=-1", "algorithm.tau"), ("algorithm.memory_per_class=0", "algorithm.memory_per_class"), ("server.optimizer=adam", "server.optimizer"))
    for override, needle in bad:
        res = CliRunner().invoke(app, ["run", str(config), "--out", str(tmp_path / "bad"), "--set", override])
        lines = [line for line in res.output.splitlines() if line.strip()]
        assert res.exit_code == 2 and len(lines) == 1 and needle in lines[0], res.output


def test_old_soft_labels_are_subtracted_only_when_the_server_saw_them(runs):
    """Choice 3: the site's function-space part is taken out of the cavity only if the client's
    message was accepted in the previous round (the server's memory is the round's)."""
    fed, r = runs
    model, params, trainer = logreg_setup(epochs=1, batch_size=16)
    apply_fn = lambda p, x: model.apply({"params": p}, x)  # noqa: E731
    alg = func.fedlap_func(trainer, apply_fn, FEATURES, delta=5.0, damping=0.2, tau=1.0, server_steps=0)
    states = r[1.0][0]
    cid = int(r[1.0][1][0].cohort[0])  # drew its memory in round 0
    state = jax.tree.map(lambda a: np.asarray(a)[cid], states[1].client_states)
    message = alg.broadcast(states[1].server_state)
    data = _first_epoch_data(fed, cid, 1, SEED, epochs=1)
    update = jax.jit(alg.client_update)
    key = protocol.client_key(SEED, 1, cid)

    def at_round(s, round_idx):
        return update(key, message._replace(round=jnp.int32(round_idx)), s, data)[0]

    forgotten = state._replace(memory=state.memory._replace(soft_labels=jnp.zeros_like(state.memory.soft_labels)))
    assert int(state.last_round) == 0
    _assert_equal(at_round(state, 2), at_round(forgotten, 2))  # sat out round 1: nothing subtracted
    seen, unseen = at_round(state, 1), at_round(forgotten, 1)  # accepted in round 0: subtracted
    assert (
        max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in zip(jax.tree.leaves(seen.site_change), jax.tree.leaves(unseen.site_change))) > 1e-6
    )


def test_the_server_on_one_device_equals_the_server_in_the_rounds_program_and_pipelines_bitwise():
    """FedLap-Func (tau > 0) runs its server step as a program of its own on the first device
    (Algorithm.server_on_one_device): to float rounding the same rounds as with the server step
    split over the devices in the round's program; pipelined (Simulator.rounds), bitwise those of
    run_round; with the client states in device memory too."""
    fed = digits_federation(SIZES)
    model, params, trainer = logreg_setup(epochs=2, batch_size=16)
    apply_fn = lambda p, x: model.apply({"params": p}, x)  # noqa: E731
    alg = func.fedlap_func(trainer, apply_fn, FEATURES, delta=5.0, damping=0.2, tau=1.0, server_steps=20, server_lr=1e-2)
    assert alg.server_on_one_device and not func.fedlap_func(trainer, apply_fn, FEATURES, delta=5.0, damping=0.2, tau=0.0).server_on_one_device
    apart = Simulator(alg, fed, clients_per_round=COHORT, seed=SEED)
    assert apart.server_apart and apart.num_devices == 2
    inside = Simulator(alg._replace(server_on_one_device=False), fed, clients_per_round=COHORT, seed=SEED)
    assert not inside.server_apart
    looped, _ = _run(apart, params)
    for a, b in zip(looped, _run(inside, params)[0]):
        for x, y in zip(jax.tree.leaves(a.server_state), jax.tree.leaves(b.server_state), strict=True):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)
    on_device = Simulator(alg, fed, clients_per_round=COHORT, seed=SEED, store="device")
    for sim in (apart, on_device):
        seen = 0
        # compared as yielded (the next round reuses a memory store); a device store not donated
        for a, (b, _) in zip(looped[1:], sim.rounds(sim.init(params), ROUNDS, donate=sim is apart), strict=True):
            _assert_equal(a.server_state, b.server_state)
            _assert_equal(a.client_states, jax.device_get(b.client_states))
            seen += 1
        assert seen == ROUNDS
