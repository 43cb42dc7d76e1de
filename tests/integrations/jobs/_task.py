"""The small real task every integration job trains: scikit-learn's bundled 8x8 digits, an MLP.

Sizes are chosen so the plan has something to compress: the two hidden weight matrices (8192 and
16384 elements) are over the plan's ``min_numel`` (4096) and get quantized; the output layer (1280)
and the biases travel uncompressed.
"""

from __future__ import annotations

import hashlib
import json
import os

import torch
from torch import nn


def digits(n: int | None = None) -> torch.utils.data.TensorDataset:
    from fastml_strategy._digits import digits_table  # scikit-learn's digits, without importing it

    x, y = digits_table()
    x = torch.tensor(x, dtype=torch.float32) / 16.0
    y = torch.tensor(y, dtype=torch.long)
    if n is not None:
        x, y = x[:n], y[:n]
    return torch.utils.data.TensorDataset(x, y)


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))


def param_digest(module: nn.Module) -> str:
    """sha256 of every parameter's bytes, in name order: equal iff the replicas are bit-identical."""
    h = hashlib.sha256()
    for name, p in sorted(module.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def full_digest(module: nn.Module) -> str:
    """param_digest of an FSDP2 model: sharded parameters gathered first (a collective: every rank)."""
    from torch.distributed.tensor import DTensor

    h = hashlib.sha256()
    for name, p in sorted(module.state_dict().items()):
        t = p.full_tensor() if isinstance(p, DTensor) else p
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def units(module: nn.Module) -> int:
    """How many FSDP2 units (fully_shard modules) the model has."""
    from torch.distributed.fsdp import FSDPModule

    return sum(isinstance(m, FSDPModule) for m in module.modules())


def write_json(path: str, obj: dict) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=1, default=float)
    os.replace(path + ".tmp", path)
