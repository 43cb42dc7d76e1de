"""The digits task reads scikit-learn's bundled table without importing scikit-learn (about 2.5 s of CPU
per rank of every launch); the arrays must be exactly the ones ``load_digits`` returns."""

import sys

import numpy as np


def test_digits_table_is_load_digits_without_importing_sklearn():
    from fastml_strategy._digits import digits_table, load_digits_split

    had = "sklearn" in sys.modules
    pixels, labels = digits_table()
    assert had or "sklearn" not in sys.modules
    from sklearn.datasets import load_digits

    ref = load_digits()
    assert pixels.dtype == ref.data.dtype and np.array_equal(pixels, ref.data)
    assert labels.dtype == np.int64 and np.array_equal(labels, ref.target)
    xtr, ytr, xte, yte = load_digits_split(seed=0)
    assert xtr.shape == (1438, 64) and xte.shape == (359, 64) and float(xtr.max()) == 1.0
    assert sorted(set(ytr.tolist())) == list(range(10))
