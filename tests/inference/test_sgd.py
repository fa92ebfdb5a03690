"""The local budget that runs until the objective settles (fedbayes.inference.sgd, ``trainer.tol``):
on a quadratic it stops at the first epoch whose mean gradient is ``tol`` times the first epoch's,
with exactly the iterate a fixed budget of that many epochs reaches; it never passes its cap; the
epoch samples of FedEP's SG-MCMC step stop alike."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedbayes.data.batches import ClientData
from fedbayes.inference import LocalTrainer, epoch_samples, run_sgd

TARGET = 3.0


def _loss(p, key, x, y, mask):
    del key, y
    # 0.5 (w - TARGET)^2 per example: full-batch gradient descent contracts the error by (1 - lr) a step
    return jnp.sum(mask * 0.5 * jnp.square(p["w"] - TARGET) * jnp.ones_like(x[:, 0])) / jnp.maximum(jnp.sum(mask), 1.0)


def _data(n=8, epochs=40):
    order = np.concatenate([np.arange(n)] * epochs + [np.zeros(8, int)]).astype(np.int32)
    return ClientData(jnp.ones((n, 1), jnp.float32), jnp.zeros(n, jnp.int32), jnp.asarray(order), jnp.int32(0), jnp.int32(n))


def _trainer(epochs, tol=0.0, lr=0.2):
    return LocalTrainer(_loss, optax.sgd(lr), epochs, 8, tol=tol)  # one full batch per epoch


@pytest.mark.parametrize("tol", [0.5, 0.1, 0.01])
def test_stops_at_the_first_settled_epoch_with_the_fixed_budgets_iterate(tol):
    start = {"w": jnp.zeros((), jnp.float32)}
    p, info = run_sgd(jax.random.key(0), start, _data(), _trainer(40, tol))
    # epoch e's gradient is (1 - lr)^(e - 1) times the first's: the rule fires at the first e >= 2 with 0.8^(e - 1) <= tol
    want = next(e for e in range(2, 41) if 0.8 ** (e - 1) <= tol)
    assert int(info["steps"]) == want
    fixed, _ = run_sgd(jax.random.key(0), start, _data(), _trainer(want))
    np.testing.assert_array_equal(np.asarray(p["w"]), np.asarray(fixed["w"]))


def test_never_passes_its_cap():
    p, info = run_sgd(jax.random.key(0), {"w": jnp.zeros((), jnp.float32)}, _data(), _trainer(5, tol=1e-6))
    assert int(info["steps"]) == 5
    fixed, _ = run_sgd(jax.random.key(0), {"w": jnp.zeros((), jnp.float32)}, _data(), _trainer(5))
    np.testing.assert_array_equal(np.asarray(p["w"]), np.asarray(fixed["w"]))


@pytest.mark.parametrize("average", [False, True])
def test_epoch_samples_stop_alike_and_keep_the_epochs_run(average):
    start = {"w": jnp.zeros((), jnp.float32)}
    samples, last, info = epoch_samples(jax.random.key(0), start, _data(), _trainer(40, 0.1), skip_epochs=0, average=average)
    done = int(info["steps"])  # one step an epoch
    fixed_samples, fixed_last, _ = epoch_samples(jax.random.key(0), start, _data(), _trainer(done), skip_epochs=0, average=average)
    np.testing.assert_allclose(np.asarray(samples["w"][:done]), np.asarray(fixed_samples["w"]), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(samples["w"][done:]), 0.0)
    np.testing.assert_array_equal(np.asarray(last["w"]), np.asarray(fixed_last["w"]))


def test_a_small_client_runs_up_to_max_steps_past_its_epochs():
    """An epoch of one batch is one step: with ``max_steps`` the cap is that many steps, the epochs
    past the laid-out ones reusing their shuffles, and the iterate is that of a fixed budget of as
    many full-batch steps (laid out in full, for the comparison)."""
    start = {"w": jnp.zeros((), jnp.float32)}
    laid_out = _data(epochs=5)  # five epochs laid out, as the simulator does for E = 5
    trainer = LocalTrainer(_loss, optax.sgd(0.2), 5, 8, tol=1e-6, max_steps=17)
    p, info = run_sgd(jax.random.key(0), start, laid_out, trainer)
    assert int(info["steps"]) == 17
    fixed, _ = run_sgd(jax.random.key(0), start, _data(epochs=17), _trainer(17))
    np.testing.assert_array_equal(np.asarray(p["w"]), np.asarray(fixed["w"]))
    # it still stops once settled, and a client whose epochs are max_steps or more keeps E epochs
    _, info = run_sgd(jax.random.key(0), start, laid_out, trainer._replace(tol=0.5))
    assert int(info["steps"]) == next(e for e in range(2, 41) if 0.8 ** (e - 1) <= 0.5)
    _, info = run_sgd(jax.random.key(0), start, laid_out, trainer._replace(max_steps=3))
    assert int(info["steps"]) == 5


def test_the_epoch_cap_gives_small_clients_their_steps():
    from fedbayes.inference.sgd import epoch_cap

    trainer = LocalTrainer(_loss, optax.sgd(0.2), 20, 32, tol=0.1, max_steps=200)
    # 1, 2, 7 and 10 steps an epoch: 200, 100, 29 and 20 epochs
    assert [int(epoch_cap(trainer, n)) for n in (12, 40, 200, 320)] == [200, 100, 29, 20]
    assert [int(epoch_cap(trainer._replace(max_steps=0), n)) for n in (12, 320)] == [20, 20]


def test_epoch_samples_past_their_rows_keep_the_last_epochs_in_a_ring():
    """A converging small client may run more epochs than the samples have rows: row ``e mod E``
    holds epoch ``e``, so the rows hold the last ``E`` epochs, as a plain run of that many epochs
    gives them."""
    from fedbayes.inference.iasg import epoch_of_sample

    start = {"w": jnp.zeros((), jnp.float32)}
    trainer = LocalTrainer(_loss, optax.sgd(0.2), 5, 8, tol=1e-6, max_steps=17)
    samples, last, info = epoch_samples(jax.random.key(0), start, _data(epochs=5), trainer, skip_epochs=0, average=False)
    assert int(info["steps"]) == 17
    plain, plain_last, _ = epoch_samples(jax.random.key(0), start, _data(epochs=17), _trainer(17), skip_epochs=0, average=False)
    rows = np.asarray(epoch_of_sample(5, jnp.int32(17)))
    assert sorted(rows.tolist()) == [12, 13, 14, 15, 16] and rows[16 % 5] == 16
    np.testing.assert_allclose(np.asarray(samples["w"]), np.asarray(plain["w"])[rows], rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(last["w"]), np.asarray(plain_last["w"]))
    assert np.asarray(epoch_of_sample(5, jnp.int32(3))).tolist() == [0, 1, 2, -2, -1]  # rows not yet filled
