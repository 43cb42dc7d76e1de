"""Helpers shared by the fault tests: a small multi-bucket MLP and one training step."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

# tests/_dist.py (run_workers) lives one level up.
_TESTS = str(Path(__file__).resolve().parents[1])
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)


def mlp(width: int = 128) -> torch.nn.Module:
    """32 -> width -> width -> 10: two weights of >= 4096 elements (compressed), spread over
    several DDP buckets with ``bucket_cap_mb=0.02``."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, width), torch.nn.ReLU(),
                               torch.nn.Linear(width, width), torch.nn.ReLU(),
                               torch.nn.Linear(width, 10))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of ``rank`` at ``step``: a pure function of both, so a resumed run sees the same."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)


def loss_of(model, rank: int, step: int) -> torch.Tensor:
    x, y = batch(rank, step)
    return torch.nn.functional.cross_entropy(model(x), y)


def flat_params(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])
