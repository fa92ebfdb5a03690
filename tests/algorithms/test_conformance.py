"""One conformance suite over every registered algorithm (as optax's common tests do for its
transformations): a method gets these tests by being in the registry.

For each method, on a small digits federation with unequal clients and a logistic regression (the
dense variants on the same digits pooled to 4 x 4 pixels, DENSE_VARIANTS):
the simulator's cohort (both layouts) equals a plain per-client loop through the public round
protocol; a killed-and-resumed run equals an uninterrupted one bit for bit; a NaN message is
rejected, its client keeps its state and the server equals the round without it; a fixed cohort
shape compiles the round once; the info outputs have the documented structure; and the method
builds and runs from a config (config -> build -> a round -> its evaluation, the marginalised
metrics included when it has a posterior), so a method that passes the suite runs from a file.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import digits_federation, jitted_server_step, logreg_setup, plain_loop_round, single_client_data

from fedbayes import gaussian_kron, protocol, tree
from fedbayes.algorithms import registry
from fedbayes.algorithms.base import Algorithm, AlgorithmSpec, BuildContext, FederationInfo
from fedbayes.algorithms.fedavg import fedavg
from fedbayes.algorithms.fedlap_cov import KronSite
from fedbayes.config.schema import validate
from fedbayes.data.federation import Federation
from fedbayes.gaussian_kron import KronFrame
from fedbayes.hparams import HParams
from fedbayes.inference.vi_natural import NATURAL_MIN_STEPS, NATURAL_PASSES
from fedbayes.models import has_hidden_layers, init_params, loss_fn, make_model
from fedbayes.models.variational import apply_with_key
from fedbayes.runs.build import build_experiment
from fedbayes.runs.checkpoint import load_checkpoint, save_checkpoint
from fedbayes.sim.simulator import Simulator, client_data_template

SIZES = (37, 90, 213, 11, 150)
# Cohorts of 3 of the 5 clients: [0, 1, 4], [0, 2, 3], [1, 3, 4] in the first three rounds, whose
# batch buffers (2 epochs of each client's examples) fall in one size class, so every test runs one
# round program per layout (compiled once, XLA's persistent cache serving the other tests).
SEED = 23


# A new method, added in a dozen lines: settings, builder, a spec. Registered, it gets the suite.
class HalfStepConfig(HParams):
    """FedAvg whose server moves half way to the clients' average."""

    name: Literal["half_step"] = "half_step"


def _build_half_step(hp: HalfStepConfig, ctx: BuildContext) -> Algorithm:
    return fedavg(ctx.trainer, optax.sgd(0.5))._replace(name="half_step")


