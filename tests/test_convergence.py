"""Convergence on a real dataset no one here made: scikit-learn's digits, 2 gloo ranks, same steps.

int4 with error feedback must reach fp32's test accuracy within 1 point; topk1 within 2 points.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from _dist import run_workers

STEPS = 400


def _train_digits(rank, world_size, plan, steps):
    import fastml_strategy as fm
    from fastml_strategy._digits import accuracy, batches, digits_mlp, load_digits_split

    xtr, ytr, xte, yte = load_digits_split()
    model = digits_mlp()
    ddp = DDP(model, bucket_cap_mb=0.1)
    if plan is not None:
        fm.register_hook(ddp, plan=fm.Plan.from_recipe(plan, min_numel=1024))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    stream = batches(xtr, ytr, 32, rank, world_size)
    for _ in range(steps):
        x, y = next(stream)
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return accuracy(model, xte, yte)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_digits_accuracy_matches_fp32():
    ref = run_workers(_train_digits, 2, None, STEPS)[0]
    int4 = run_workers(_train_digits, 2, "int4", STEPS)[0]
    topk = run_workers(_train_digits, 2, "topk1", STEPS)[0]
    print(f"digits test accuracy after {STEPS} steps: fp32 {ref:.4f}, int4 {int4:.4f}, topk1 {topk:.4f}")
    assert ref > 0.9, "the fp32 baseline itself must learn the task"
    assert int4 >= ref - 0.01
    assert topk >= ref - 0.02
