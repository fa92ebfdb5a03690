"""The site machinery (fedbayes.algorithms.sites): the Gaussian message and its check, the damped
difference, the server step with its positivity guard, and the burn-in switch."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedbayes import gaussian
from fedbayes.algorithms import sites
from fedbayes.gaussian import DiagGaussian


def _g(eta, lam):
    return DiagGaussian(precision_mean={"w": jnp.asarray(eta, jnp.float32)}, precision={"w": jnp.asarray(lam, jnp.float32)})


def test_gaussian_message_ok_checks_finiteness_the_flag_and_the_global_precision():
    q = _g([1.0, 2.0], [2.0, 3.0])
    yes = jnp.ones((), jnp.bool_)
    assert bool(sites.gaussian_message_ok(sites.GaussianMessage(_g([0.5, 0.0], [-1.0, 1.0]), yes), q))
    assert not bool(sites.gaussian_message_ok(sites.GaussianMessage(_g([0.5, 0.0], [-1.0, 1.0]), ~yes), q))
    assert not bool(sites.gaussian_message_ok(sites.GaussianMessage(_g([np.nan, 0.0], [0.0, 0.0]), yes), q))
    # Lambda_g + Delta Lambda must stay positive on its own ...
    assert not bool(sites.gaussian_message_ok(sites.GaussianMessage(_g([0.0, 0.0], [-2.0, 0.0]), yes), q))
    # ... unless the server floors its precision (no global given).
    assert bool(sites.gaussian_message_ok(sites.GaussianMessage(_g([0.0, 0.0], [-2.0, 0.0]), yes)))


def test_damped_difference_is_the_scaled_natural_parameter_difference_bit_for_bit():
    new, old = _g([1.0, 3.0], [2.0, 5.0]), _g([0.5, 1.0], [1.0, 4.0])
    got = sites.damped_difference(new, old, 0.3)
    want = optax.tree.scale(0.3, gaussian.difference(new, old))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # with a clip: the difference is clipped to the joint norm first, then damped
    clipped = sites.damped_difference(new, old, 0.5, max_norm=1.0)
    assert float(optax.tree.norm(clipped)) == pytest.approx(0.5, rel=1e-6)


def test_site_server_step_with_sgd_1_adds_the_total_and_guards_positivity():
    q = _g([1.0, 2.0, 3.0], [1.0, 2.0, 3.0])
    opt = optax.sgd(1.0)
    total = _g([0.5, 0.5, 0.5], [1.0, -5.0, 0.5])
    new, _, guarded = jax.jit(lambda q, s, t: sites.site_server_step(opt, q, s, t))(q, opt.init(q), total)
    np.testing.assert_allclose(np.asarray(new.precision["w"]), [2.0, 2.0, 3.5])  # the middle one kept its old value
    np.testing.assert_allclose(np.asarray(new.precision_mean["w"]), [1.5, 2.0, 3.5])
    assert int(guarded) == 1


@pytest.mark.parametrize("burn_in_rounds", [0, 2])
def test_burn_in_switch_runs_burn_in_then_the_main_branch(burn_in_rounds):
    def at(round_idx):
        return jax.jit(lambda r, x: sites.burn_in_switch(burn_in_rounds, r >= burn_in_rounds, lambda v: v + 1.0, lambda v: v - 1.0, x))(
            jnp.int32(round_idx), jnp.float32(0.0)
        )

    assert [float(at(r)) for r in range(4)] == [(1.0 if r >= burn_in_rounds else -1.0) for r in range(4)]


@pytest.mark.parametrize("name", ["fedep", "pvi", "fedlap_cov"])
def test_a_model_over_the_dense_bound_is_refused_before_the_run(name):
    """Every method with dense messages refuses, in one line, a model whose [D, D] precision would
    pass the bound (:func:`fedbayes.algorithms.sites.check_full_size`)."""
    from fedbayes.config.schema import ConfigError, validate
    from fedbayes.runs.build import build_experiment

    cfg = validate(
        {
            "algorithm": {"name": name, "covariance": "full"},
            "data": {"dataset": "digits", "num_clients": 2},
            "server": {"clients_per_round": 2},
            "model": {"name": "mlp"},
        }
    )
    with pytest.raises(ConfigError, match=rf"algorithm.covariance: 'full' .* up to {sites.MAX_FULL_PARAMS} parameters; this model has \d+") as err:
        build_experiment(cfg)
    assert "\n" not in str(err.value)
    # it states the message's size at this model's D, the bound's, and the diagonal one's
    d = int(re.search(r"this model has (\d+),", str(err.value)).group(1))
    sizes = [int(b.replace(",", "")) for b in re.findall(r"\(([\d,]+) bytes\)", str(err.value))]
    assert sizes == [4 * (d + d * d), 4 * (sites.MAX_FULL_PARAMS + sites.MAX_FULL_PARAMS**2), 8 * d]
    assert f"{4 * (d + d * d) / 1e6:.1f} MB" in str(err.value) and "against the bound's 100.0 MB" in str(err.value)


def test_psd_to_roundoff_scales_with_the_larger_of_the_global_and_the_matrix():
    """A client's first GGN site is large against a prior-only global: its float32 round-off (a
    smallest eigenvalue of -1e-8 of its largest) passes, a real negative direction does not; a
    last-layer precision is checked block by block."""
    from fedbayes.gaussian_block import BlockPrecision

    rng = np.random.default_rng(0)
    j = rng.normal(size=(6, 40)).astype(np.float32)
    ggn = 500.0 * (j.T @ j) / 6  # rank 6 of 40: 34 zero eigenvalues
    u = np.linalg.eigh(ggn.astype(np.float64))[1][:, 0]
    rounded = jnp.asarray(ggn - 3e-8 * np.abs(ggn).max() * np.outer(u, u), jnp.float32)  # round-off below zero
    prior = jnp.eye(40, dtype=jnp.float32)
    assert bool(sites.psd_to_roundoff(rounded, prior))
    negative = jnp.asarray(ggn - 1e-2 * np.abs(ggn).max() * np.outer(u, u), jnp.float32)
    assert not bool(sites.psd_to_roundoff(negative, prior))
    block = lambda dense, diag: BlockPrecision({"h": jnp.asarray(diag, jnp.float32)}, dense, "output")  # noqa: E731
    assert bool(sites.psd_to_roundoff(block(rounded, [0.0, 1.0]), block(prior, [1.0, 1.0])))
    assert not bool(sites.psd_to_roundoff(block(negative, [0.0, 1.0]), block(prior, [1.0, 1.0])))
    assert not bool(sites.psd_to_roundoff(block(rounded, [-0.5, 1.0]), block(prior, [1.0, 1.0])))