HALF_STEP = AlgorithmSpec("half_step", HalfStepConfig, _build_half_step, "test method")
# A method's setting that changes what its states and messages are runs the suite as a variant of its own:
# "<name>+<label>" -> (name, settings).
VARIANTS = {
    "fedep+full": ("fedep", {"covariance": "full"}),
    # one draw (pair) and a few iterations of the natural client: the suite checks the protocol, not the posterior
    "pvi+full": ("pvi", {"covariance": "full", "samples": 1, "natural_steps": 4}),
    # one antithetic pair per step (the default is four): the suite checks the protocol, not the posterior
    "pvi+natural": ("pvi", {"local_vi": "natural", "samples": 2}),
    "fedep+ngvi_full": ("fedep", {"covariance": "full", "method": "ngvi", "ngvi_samples": 1, "natural_steps": 4}),
    "fedsep+ngvi_full": ("fedsep", {"covariance": "full", "method": "ngvi", "ngvi_samples": 1, "natural_steps": 4}),
    "fedlap_cov+full": ("fedlap_cov", {"covariance": "full"}),
    "fedlap_cov+last_layer": ("fedlap_cov", {"covariance": "last_layer"}),
    "fedep+last_layer": ("fedep", {"covariance": "last_layer"}),
    # two basis rounds: the suite's three rounds cross the step where the basis is fixed
    "fedlap_cov+low_rank": ("fedlap_cov", {"covariance": "low_rank", "rank": 4, "basis_rounds": 2}),
    # two basis rounds: the suite's three rounds cross the step where the Kronecker bases are fixed
    "fedlap_cov+kron": ("fedlap_cov", {"covariance": "kron", "basis_rounds": 2}),
    "fedep+kron": ("fedep", {"covariance": "kron", "basis_rounds": 2}),
    "fedep+low_rank": ("fedep", {"covariance": "low_rank", "rank": 4, "basis_rounds": 2}),
    # the sampler at its smallest (10 warm-up transitions, 4 draws, trees of at most 8 steps): the
    # defaults (500 and 1000, trees of up to 1024 steps) are for a posterior; the suite checks the protocol
    "fedep+nuts": ("fedep", {"covariance": "full", "method": "nuts", "nuts_warmup": 10, "nuts_draws": 4, "nuts_curvature_draws": 2, "nuts_max_doublings": 3}),
    # the linear variational model: its default client is IVON with one whole-data step an epoch
    # (the network's is Bayes-by-backprop); 4 draws a step instead of 64: the suite checks the protocol
    "vbnn+linear": ("vbnn", {"ivon_samples": 4}),
}
NAMES = (*registry.names(), HALF_STEP.name, *VARIANTS)
# hidden widths of the variational MLP a variational method runs on (default: one hidden layer of 8)
VARIATIONAL_HIDDEN = {"vbnn+linear": ()}
# Variants with a dense [D, D] precision run on digits pooled to 4 x 4 pixels (D = 170 rather than
# 650 for the logistic regression): the suite checks the protocol, and a dense client's
# curvature, natural-gradient and sampler steps cost O(D^2) to O(D^3) per step.
DENSE_VARIANTS = ("fedep+full", "pvi+full", "fedep+ngvi_full", "fedsep+ngvi_full", "fedlap_cov+full", "fedep+nuts")
# variants whose structure needs a network (hidden widths of the MLP they run on): a last layer and other layers
NETWORK_VARIANTS = {
    "fedlap_cov+last_layer": (8,),
    "fedep+last_layer": (8,),
    "fedlap_cov+low_rank": (8,),
    "fedlap_cov+kron": (8,),
    "fedep+kron": (8,),
    "fedep+low_rank": (8,),
}
# PVI's dense message inverts its Cholesky factor in float32: a rounding difference between two
# compilations of the same client grows by that factor's condition number (digits' constant pixels
# keep the prior's variance beside well-determined weights)
# the Kronecker structures' dense precision, rebuilt from float32 eigenbases, differs between the
# cohort and the plain loop by op fusion: 1.8e-5 in 2 of 610^2 entries of a matrix whose diagonal is
# about 5 (measured on an AMD Zen 4 CPU; within 1e-5 on the machines of earlier runs)
COHORT_TOLERANCE = {"pvi+full": 1e-4, "fedlap_cov+kron": 1e-4, "fedep+kron": 1e-4}
# NUTS in the vmap layout: the batched sampler rounds in float32 unlike one client alone, and the
# leapfrog trajectories and the warm-up's adapted step size carry that difference (measured, on the
# global: 3.6e-5 on the pooled digits it runs on, 1.5e-4 on the 8 x 8 ones, against 0.2-2 between
# two client keys there); the sequential layout runs each
# client as the plain loop does and agrees to COHORT_TOLERANCE (bit for bit on CPU)
VMAP_TOLERANCE = {"fedep+nuts": 1e-3}


def _method(name: str) -> tuple[str, dict]:
    """``(registered name, settings)`` of a suite entry (a method, or a variant of one)."""
    return VARIANTS.get(name, (name, {}))


@pytest.fixture(autouse=True, scope="module")
def _half_step_registered():
    """The test method is in the registry while this module's tests run, and only then."""
    registry.register(HALF_STEP)
    yield
    registry.unregister(HALF_STEP.name)


def _federation(name: str) -> Federation:
    """The suite's digits clients; for a dense variant, with each 2 x 2 block of pixels averaged."""
    fed = digits_federation(SIZES)
    if name not in DENSE_VARIANTS:
        return fed
    x = fed.x.reshape(-1, 4, 2, 4, 2, 1).mean(axis=(2, 4))
    return Federation(x, fed.y, fed.client_indices)


