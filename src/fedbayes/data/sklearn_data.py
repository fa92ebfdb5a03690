"""Small datasets bundled with scikit-learn: always available, so tests and examples need no files.

* ``load_digits``: UCI optical recognition of handwritten digits, 1,797 8x8 images, 10 classes.
* ``load_breast_cancer``: UCI Wisconsin diagnostic breast cancer, 569 x 30 features, 2 classes.

Both use a deterministic stratified 80/20 split (``train_test_split(..., test_size=0.2,
stratify=y, random_state=0)``).
"""

from __future__ import annotations

import numpy as np

from fedbayes.data.dataset import Dataset

TEST_SIZE = 0.2
SPLIT_SEED = 0


def _split(x: np.ndarray, y: np.ndarray):
    from sklearn.model_selection import train_test_split  # lazy: importing sklearn takes about 1 s

    return train_test_split(x, y, test_size=TEST_SIZE, stratify=y, random_state=SPLIT_SEED)


def load_digits() -> Dataset:
    """scikit-learn's digits as images: float32 ``[N, 8, 8, 1]`` in [0, 1], 10 classes.

    Pixel values are counts 0..16 in the source, so they are divided by 16.
    """
    from sklearn.datasets import load_digits as sk_load_digits

    raw = sk_load_digits()
    x = (raw.images.astype(np.float32) / np.float32(16.0))[..., None]
    y = raw.target.astype(np.int32)
    x_train, x_test, y_train, y_test = _split(x, y)
    return Dataset(
        name="digits",
        x_train=x_train,
        y_train=y_train,
        x_test=x_test,
        y_test=y_test,
        num_classes=10,
        task="classification",
    )


def load_breast_cancer() -> Dataset:
    """scikit-learn's breast cancer: standardized float32 features ``[N, 30]``, 2 classes.

    Each feature is centred and scaled by the mean and standard deviation of the train part only,
    so no test information leaks into the features.
    """
    from sklearn.datasets import load_breast_cancer as sk_load_breast_cancer

    raw = sk_load_breast_cancer()
    x = raw.data.astype(np.float64)
    y = raw.target.astype(np.int32)
    x_train, x_test, y_train, y_test = _split(x, y)
    mean = x_train.mean(axis=0)
    std = x_train.std(axis=0)
    std = np.where(std > 0, std, 1.0)  # a constant feature would divide by zero; keep it at 0
    return Dataset(
        name="breast_cancer",
        x_train=((x_train - mean) / std).astype(np.float32),
        y_train=y_train,
        x_test=((x_test - mean) / std).astype(np.float32),
        y_test=y_test,
        num_classes=2,
        task="classification",
    )
