"""Models and helpers shared by the FSDP tests (real gloo processes, see tests/_dist.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

# tests/_dist.py (run_workers) lives one level up.
_TESTS = str(Path(__file__).resolve().parents[1])
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)


class OddNet(torch.nn.Module):
    """Odd shapes: 37 and 5 rows do not divide by 2, 3 or 4 ranks, so FSDP pads their shards (and
    ``c`` has fewer rows than 4 ranks: some ranks own an empty chunk)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.a = torch.nn.Linear(13, 37)
        self.b = torch.nn.Linear(37, 5)
        self.c = torch.nn.Linear(5, 3)
        # the root unit's own parameter, used only when forward(..., branch=True): a rank that takes
        # the other branch has no gradient for it (FSDP2 units must run on every rank; parameters
        # inside a unit may go unused)
        self.skip = torch.nn.Parameter(torch.randn(3, 13) * 0.1)

    def forward(self, x: torch.Tensor, branch: bool = False) -> torch.Tensor:
        y = self.c(torch.relu(self.b(torch.relu(self.a(x)))))
        return y + x @ self.skip.T if branch else y


def shard(model: torch.nn.Module, mesh=None, **kw) -> torch.nn.Module:
    """fully_shard every child module that holds parameters, then the root."""
    from torch.distributed.fsdp import fully_shard

    for child in model.children():
        if any(True for _ in child.parameters()):
            fully_shard(child, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return model


def full_params(model: torch.nn.Module) -> dict[str, list]:
    """Every parameter, unsharded, as plain lists (picklable across processes)."""
    return {n: p.detach().full_tensor().float().reshape(-1).tolist() for n, p in model.named_parameters()}


def local_params(model: torch.nn.Module) -> dict[str, list]:
    return {n: p.detach().to_local().float().reshape(-1).tolist() for n, p in model.named_parameters()}


def max_diff(a: dict[str, list], b: dict[str, list]) -> float:
    return max(float((torch.tensor(a[n]) - torch.tensor(b[n])).abs().max()) if a[n] else 0.0 for n in a)


def plan(recipe: str, **kw):
    """A recipe that compresses every tensor, however small (the test models are tiny)."""
    import fastml_strategy as fm

    return fm.Plan.from_recipe(recipe, min_numel=0, **kw)
