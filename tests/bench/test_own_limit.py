"""A method's own limit (fedbayes.bench.own_limit) does the round's arithmetic: its plain loop
gives the simulator's round, and the bench reports the paired ratio. No timing is asserted."""

import jax
import numpy as np
import pytest
from test_bench import TINY

from fedbayes import bench as fb
from fedbayes.bench.own_limit import first_device_state


@pytest.mark.parametrize("name", ["fedavg_100", "fedep_100", "fedlap_func_100"])
def test_the_plain_round_is_the_simulators_round(name):
    sim, state = fb.build_simulator(fb.WORKLOADS[name], TINY, fb.load_data(TINY))
    plain = fb.plain_round(sim, first_device_state(sim, state.server_state), fb.prepare_plain_round(sim, state, 0))
    after, info = sim.run_round(state)
    assert len(info.rejected) == 0
    got, want = jax.tree.leaves(plain), jax.tree.leaves(after.server_state)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        # The sequential layout sums a device's clients in another order than the plain stack.
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-6)


def test_the_report_gives_the_ratio_to_the_own_limit_beside_the_others():
    raw = fb.measure_federated(fb.WORKLOADS["fedavg_100"], TINY)
    assert len(raw["own_limit_sim_s"]) == len(raw["own_limit_plain_s"]) == TINY.own_limit_blocks
    entry = fb.federated_entry(raw)
    want = np.median(np.asarray(raw["own_limit_plain_s"]) / np.asarray(raw["own_limit_sim_s"]))
    assert entry[fb.OWN_LIMIT_RATIO] == pytest.approx(want)
    limit = {"examples_per_s": entry["examples_per_s"], "round_s": 1.0, "compile_s": 0.0, "peak_rss_mb": 1.0, "batch_size": 32, "processes": 1}
    results = fb.summarize([{fb.REFERENCE: limit, "fedavg_100": entry}])
    assert results["fedavg_100"][fb.OWN_LIMIT_RATIO + "_range"][0] <= results["fedavg_100"][fb.OWN_LIMIT_RATIO]
    assert "vs own limit" in fb.markdown(results) and f"{entry[fb.OWN_LIMIT_RATIO]:.2f} (" in fb.markdown(results)


def test_the_plain_round_runs_when_the_first_client_is_not_on_the_first_device():
    """`fedbayes bench --quick` ended in "incompatible devices" at fedavg_dirichlet: its messages
    went to the cohort's first client's device, not the server state's."""
    import dataclasses

    settings = dataclasses.replace(TINY, seed=1)  # seed 1: the cohort's first client runs on the second device
    sim, state = fb.build_simulator(fb.WORKLOADS["fedavg_dirichlet"], settings, fb.load_data(settings))
    inputs = fb.prepare_plain_round(sim, state, 0)
    assert len(jax.devices()) == 2 and inputs.devices[0] != inputs.server_device
    plain = fb.plain_round(sim, first_device_state(sim, state.server_state), inputs)
    after, _ = sim.run_round(state)
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(after.server_state)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-6)


# The GPU record's federated workloads, which test_bench.py's in-process repeat leaves out (it runs
# the others): each one's first simulated round and its plain round, so a listed workload cannot rot.
GPU_FEDERATED = [n for n, w in fb.WORKLOADS.items() if isinstance(w, fb.FederatedWorkload) and w.gpu and n != "gpu_fedavg_10"]


@pytest.mark.slow  # 7 compiles: about 95 s on the shared 2 cores
@pytest.mark.parametrize("name", GPU_FEDERATED)
def test_every_gpu_workloads_first_round_runs_here(name):
    import dataclasses

    settings = dataclasses.replace(TINY, seed=1)
    sim, state = fb.build_simulator(fb.WORKLOADS[name], settings, fb.load_data(settings))
    after, info = sim.run_round(state)
    assert len(info.rejected) == 0
    plain = fb.plain_round(sim, first_device_state(sim, state.server_state), fb.prepare_plain_round(sim, state, 0))
    assert all(np.all(np.isfinite(np.asarray(a))) for a in jax.tree.leaves(plain))
