"""The digits task (scikit-learn's bundled 8x8 handwritten digits) used by the demo, tests and
benchmarks: a real dataset that ships inside the scikit-learn wheel, so nothing is downloaded."""

from __future__ import annotations

import torch


def load_digits_split(seed: int = 0, test_fraction: float = 0.2):
    """(x_train, y_train, x_test, y_test) as float32/int64 tensors, features scaled to [0, 1]."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:  # pragma: no cover - dev extra
        raise ImportError("the digits task needs scikit-learn: pip install 'fastml-strategy[dev]'") from e
    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.int64)
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