def _simulator(name: str, *, layout="sequential", clients_per_round=3, algorithm=None):
    fed = _federation(name)
    model, params, trainer = logreg_setup(epochs=2, batch_size=16)
    if name in DENSE_VARIANTS:
        params = init_params(model, jax.random.key(1), fed.x.shape[1:])
    keyed = None
    if name in NETWORK_VARIANTS:
        model = make_model("mlp", 10, hidden=NETWORK_VARIANTS[name])
        params = init_params(model, jax.random.key(1), (8, 8, 1))
        trainer = trainer._replace(loss_fn=loss_fn(model, "classification"))
    hidden = VARIATIONAL_HIDDEN.get(name, (8,))
    name, settings = _method(name)
    spec = registry.get(name)
    if spec.needs_variational_model:
        model = make_model("mlp", 10, variational=True, hidden=hidden)
        params = init_params(model, jax.random.key(1), (8, 8, 1))
        keyed = apply_with_key(model)
    ctx = BuildContext(
        trainer, optax.sgd(1.0), FederationInfo.from_sizes(fed.sizes), clients_per_round,
        apply_fn=lambda p, x: model.apply({"params": p}, x), keyed_apply_fn=keyed,
        feature_spec=jax.ShapeDtypeStruct(fed.x.shape[1:], fed.x.dtype), hidden_layers=has_hidden_layers(params),
    )  # fmt: skip
    alg = algorithm or spec.build(spec.hparams(name=name, **settings), ctx)
    return Simulator(alg, fed, clients_per_round=clients_per_round, seed=SEED, layout=layout), params


def _close(a, b, tol=1e-5):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=tol, rtol=tol)


def _equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _basis_free(server, client=None):
    """The Kronecker structure's states with each precision as its dense matrix and no bases: the
    bases are eigenvectors, whose order and signs within a cluster of eigenvalues equal to round-off
    (digits' constant pixels give the input factor a null space) follow the summation order of the
    cohort's factors; the precisions they describe do not. Other states pass unchanged."""
    frame = getattr(server, "basis", None)
    if not isinstance(frame, KronFrame):
        return server, client

    def dense(g, b):
        return gaussian_kron.KronGaussian(g.precision_mean, gaussian_kron.in_bases(b).precision_matrix(g.precision))

    server = server._replace(q=dense(server.q, frame.bases), basis=frame.anchor)
    if client is not None:  # FedLap-Cov's KronSite, or FedEP's ClientState
        factor = client.factor if isinstance(client, KronSite) else client.site
        b = frame.bases if int(client.fixed) else gaussian_kron.identity_bases(factor.precision)
        client = KronSite(dense(factor, b), client.fixed) if isinstance(client, KronSite) else client._replace(site=dense(factor, b))
    return server, client


@pytest.mark.parametrize("layout", ["sequential", "vmap"])
@pytest.mark.parametrize("name", NAMES)
def test_cohort_equals_a_plain_per_client_loop(name, layout):
    sim, params = _simulator(name, layout=layout)
    state = sim.init(params)
    for _ in range(2):  # server optimizer and client states carry over
        ref_server, cohort, ref_states, ref_ok = plain_loop_round(sim, state)
        state, info = sim.run_round(state)
        np.testing.assert_array_equal(info.cohort, cohort)
        assert ref_ok.all() and len(info.rejected) == 0
        # 1e-5: the sequential layout sums on two devices (reassociation, docs/design.md)
        tol = VMAP_TOLERANCE[name] if layout == "vmap" and name in VMAP_TOLERANCE else COHORT_TOLERANCE.get(name, 1e-5)
        _close(_basis_free(state.server_state)[0], _basis_free(ref_server)[0], tol)
        for cid, ref in zip(cohort, ref_states):
            _close(_basis_free(state.server_state, jax.tree.map(lambda s: s[cid], state.client_states))[1], _basis_free(ref_server, ref)[1], tol)


@pytest.mark.parametrize("name", NAMES)
def test_resume_from_a_checkpoint_is_exact(name, tmp_path):
    sim, params = _simulator(name)
    straight = sim.init(params)
    for _ in range(3):
        straight, _ = sim.run_round(straight)
    broken = sim.init(params)
    broken, _ = sim.run_round(broken)
    path = save_checkpoint(tmp_path, broken, {"counters": {}})
    fresh, _ = _simulator(name)
    resumed, _ = load_checkpoint(path, fresh.init(params))
    resumed = resumed._replace(server_state=fresh.place(resumed.server_state))
    for _ in range(2):
        resumed, _ = fresh.run_round(resumed)
    assert resumed.round == straight.round == 3
    _equal(resumed.server_state, straight.server_state)
    _equal(resumed.client_states, straight.client_states)


def _poison(update, bad_size):
    """The client of ``bad_size`` examples sends NaN in every floating leaf."""

    def client_update(key, message, state, data):
        m, s, info = update(key, message, state, data)
        bad = data.num_examples == bad_size
        m = jax.tree.map(lambda a: jax.numpy.where(bad, jax.numpy.nan, a) if jax.numpy.issubdtype(a.dtype, jax.numpy.inexact) else a, m)
        return m, s, info

    return client_update


