"""A tiny CPU workload for the autotuner's tests: a 3-layer MLP on a synthetic 4-class problem.

Two of its weights (4096 and 16384 elements) are large enough to be tuned; biases and the last layer
travel fp32. One step takes about a millisecond.
"""

import torch

from fastml_strategy.autotune import Workload


def _data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    centers = torch.randn(4, 32, generator=torch.Generator().manual_seed(0)) * 0.4
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 4, (n,), generator=g)
    x = centers[y] + torch.randn(n, 32, generator=g)
    return x, y


def workload() -> Workload:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128), torch.nn.ReLU(),
        torch.nn.Linear(128, 4))
    x, y = _data(2048, 1)
    xt, yt = _data(512, 2)
    batches = [(x[i:i + 64], y[i:i + 64]) for i in range(0, len(x), 64)]

    def loss_fn(m: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        xb, yb = batch
        return torch.nn.functional.cross_entropy(m(xb), yb)

    def eval_fn(m: torch.nn.Module) -> float:
        return float((m(xt).argmax(1) == yt).float().mean())

    return Workload(model=model, batches=batches, loss_fn=loss_fn, eval_fn=eval_fn,
                    optimizer=lambda p: torch.optim.SGD(p, lr=0.05), name="tiny")


def not_a_workload() -> int:
    return 3
