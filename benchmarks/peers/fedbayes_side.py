"""The fedbayes worker: a FedAvg workload of ``fedbayes bench`` (``fedavg``: 10 of 10 IID clients;
``fedavg_100``: 10 of 100) built by ``fedbayes.bench.build_simulator`` and run as the bench runs
it (pipelined ``Simulator.rounds``, one XLA host device per core, set by the parent through
``XLA_FLAGS``); test accuracy of the server's model after the rounds, outside the clock.

    XLA_FLAGS=--xla_force_host_platform_device_count=2 PYTHONPATH=src python fedbayes_side.py SPEC_JSON
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402


def main(spec: dict) -> None:
    import jax
    import numpy as np

    from fedbayes import bench as fb

    t_imported = time.time()
    settings = fb.BenchSettings(
        data_dir=spec["data_dir"], lr=spec["lr"], seed=spec["seed"], batch_size=spec["batch_size"], epochs=spec["epochs"], hidden=tuple(spec["hidden"])
    )
    workload = fb.WORKLOADS[spec["workload"]]
    dataset = fb.load_data(settings)
    sim, state = fb.build_simulator(workload, settings, dataset, fb.workload_partition(workload, settings, dataset))
    t_built = time.time()
    sizes, epochs = sim.federation.sizes, fb.workload_epochs(workload, settings)
    marks, examples = [time.perf_counter()], []
    state, info = sim.run_round(state, donate=True)  # compiles
    jax.block_until_ready(state.server_state)
    marks.append(time.perf_counter())
    examples.append(int(sizes[np.asarray(info.cohort)].sum()) * epochs)
    for state, info in sim.rounds(state, spec["rounds"], donate=True):
        marks.append(time.perf_counter())
        examples.append(int(sizes[np.asarray(info.cohort)].sum()) * epochs)
    jax.block_until_ready(state.server_state)
    marks[-1] = time.perf_counter()
    _, _, apply_fn = fb.model_and_trainer(settings, dataset, settings.batch_size)
    params = sim.server_params(state)
    predict = jax.jit(lambda p, x: apply_fn(p, x).argmax(-1))
    correct = sum(
        int((np.asarray(predict(params, dataset.x_test[i : i + 2000])) == dataset.y_test[i : i + 2000]).sum()) for i in range(0, len(dataset.y_test), 2000)
    )
    result = common.timing(marks, examples)
    result.update(
        accuracy=correct / len(dataset.y_test), rounds=spec["rounds"], imports_s=t_imported - common.SPAWN_TIME, setup_s=t_built - t_imported,
        devices=len(jax.local_devices()), layout=sim.layout, versions={"jax": jax.__version__, "fedbayes": _version()},
    )  # fmt: skip
    common.emit(result)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fedbayes")
    except PackageNotFoundError:
        return "source"


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
