"""Datasets and federated partitions, on the host in numpy (docs/design.md, "Data on this machine").

Sources: Fashion-MNIST and MNIST (IDX files), scikit-learn's digits and breast cancer, LEAF
folders, and synthetic federations (FedProx Synthetic(alpha, beta), FedPA least squares).
Partitioners (docs/algorithms.md §14) turn a train set into per-client index arrays.
"""

from fedbayes.data.dataset import Dataset, DatasetNotFoundError
from fedbayes.data.federation import (
    Federation,
    GeneratedFederation,
    heavy_tailed_sizes,
    synthetic_heavy_tailed_federation,
)
from fedbayes.data.idx import load_fashion_mnist, load_mnist, read_idx
from fedbayes.data.leaf import ALL_LETTERS, NUM_LETTERS, load_leaf, text_to_ids
from fedbayes.data.partition import (
    PARTITIONERS,
    PartitionError,
    dirichlet_label,
    iid,
    label_distribution,
    label_skew,
    natural,
    partition,
    shards,
    two_level_dirichlet,
)
from fedbayes.data.registry import DATASETS, DatasetInfo, dataset_status, load_dataset
from fedbayes.data.sklearn_data import load_breast_cancer, load_digits
from fedbayes.data.synthetic import (
    federated_least_squares,
    least_squares_optima,
    synthetic_leaf,
    synthetic_leaf_client,
)

__all__ = [
    "ALL_LETTERS",
    "DATASETS",
    "Federation",
    "GeneratedFederation",
    "heavy_tailed_sizes",
    "synthetic_heavy_tailed_federation",
    "PartitionError",
    "Dataset",
    "DatasetInfo",
    "DatasetNotFoundError",
    "NUM_LETTERS",
    "PARTITIONERS",
    "dataset_status",
    "dirichlet_label",
    "federated_least_squares",
    "iid",
    "label_distribution",
    "label_skew",
    "least_squares_optima",
    "load_breast_cancer",
    "load_dataset",
    "load_digits",
    "load_fashion_mnist",
    "load_leaf",
    "load_mnist",
    "natural",
    "partition",
    "read_idx",
    "shards",
    "synthetic_leaf",
    "synthetic_leaf_client",
    "text_to_ids",
    "two_level_dirichlet",
]
