"""The digits task (scikit-learn's bundled 8x8 handwritten digits) used by the demo, tests and
benchmarks: a real dataset that ships inside the scikit-learn wheel, so nothing is downloaded."""

from __future__ import annotations

import torch


def digits_table():
    """(pixels float64 [1797, 64], labels int64 [1797]): scikit-learn's own ``digits.csv.gz``, read
    straight from its package folder. ``sklearn.datasets.load_digits`` gives the same arrays, but
    importing scikit-learn costs about 2.5 s of CPU per process, paid by every rank of every launch."""
    import gzip
    import importlib.util
    import os

    import numpy as np

    spec = importlib.util.find_spec("sklearn")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the digits task needs scikit-learn: pip install 'fastml-strategy[dev]'")
    path = os.path.join(spec.submodule_search_locations[0], "datasets", "data", "digits.csv.gz")
    if not os.path.exists(path):  # pragma: no cover - a future scikit-learn moving its data
        from sklearn.datasets import load_digits

        data = load_digits()
        return data.data, data.target
    with gzip.open(path, "rt") as f:
        table = np.loadtxt(f, delimiter=",")
    return table[:, :-1], table[:, -1].astype(np.int64)


def load_digits_split(seed: int = 0, test_fraction: float = 0.2):
    """(x_train, y_train, x_test, y_test) as float32/int64 tensors, features scaled to [0, 1]."""
    pixels, labels = digits_table()
    x = torch.tensor(pixels, dtype=torch.float32) / 16.0
    y = torch.tensor(labels, dtype=torch.int64)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    x, y = x[perm], y[perm]
    n_test = int(len(y) * test_fraction)
    return x[n_test:], y[n_test:], x[:n_test], y[:n_test]


def digits_mlp(hidden: int = 256, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(64, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, 10),
    )


def batches(x, y, batch_size: int, rank: int, world_size: int, seed: int = 0):
    """An endless stream of this rank's shard of shuffled mini-batches (a new shuffle per epoch)."""
    epoch = 0
    while True:
        g = torch.Generator().manual_seed(seed * 1000 + epoch)
        perm = torch.randperm(len(y), generator=g)[rank::world_size]
        for i in range(0, len(perm) - batch_size + 1, batch_size):
            idx = perm[i: i + batch_size]
            yield x[idx], y[idx]
        epoch += 1


@torch.no_grad()
def accuracy(model, x, y) -> float:
    model.eval()
    acc = float((model(x).argmax(dim=1) == y).float().mean())
    model.train()
    return acc
