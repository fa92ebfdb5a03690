"""Writes examples/own_data/clients.csv: a table as you might have it, one row per example with
a `client` column (who holds it), a `label` column and the features.

Here the rows are scikit-learn's digits (bundled: nothing is downloaded), shared among 8
"hospitals" of unequal size with skewed labels. Run from the repository's root:

    python examples/own_data/make_data.py
"""

from pathlib import Path

import numpy as np
from sklearn.datasets import load_digits

out = Path(__file__).with_name("clients.csv")
x, y = load_digits(return_X_y=True)
rng = np.random.default_rng(0)
# Each client prefers a few digits: client c gets an example of label l with weight w[c, l].
weights = rng.dirichlet(np.full(10, 0.5), size=8)
client = np.array([rng.choice(8, p=weights[:, label] / weights[:, label].sum()) for label in y])
header = ",".join(["client", "label", *(f"pixel_{i}" for i in range(x.shape[1]))])
rows = np.column_stack([client, y, x / 16.0])
np.savetxt(out, rows, delimiter=",", header=header, comments="", fmt=["%d", "%d", *["%.4f"] * x.shape[1]])
print(f"wrote {out}: {len(y)} rows, {x.shape[1]} features, clients of sizes {np.bincount(client).tolist()}")
