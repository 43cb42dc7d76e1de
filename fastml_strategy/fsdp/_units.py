"""FSDP2's units as FastML sees them: the torch checks, one unit's parameters and their layout
(FSDP2's dim-0 rule, :func:`fastml_strategy.wire.shard_chunks`), and the discovery of a model's units."""

from __future__ import annotations

import logging

import torch

from fastml_strategy.comm._layouts import ShardedTensor
from fastml_strategy.wire.shard import shard_chunks

log = logging.getLogger("fastml_strategy.fsdp")

TESTED_TORCH = "2.13"
_NEEDED = ("set_custom_reduce_scatter", "set_all_reduce_hook", "set_reduce_scatter_unused_params")
_OWNER = "fastml_strategy.fsdp.register"


def _fsdp_api():
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
        from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, HSDPMeshInfo
    except ImportError as e:
        raise RuntimeError(
            f"FastML's FSDP support needs FSDP2 (torch.distributed.fsdp.fully_shard with custom "
            f"reduce-scatter hooks: torch 2.9 or newer; tested with {TESTED_TORCH}); this is torch "
            f"{torch.__version__} ({e}). Upgrade torch, or train with DDP and register_hook."
        ) from None
    missing = [m for m in _NEEDED if not hasattr(FSDPModule, m)]
    if missing:
        raise RuntimeError(
            f"FastML's FSDP support needs FSDPModule.{', '.join(missing)} (torch 2.9 or newer; tested "
            f"with {TESTED_TORCH}); this is torch {torch.__version__}. Upgrade torch, or train with "
            f"DDP and register_hook.")
    return FSDPModule, ReduceScatter, FSDPMeshInfo, HSDPMeshInfo


class _Unit:
    """One FSDP parameter group (a ``fully_shard`` module's own parameters) and its names."""

    def __init__(self, index: int, module, group, names: dict) -> None:
        self.index = index
        self.module = module
        self.group = group  # FSDPParamGroup (private)
        self.params = list(group.fsdp_params)
        self.names = [names[id(fp.sharded_param)] for fp in self.params]

    def layout_of(self, fp, world_size: int) -> tuple[tuple[int, ...], int]:
        return shard_chunks(fp._orig_size, world_size, fp.fsdp_placement.dim)

    def tensors(self, world_size: int) -> list[ShardedTensor]:
        """The gradients in this step's reduce-scatter input, in FSDP's order. FastML turns on
        ``set_reduce_scatter_unused_params``, so these are every parameter that requires a gradient
        (a parameter no rank used travels as zeros, as FSDP does it) and not the frozen ones."""
        out = []
        for fp, name in zip(self.params, self.names):
            # FSDPParam's private unsharded parameter (set by the first all-gather; no public query
            # whether a parameter takes a gradient). tests/test_upstream_internals.py fails if torch
            # renames it; here a logged warning says why the layout will not match.
            if not hasattr(fp, "_unsharded_param"):
                log.warning("FastML: FSDP's FSDPParam has no _unsharded_param in torch %s (tested with %s): "
                            "%s is treated as frozen, and the reduce-scatter layout will not match FSDP's",
                            torch.__version__, TESTED_TORCH, name)
            up = getattr(fp, "_unsharded_param", None)
            if up is None or not up.requires_grad:
                continue
            chunks, padded = self.layout_of(fp, world_size)
            out.append(ShardedTensor(name, chunks, padded))
        return out


def _fsdp_units(model) -> tuple[list, bool]:
    """The FSDP units of an FSDP2 model (one per ``fully_shard`` module), checked against FastML's
    layout rule, and whether they sit on a 2-D HSDP mesh; raises naming the fix for a model FastML
    cannot take (FSDP1, not sharded, several parameter groups or meshes, an SPMD mesh)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    FSDPModule, _, _, HSDPMeshInfo = _fsdp_api()
    if isinstance(model, FullyShardedDataParallel) or any(
            isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        raise TypeError(f"{_OWNER}: this model is wrapped in FSDP1 (FullyShardedDataParallel), which FastML "
                        f"does not compress; shard it with FSDP2 (torch.distributed.fsdp.fully_shard) "
                        f"instead, or in Lightning use strategy='fastml_fsdp'")
    if not isinstance(model, FSDPModule):
        raise TypeError(f"{_OWNER}: the model ({type(model).__name__}) is not an FSDP2 module; apply "
                        f"fully_shard first (each block, then the root: fully_shard(model)) and register "
                        f"afterwards, on every rank")
    names = {id(p): n for n, p in model.named_parameters()}
    units, mesh_infos = [], set()
    for mod in model.modules():
        if not isinstance(mod, FSDPModule):
            continue
        groups = mod._get_fsdp_state()._fsdp_param_groups
        if len(groups) > 1:
            raise ValueError(
                f"{_OWNER}: module {type(mod).__name__} has {len(groups)} FSDP parameter groups "
                f"(shard_placement_fn with per-parameter meshes); FSDP's custom reduce-scatter takes one "
                f"group per module: shard those parameters on one mesh")
        for g in groups:
            unit = _Unit(len(units), mod, g, names)
            for fp, name in zip(unit.params, unit.names):
                chunks, padded = unit.layout_of(fp, g.mesh_info.shard_mesh_size)
                if padded != fp.padded_sharded_param_size.numel():
                    raise RuntimeError(
                        f"FastML's FSDP2 layout rule gives {padded} padded elements per shard for "
                        f"{name} {list(fp._orig_size)}, FSDP {fp.padded_sharded_param_size.numel()}; "
                        f"this torch ({torch.__version__}) shards differently from {TESTED_TORCH}")
            units.append(unit)
            mi = g.mesh_info
            if getattr(mi, "is_spmd_mesh", False):
                raise ValueError(f"{_OWNER}: FSDP on an SPMD mesh with dp_mesh_dims (tensor parallel) is not "
                                 f"supported yet")
            mesh_infos.add((type(mi).__name__, mi.shard_mesh_size, isinstance(mi, HSDPMeshInfo)))
    if not units:
        raise ValueError(f"{_OWNER}: the model has no FSDP-managed parameters; apply fully_shard to the "
                         f"modules that hold them")
    if len(mesh_infos) > 1:
        raise ValueError(f"{_OWNER}: FSDP units use different meshes ({sorted(mesh_infos)}); shard every "
                         f"unit on the same mesh")
    return units, next(iter(mesh_infos))[2]


