"""``fedbayes new FOLDER``: a project of your own to start from, as ``flwr new`` gives Flower's users.

The folder gets a run config and a comparison config for your data, a flax model file and a
data file in the layout fedbayes reads (one row per example: a ``client`` column, a ``label``
column, feature columns), filled with a small generated example so that every command runs at
once; replace the file with yours (:mod:`fedbayes.data.user` has the formats).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated

import numpy as np
import typer

from fedbayes.cli.base import console, fail

__all__ = ["new", "project_files"]

EXAMPLE_CLIENTS, EXAMPLE_ROWS, EXAMPLE_FEATURES, EXAMPLE_CLASSES = 4, 400, 5, 3

MODEL = '''"""Your model: a flax module that maps [batch, features] to logits [batch, num_classes].

fedbayes sets num_classes from the data; config.toml's [model] kwargs set the others. Keep only
parameters (LayerNorm or GroupNorm, not BatchNorm: its running statistics are state the methods do
not federate, and such a model is refused with one line).
"""

import flax.linen as nn


class Net(nn.Module):
    num_classes: int
    width: int = 64

    @nn.compact
    def __call__(self, x):
        x = x.reshape((x.shape[0], -1))
        x = nn.relu(nn.LayerNorm()(nn.Dense(self.width)(x)))
        return nn.Dense(self.num_classes)(x)
'''

CONFIG = """# {name}: one run on your data with your model. From the folder holding {folder}/:
#   fedbayes run {folder}/config.toml                 # -> runs/{name}/
# `fedbayes config` lists every key; paths are relative to the folder you run fedbayes from.

name = "{name}"
rounds = 20

[data]
dataset = "files"
path = "{folder}/data/clients.csv"   # your data: .csv, .npz, .npy or .parquet (a generated example until you replace it)
client_column = "client"             # which client holds each row: the natural partition
partition = "natural"
num_clients = {clients}                      # the clients in the file
test_fraction = 0.2                  # no test file: 20% of each client's rows, seeded
standardize = "auto"                 # scales the features when their magnitudes differ by orders of magnitude

[model]
module = "{folder}/model.py:Net"
kwargs = {{ width = 64 }}

[client]
epochs = 2
batch_size = 16
lr = 0.05

[server]
clients_per_round = {clients}

[algorithm]
name = "fedavg"
"""

COMPARE = """# {name}: a point method beside Bayesian ones on your data. From the folder holding {folder}/:
#   fedbayes compare {folder}/compare.toml --out runs/{name}_compare

[base]
rounds = 20

[base.data]
dataset = "files"
path = "{folder}/data/clients.csv"
client_column = "client"
partition = "natural"
num_clients = {clients}

[base.model]
module = "{folder}/model.py:Net"

[base.server]
clients_per_round = {clients}

[variants.fedavg]
algorithm = {{ name = "fedavg" }}

[variants.fedlap_cov]
algorithm = {{ name = "fedlap_cov" }}   # FedAvg's cost plus a diagonal-GGN precision: a posterior

[variants.fedep]
algorithm = {{ name = "fedep" }}        # expectation propagation: a posterior, marginalised predictions
"""

README = """# {name}

Made by `fedbayes new`. From the folder holding `{folder}/`:

```bash
fedbayes run {folder}/config.toml                              # one run -> runs/{name}/
fedbayes compare {folder}/compare.toml --out runs/{name}_compare  # FedAvg, FedLap-Cov, FedEP
```

* `data/clients.csv`: {rows} generated rows ({clients} clients, {classes} classes, {features}
  features of unlike scales) in the layout fedbayes reads: a `client` column, a `label` column
  (classes 0..C-1) and one column per feature. Replace it with yours, and set `num_clients` in
  both configs to your number of clients. Without a client column, delete `client_column` and
  choose a partition (`iid`, `dirichlet`, ...).
* `model.py`: the flax module `Net`; change it, or name another in `[model] module`.
* `config.toml`, `compare.toml`: every key is listed by `fedbayes config`.
"""


def example_rows(rng: np.random.Generator) -> str:
    """The example data file: rows of ``client,label,f0..`` whose features differ in scale (so
    that ``data.standardize = "auto"`` scales them) and whose labels follow them."""
    scales = 10.0 ** np.arange(EXAMPLE_FEATURES - 2, -2, -1)[:EXAMPLE_FEATURES]  # 1000 down to 0.1
    z = rng.normal(size=(EXAMPLE_ROWS, EXAMPLE_FEATURES))
    weights = rng.normal(size=(EXAMPLE_FEATURES, EXAMPLE_CLASSES))
    labels = np.argmax(z @ weights + 0.3 * rng.normal(size=(EXAMPLE_ROWS, EXAMPLE_CLASSES)), axis=1)
    clients = rng.integers(0, EXAMPLE_CLIENTS, size=EXAMPLE_ROWS)
    header = ",".join(["client", "label", *(f"f{i}" for i in range(EXAMPLE_FEATURES))])
    lines = [f"{c},{y}," + ",".join(f"{v:.6g}" for v in row) for c, y, row in zip(clients, labels, z * scales)]
    return "\n".join([header, *lines]) + "\n"


def project_files(folder: str, name: str) -> dict[str, str]:
    """Relative path -> content of the project ``fedbayes new`` writes in ``folder``."""
    fields = dict(name=name, folder=folder, clients=EXAMPLE_CLIENTS, rows=EXAMPLE_ROWS, classes=EXAMPLE_CLASSES, features=EXAMPLE_FEATURES)
    return {
        "config.toml": CONFIG.format(**fields),
        "compare.toml": COMPARE.format(**fields),
        "model.py": MODEL,
        "README.md": README.format(**fields),
        "data/clients.csv": example_rows(np.random.default_rng(0)),
    }


def new(folder: Annotated[Path, typer.Argument(help="the project's folder (created; its name names the runs)")]):
    """Start a project of your own: a run config, a comparison, a flax model file and a data file
    in the layout fedbayes reads (a generated example: replace it with yours)."""
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        fail(f"error: {folder} exists and is not an empty folder; choose another name (fedbayes new never overwrites)")
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", folder.resolve().name) or "project"
    posix = folder.as_posix().rstrip("/")
    for relative, text in project_files(posix, name).items():
        path = folder / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    console.print(f"wrote {posix}/: config.toml, compare.toml, model.py, data/clients.csv (an example), README.md", highlight=False, soft_wrap=True)
    console.print(f"next: fedbayes run {posix}/config.toml", highlight=False, soft_wrap=True)
