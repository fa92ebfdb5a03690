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
