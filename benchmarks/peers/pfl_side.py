"""The pfl worker: FedAvg on the workload as pfl-research's own benchmarks set it up
(``benchmarks/image_classification/pytorch/train.py``): a ``FederatedDataset`` of the clients'
tensors with a ``minimize_reuse`` user sampler, ``PyTorchModel`` with a local ``torch.optim.SGD``
and a central ``SGD(lr=1)`` (the weighted mean of the clients' models, with ``WeightByDatapoints``),
``SimulatedBackend`` and ``FederatedAveraging``. Round ends are taken by a callback
(``after_central_iteration``); no evaluation during training, test accuracy after it.

    python pfl_side.py SPEC_JSON                                  # one process
    python -m torch.distributed.run --standalone --nnodes=1 --nproc_per_node=2 pfl_side.py SPEC_JSON

The second is pfl's documented multi-process mode (each process trains its share of the cohort;
the statistics are all-reduced with gloo on CPU). Rank 0 prints the result.
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402


def main(spec: dict) -> None:
    import numpy as np
    import torch

    torch.set_num_threads(spec["threads"])
    import pfl
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.aggregate.weighting import WeightByDatapoints
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.callback.base import TrainingProcessCallback
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.data.sampling import get_user_sampler
    from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
    from pfl.internal.ops.selector import get_framework_module
    from pfl.metrics import Metrics, Weighted
    from pfl.model.pytorch import PyTorchModel

    t_imported = time.time()
    np.random.seed(spec["seed"])  # the same cohorts in every process of a multi-process run
    torch.manual_seed(spec["seed"])
    data = common.load_fashion_mnist(spec["data_dir"])
    parts = common.load_parts(spec["parts"])
    x, y = torch.from_numpy(data["x_train"]), torch.from_numpy(data["y_train"])
    users = {i: (x[torch.from_numpy(idx)], y[torch.from_numpy(idx)]) for i, idx in enumerate(parts)}
    federated = FederatedDataset.from_slices(users, get_user_sampler("minimize_reuse", list(users)))

    net = common.mlp(spec["hidden"])
    loss_fn = torch.nn.CrossEntropyLoss()

    def loss(self, inputs, targets, eval=False):
        self.eval() if eval else self.train()
        return loss_fn(self(inputs), targets)

    @torch.no_grad()
    def metrics(self, inputs, targets, eval=True):
        self.eval() if eval else self.train()
        logits = self(inputs)
        return {
            "loss": Weighted(float(loss_fn(logits, targets)) * len(inputs), len(inputs)),
            "accuracy": Weighted(float((logits.argmax(-1) == targets).sum()), len(inputs)),
        }

    net.loss, net.metrics = loss.__get__(net), metrics.__get__(net)
    model = PyTorchModel(model=net, local_optimizer_create=torch.optim.SGD, central_optimizer=torch.optim.SGD(net.parameters(), 1.0))
    backend = SimulatedBackend(training_data=federated, val_data=federated, postprocessors=[WeightByDatapoints()])
    marks: list[float] = []

    class RoundClock(TrainingProcessCallback):
        def on_train_begin(self, *, model):
            marks.append(time.perf_counter())
            return Metrics()

        def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
            marks.append(time.perf_counter())
            return False, Metrics()

    rounds, cohort = spec["rounds"], spec["clients_per_round"]
    params = NNAlgorithmParams(central_num_iterations=rounds, evaluation_frequency=rounds + 1, train_cohort_size=cohort, val_cohort_size=0)
    train = NNTrainHyperParams(local_learning_rate=spec["lr"], local_num_epochs=spec["epochs"], local_batch_size=spec["batch_size"])
    t_start = time.time()
    FederatedAveraging().run(
        algorithm_params=params, backend=backend, model=model, model_train_params=train,
        model_eval_params=NNEvalHyperParams(local_batch_size=1024), callbacks=[RoundClock()],
    )  # fmt: skip
    distributed = get_framework_module().distributed
    if distributed.global_rank != 0:
        return
    n = int(np.mean([len(p) for p in parts]))  # IID: equal clients, so every cohort trains M * n
    result = common.timing(marks, [cohort * n * spec["epochs"]] * (rounds + 1))
    result.update(
        accuracy=common.accuracy(net, torch.from_numpy(data["x_test"]), torch.from_numpy(data["y_test"])),
        rounds=rounds, imports_s=t_imported - common.SPAWN_TIME, setup_s=t_start - t_imported,
        processes=distributed.world_size, threads=torch.get_num_threads(),
        versions={"torch": torch.__version__, "pfl": pfl.__version__ if hasattr(pfl, "__version__") else _version("pfl")},
    )  # fmt: skip
    common.emit(result)


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