@pytest.mark.parametrize("name", NAMES)
def test_a_nan_message_is_rejected_and_changes_nothing(name):
    # the suite's cohort shape and layout (3 of 5, sequential), so the honest round is the program the
    # other tests compiled (XLA's persistent cache); client 1 is in the first round's cohort
    honest, params = _simulator(name)
    bad_cid = 1
    alg = honest.algorithm._replace(client_update=_poison(honest.algorithm.client_update, SIZES[bad_cid]))
    sim, _ = _simulator(name, algorithm=alg)
    state0 = sim.init(params)
    before = jax.tree.map(np.copy, state0.client_states)
    state, info = sim.run_round(state0)
    cohort = protocol.sample_cohort(honest.seed, 0, len(SIZES), honest.clients_per_round)
    np.testing.assert_array_equal(info.cohort, cohort)
    bad = list(cohort).index(bad_cid)
    assert info.rejected.tolist() == [bad_cid]
    assert not info.clients["accepted"][bad] and info.clients["accepted"].sum() == len(cohort) - 1
    for a, b in zip(jax.tree.leaves(state.client_states), jax.tree.leaves(before)):
        np.testing.assert_array_equal(a[bad_cid], b[bad_cid])  # the rejected client keeps its state
    assert tree.all_finite(state.server_state)
    # The server equals the honest round with the bad client's weight set to zero.
    update = jax.jit(honest.algorithm.client_update)
    msgs = []
    for cid in cohort:
        m, _, _ = update(
            protocol.client_key(honest.seed, 0, int(cid)), honest.algorithm.broadcast(state0.server_state),
            jax.tree.map(lambda a: a[cid], state0.client_states), single_client_data(honest, 0, cid),
        )  # fmt: skip
        msgs.append(m)
    w = protocol.client_weights(honest.sizes[cohort], honest.weighting)
    w[bad] = 0.0
    expected, ok, _ = jitted_server_step(honest.algorithm)(protocol.server_key(honest.seed, 0), state0.server_state, tree.stack(msgs), jax.numpy.asarray(w))
    assert not bool(ok[bad])
    _close(state.server_state, expected)


