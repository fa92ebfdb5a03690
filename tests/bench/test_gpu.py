"""The GPU record's layout on a GPU: the vmap layout with the client states in device memory
gives the plain jitted loop's round and, fused, its own unfused rounds (bitwise on the CPU, where
tests/sim/test_fused.py checks it; on a GPU XLA compiles the scanned round with other fusions, so
the results agree to float32 rounding: on an H100 on 2026-11-27 FedEP's were bitwise equal and
FedAvg's differed in 12 of 1,024 weights of one layer by at most 3.7e-9). Skipped where JAX
has no GPU (the suite runs on the CPU: run these with ``JAX_PLATFORMS=cuda,cpu pytest -m gpu``)."""

import dataclasses

import jax
import numpy as np
import pytest
from test_bench import TINY

from fedbayes import bench as fb
from fedbayes.bench.own_limit import first_device_state

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU (JAX_PLATFORMS=cuda,cpu)")]


@pytest.mark.parametrize("name", ["gpu_fedavg_10", "gpu_fedep_10", "gpu_pvi_10", "gpu_fedlap_cov_10"])
def test_the_vmap_round_with_a_device_store_is_the_plain_loops_round_on_the_gpu(name):
    sim, state = fb.build_simulator(fb.WORKLOADS[name], TINY, fb.load_data(TINY))
    assert sim.layout == "vmap" and sim.store == "device" and sim.mesh.devices.flat[0].platform == jax.default_backend()
    plain = fb.plain_round(sim, first_device_state(sim, state.server_state), fb.prepare_plain_round(sim, state, 0))
    after, info = sim.run_round(state)
    assert len(info.rejected) == 0
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(after.server_state), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)  # GPU reductions reassociate


@pytest.mark.parametrize("name", ["gpu_fedavg_10", "gpu_fedep_10"])
def test_fused_rounds_equal_one_round_at_a_time_on_the_gpu_to_float32_rounding(name):
    workload = fb.WORKLOADS[name]
    data = fb.load_data(TINY)
    one, state = fb.build_simulator(workload, TINY, data)
    want = []
    for _ in range(5):
        state, _ = one.run_round(state)
        want.append([np.asarray(a) for a in jax.tree.leaves(state.server_state)])
    fused, state = fb.build_simulator(dataclasses.replace(workload, fuse=3), TINY, data)
    got = [[np.asarray(a) for a in jax.tree.leaves(s.server_state)] for s, _ in fused.rounds(state, 5)]
    for g, w in zip(got, want, strict=True):
        for a, b in zip(g, w, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-8)  # measured: at most 3.7e-9 (H100)


def test_the_gpu_record_reports_its_device_and_own_limit():
    raw = fb.measure_federated(fb.WORKLOADS["gpu_fedavg_10"], TINY)
    entry = fb.federated_entry(raw)
    assert entry["layout"] == "vmap" and entry["store"] == "device" and entry["device_kind"]
    assert entry[fb.OWN_LIMIT_RATIO] > 0
