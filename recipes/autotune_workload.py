"""A ``fastml-autotune`` target: the digits MLP of the other recipes, as a ``Workload`` factory.

Copy it and put your own model, data, loss and metric in its place::

    fastml-autotune recipes/autotune_workload.py:workload --link 1gbit --world-size 8 --target-steps 20000 --out tune-out
    torchrun --nproc_per_node 2 -m fastml_strategy.autotune.cli recipes/autotune_workload.py:workload --out tune-out

The tuner calls ``workload()`` once per calibration run, so the factory builds everything afresh
from fixed seeds: every run then starts from the same weights and sees the same batches (the report
calls such runs "paired"). The batches are ONE rank's: under torchrun each rank takes its own shard,
as your training script would.
"""

from __future__ import annotations

import torch

from fastml_strategy._digits import accuracy, digits_mlp, load_digits_split
from fastml_strategy.autotune import Workload

BATCH_SIZE = 32  # per rank, as recipes/train_torchrun.py trains


def workload() -> Workload:
    x, y, xt, yt = load_digits_split(seed=0)
    rank, world = 0, 1
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    # A fixed order (one shuffle with a fixed seed, this rank's slice), re-iterated by the tuner.
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))[rank::world]
    batches = [(x[perm[i:i + BATCH_SIZE]], y[perm[i:i + BATCH_SIZE]])
               for i in range(0, len(perm) - BATCH_SIZE + 1, BATCH_SIZE)]

    def loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        xb, yb = batch
        return torch.nn.functional.cross_entropy(model(xb), yb)

    return Workload(
        model=digits_mlp(hidden=256, seed=0),  # 64 -> 256 -> 256 -> 10: two weights large enough to tune
        batches=batches,
        loss_fn=loss_fn,
        eval_fn=lambda model: accuracy(model, xt, yt),  # higher is better: the accuracy rule's units
        optimizer=lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
        name="digits",
    )