def _steps(name: str, sizes: np.ndarray) -> np.ndarray:
    """The ``steps`` each client of ``sizes`` examples reports in the suite's setting."""
    settings = _method(name)[1]
    if settings.get("method") == "nuts":  # fedbayes.inference.nuts: warm-up plus kept draws
        return np.full(len(sizes), settings["nuts_warmup"] + settings["nuts_draws"])
    if settings.get("covariance") == "full" and (settings.get("method") == "ngvi" or _method(name)[0] == "pvi"):
        return np.full(len(sizes), settings["natural_steps"])  # fedbayes.inference.vi_full.natural_full_vi: its iterations
    if settings.get("local_vi") == "natural":  # fedbayes.inference.vi_natural.natural_diag_vi: its passes, at least its minimum
        return np.maximum(NATURAL_PASSES * -(-sizes // 16), NATURAL_MIN_STEPS)
    if name in VARIATIONAL_HIDDEN and not VARIATIONAL_HIDDEN[name]:  # the VBNN's IVON client on a linear model: one whole-data step an epoch
        return np.full(len(sizes), 2)
    return 2 * -(-sizes // 16)


@pytest.mark.parametrize("name", NAMES)
def test_info_outputs_and_a_fixed_cohort_shape_compiles_the_round_once(name):
    # cohorts of one size whose buffers have one size class (SEED)
    sim, params = _simulator(name)
    state, info = sim.run_round(sim.init(params))
    c = info.clients
    assert set(c) >= {"client", "num_examples", "accepted", "loss", "steps"}
    np.testing.assert_array_equal(c["client"], info.cohort)
    np.testing.assert_array_equal(c["num_examples"], np.asarray(SIZES)[info.cohort])
    # every client took E * ceil(n_k / B) steps (E = 2, B = 16), the sampler's transitions (warm-up
    # and draws) or the natural-gradient iterations, whatever its size, and reports a finite, positive loss
    np.testing.assert_array_equal(c["steps"], _steps(name, np.asarray(SIZES)[info.cohort]))
    assert np.all(np.isfinite(c["loss"])) and np.all(c["loss"] > 0)
    assert info.server["num_accepted"] == len(info.cohort)
    assert all(np.isscalar(v) for v in info.server.values())
    for _ in range(2):
        state, _ = sim.run_round(state)
    assert sim.num_compiled_rounds() == 1


@pytest.mark.parametrize("name", NAMES)
def test_the_server_info_is_a_typed_named_tuple_of_scalars(name):
    """As blackjax's kernels: a method's server update returns one NamedTuple type (``...Info``) of
    scalar arrays, whose fields the round records as its server metrics."""
    sim, params = _simulator(name)
    alg, fed = sim.algorithm, _federation(name)
    data = client_data_template(fed.x.shape[1:], fed.x.dtype, fed.y.dtype, epochs=alg.local_epochs, batch_size=alg.local_batch_size, y_shape=fed.y.shape[1:])
    message = protocol.message_templates(alg, params, data).message
    state = jax.eval_shape(alg.server_init, jax.random.key(0), params)
    messages = jax.tree.map(lambda s: jax.ShapeDtypeStruct((3, *s.shape), s.dtype), message)

    def update(state, messages, weights):
        return alg.server_update(jax.random.key(1), state, alg.aggregator(jax.random.key(0), messages, weights))

    _, info = jax.eval_shape(update, state, messages, jax.ShapeDtypeStruct((3,), jnp.float32))
    assert isinstance(info, tuple) and type(info).__name__.endswith("Info"), type(info)
    assert all(leaf.shape == () for leaf in jax.tree.leaves(info))


def _config(name: str):
    """A small digits run of ``name`` with its default settings (a variant's own), as a config file would give it."""
    network = NETWORK_VARIANTS.get(name)
    hidden = list(VARIATIONAL_HIDDEN.get(name, (8,)))
    name, settings = _method(name)
    spec = registry.get(name)
    model = {"name": "mlp", "hidden": hidden, "variational": True} if spec.needs_variational_model else {"name": "logreg"}
    if network is not None:
        model = {"name": "mlp", "hidden": list(network)}
    epochs = max(2, spec.min_local_epochs(spec.hparams(name=name))[0])
    return validate({
        "name": name, "rounds": 1, "algorithm": {"name": name, **settings}, "model": model, "evaluation": {"marginal_samples": 2},
        "data": {"dataset": "digits", "num_clients": len(SIZES)}, "server": {"clients_per_round": 3},
        "client": {"epochs": epochs, "batch_size": 16},
    })  # fmt: skip


@pytest.mark.parametrize("name", NAMES)
def test_the_method_builds_and_runs_from_a_config(name):
    exp = build_experiment(_config(name))
    sim = exp.simulator
    assert sim.algorithm.name == _method(name)[0]
    state, info = sim.run_round(sim.init(exp.params))
    assert len(info.rejected) == 0 and tree.all_finite(state.server_state)
    metrics = exp.evaluate(state.server_state, 1)
    assert np.isfinite(metrics["accuracy"]) and np.isfinite(metrics["nll"])
    if sim.algorithm.server_posterior is not None:  # a Bayesian method's marginalised metrics, from [evaluation]
        assert all(np.isfinite(metrics[k]) for k in ("accuracy_marg", "nll_marg", "ece_marg")), metrics


def test_registry_lists_the_builtin_methods_and_rejects_duplicates():
    assert {"fedavg", "fedprox", "feddyn", "admm", "fedpa", "fedep", "fedsep", "vbnn"} <= set(registry.names())
    with pytest.raises(ValueError, match="already registered"):
        registry.register(registry.get("fedavg"))
    with pytest.raises(ValueError, match="unknown algorithm 'nope'; allowed: fedavg"):
        registry.get("nope")


def test_an_algorithm_without_its_trainer_fails_at_construction():
    """The local schedule has no default (one epoch of batch 1 would train silently): a method that
    forgets ``trainer`` fails when it builds its ``Algorithm``; given it, the schedule is the trainer's."""
    fns = dict(server_init=None, broadcast=None, client_init=None, client_update=None, server_update=None, server_params=None, message_ok=None)
    with pytest.raises(TypeError, match="trainer"):
        Algorithm(name="forgetful", **fns)
    _, _, trainer = logreg_setup(epochs=3, batch_size=7)
    alg = Algorithm(name="scheduled", **fns, trainer=trainer)
    assert (alg.local_epochs, alg.local_batch_size) == (3, 7)
