"""What the peers' workers share: Fashion-MNIST from its IDX files, the MLP in PyTorch, local SGD,
test accuracy, and the one-line result a worker prints. NumPy at top level; torch is imported by
the functions that need it (the parent process imports this module without torch)."""

from __future__ import annotations

import gzip
import json
import os
import struct
import time

import numpy as np

RESULT = "PEERS_RESULT "
SPAWN_TIME = float(os.environ.get("PEERS_SPAWN_TIME", time.time()))
FILES = {
    "x_train": "train-images-idx3-ubyte.gz",
    "y_train": "train-labels-idx1-ubyte.gz",
    "x_test": "t10k-images-idx3-ubyte.gz",
    "y_test": "t10k-labels-idx1-ubyte.gz",
}


def read_idx(path: str) -> np.ndarray:
    """An IDX file (gzip) as an array: images ``uint8 [N, 28, 28]``, labels ``uint8 [N]``."""
    with gzip.open(path, "rb") as f:
        raw = f.read()
    ndim = raw[3]
    shape = struct.unpack(">" + "I" * ndim, raw[4 : 4 + 4 * ndim])
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


def load_fashion_mnist(folder: str) -> dict[str, np.ndarray]:
    """Images as float32 in [0, 1], flattened to 784 (as fedbayes' MLP flattens them); int64 labels."""
    out = {k: read_idx(os.path.join(folder, name)) for k, name in FILES.items()}
    for k in ("x_train", "x_test"):
        out[k] = out[k].reshape(len(out[k]), -1).astype(np.float32) / np.float32(255.0)
    for k in ("y_train", "y_test"):
        out[k] = out[k].astype(np.int64)
    return out


def load_parts(path: str) -> list[np.ndarray]:
    """The clients' index arrays the parent wrote (fedbayes' own IID partition of the workload)."""
    with np.load(path) as z:
        return [z[f"c{i}"] for i in range(len(z.files))]


def mlp(hidden=(200, 100), num_inputs: int = 784, num_classes: int = 10):
    """The MLP of fedbayes' bench in PyTorch: Linear + ReLU per hidden width, then the logits."""
    from torch import nn

    layers, width = [], num_inputs
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


def local_sgd(model, x, y, lr: float, batch_size: int, epochs: int, generator) -> None:
    """Plain SGD on cross-entropy over shuffled minibatches (the last one may be smaller)."""
    import torch

    opt = torch.optim.SGD(model.parameters(), lr=lr)
    loss_fn = torch.nn.CrossEntropyLoss()
    model.train()
    n = len(x)
    for _ in range(epochs):
        order = torch.randperm(n, generator=generator)
        for start in range(0, n, batch_size):
            idx = order[start : start + batch_size]
            opt.zero_grad()
            loss_fn(model(x[idx]), y[idx]).backward()
            opt.step()


def accuracy(model, x, y) -> float:
    """Top-1 accuracy of ``model`` on ``(x, y)`` (torch tensors)."""
    import torch

    model.eval()
    with torch.no_grad():
        return float((model(x).argmax(-1) == y).float().mean())


def timing(marks: list[float], examples_per_round: list[int]) -> dict:
    """Round times from ``marks`` (round r runs from ``marks[r]`` to ``marks[r + 1]``): the first
    round apart, the steady rounds after it with their examples."""
    rounds = [b - a for a, b in zip(marks, marks[1:], strict=False)]
    return {"first_round_s": rounds[0], "round_s": rounds[1:], "examples": examples_per_round[1 : len(rounds)]}


def emit(result: dict) -> None:
    """Prints the worker's result line (the parent reads the line that starts with :data:`RESULT`)."""
    result.setdefault("wall_s", time.time() - SPAWN_TIME)
    print(RESULT + json.dumps(result), flush=True)
