"""FastML under sharded training: per-layer compressed gradients for FSDP2 (``fully_shard``) and HSDP.

What it replaces
----------------
FSDP2 reduces each unit's gradients (one ``fully_shard`` module's parameters) with one reduce-scatter;
HSDP (shard inside a node, replicate across nodes) then all-reduces every shard across the replicas,
over the slow link. :func:`register` swaps in FastML's collectives:

- **FSDP** (1-D mesh): the unit's reduce-scatter becomes FastML's compressed reduce-scatter
  (:class:`fastml_strategy.comm._reduce_scatter.CompressedReduceScatter`): each rank encodes the W
  chunks of every gradient with the layer's codec and error feedback, one all_to_all, and each rank
  decodes and sums its own chunk. Bytes per rank: (W-1)/W of the compressed size.
- **HSDP**: the cross-replica all-reduce of each reduced shard becomes FastML's scatter-reduce-
  allgather over the replicas (the DDP path's collective: replicas stay bit-identical), with error
  feedback on the shard (1/S of the model per rank). The intra-node reduce-scatter stays FSDP's own
  (fast link) unless ``shard_plan`` compresses it too.

HSDP comes in two forms, both supported: ``fully_shard(m, mesh=mesh_2d)`` on a
``("replicate", "shard")`` mesh (FastML takes the cross-replica all-reduce over from FSDP), or
``fully_shard(m, mesh=mesh_2d["shard"])`` plus ``register(..., replicate_group=mesh_2d["replicate"]
.get_group())``.

Memory
------
A reduce-scatter's error feedback keeps, on every rank, a residual for every chunk it sends: as large
as the unsharded gradient (4 bytes per parameter in fp32). ``stats()["residual_bytes"]`` says what this
rank holds; ``CodecConfig(residual_dtype="bf16")`` halves it and ``error_feedback=False`` removes it
(docs/fsdp.md has the table and the accuracy each choice costs). Residuals are updated in place (one
buffer, not DDP's two); a block that is not finite keeps its residual, and message buffers exist only
during the call.

Usage::

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    state = fastml_strategy.fsdp.register(model, plan="int4")
    ...train as usual (set_requires_gradient_sync(False) micro-batches are not compressed)...
    state.stats()["compression_ratio"], state.stats()["residual_bytes"]

The plan is keyed by the parameter names of ``model.named_parameters()`` (FSDP2 keeps them), so one
plan file serves DDP and FSDP alike. Relies on FSDP2 extension points (``set_custom_reduce_scatter``,
``set_all_reduce_hook``, ``set_reduce_scatter_unused_params``) and some FSDP2 internals (the unit's
parameter list and mesh); :func:`register` checks they exist and names the torch version otherwise.

The package, by job
-------------------
- ``_units``: the torch checks, one FSDP unit's parameters and their layout, finding a model's units;
- ``_state``: :class:`FSDPState` (the step, the failure path, the collectives FSDP calls, stats);
- ``_checkpoint``: distributed checkpoints (:func:`save_distributed`, :func:`load_distributed`);
- ``_all_gather``: the quantized parameter all-gather (``all_gather_bits``);
- this module: :func:`register`, which checks, agrees across ranks and installs them.

Every layout (FSDP2's dim-0 rule, the reduce-scatter's messages, the all-gather's segments) is
:mod:`fastml_strategy.wire`'s, which the autotuner's cost model prices too.
"""

# No `from __future__ import annotations`: torch's ReduceScatter is an ABC with annotated signatures.

from typing import Any, Optional

import torch
import torch.distributed as dist

from fastml_strategy._advice import advise, little_compressed
from fastml_strategy.comm._distributed import agreed_plan, checked_plan, model_names
from fastml_strategy.comm._lowrank import refuse_lowrank
from fastml_strategy.comm._peers import FailureChannel
from fastml_strategy._validate import LAYER_STATS_EVERY, whole_number
from fastml_strategy.fsdp._all_gather import _AllGatherCounter, _make_all_gather
from fastml_strategy.fsdp._checkpoint import CHECKPOINT_KEY, load_distributed, save_distributed  # noqa: F401
from fastml_strategy.fsdp._state import _REGISTERED, FSDPState, _make_comm, _scale_of  # noqa: F401
from fastml_strategy.fsdp._units import _OWNER, TESTED_TORCH, _fsdp_api, _fsdp_units, _Unit  # noqa: F401
from fastml_strategy.wire.shard import shard_chunks  # noqa: F401  FSDP2's sharding rule, in one place

__all__ = ["register", "FSDPState", "shard_chunks", "save_distributed", "load_distributed", "TESTED_TORCH"]


def _check_arguments(model, all_gather_bits, layer_stats_every) -> None:
    """:func:`register`'s arguments that need no model inspection."""
    if all_gather_bits is not None and (not isinstance(all_gather_bits, int) or isinstance(
            all_gather_bits, bool) or not 2 <= all_gather_bits <= 8):
        raise ValueError(f"{_OWNER}: all_gather_bits={all_gather_bits!r}; use 2-8 (8 is ZeRO++'s choice; "
                         f"parameters lose more precision with fewer bits) or None for FSDP's own all-gather")
    whole_number("layer_stats_every", layer_stats_every, 0, owner=_OWNER, note=" (0 turns it off)")
    live = _REGISTERED.get(model)
    if live is not None and not live._closed:
        raise ValueError(f"{_OWNER}: this model is registered already; keep the FSDPState the first register() "
                         f"returned, or call its close() first")



def _inspect(model, replicate_group, shard_plan, all_gather_bits, layer_stats_every, found: dict,
             settings: dict) -> None:
    """Everything :func:`register` checks locally before the ranks agree (``agreed_plan``'s check):
    fills ``found`` (the model's names, aliases and frozen parameters, its units, the mesh, the
    replicate group, the shard plan) and adds the mesh to the ``settings`` ranks must share."""
    _check_arguments(model, all_gather_bits, layer_stats_every)
    units, native_hsdp = _fsdp_units(model)
    trainable, al, fr = model_names(model)
    found["names"].extend(trainable)
    found["aliases"].update(al)
    found["frozen"].extend(fr)
    if native_hsdp and replicate_group is not None:
        raise ValueError(f"{_OWNER}: the model is sharded on a 2-D (replicate, shard) mesh, which already "
                         f"names the replicas; drop replicate_group (or shard on the 1-D shard mesh and keep it)")
    if replicate_group is not None and not isinstance(replicate_group, dist.ProcessGroup):
        raise TypeError(f"{_OWNER}: replicate_group is a {type(replicate_group).__name__}; pass a "
                        f"torch.distributed ProcessGroup (e.g. mesh['replicate'].get_group()) or None")
    shard_size = units[0].group.mesh_info.shard_mesh_size
    rep = (units[0].group.mesh_info.replicate_process_group if native_hsdp else replicate_group)
    rep_size = dist.get_world_size(rep) if rep is not None else 1
    if shard_size * rep_size != dist.get_world_size():
        raise ValueError(
            f"{_OWNER}: shards of {shard_size} ranks x {rep_size} replicas is not the world size "
            f"{dist.get_world_size()}; the replicate group must hold one rank of every shard group "
            f"(mesh['replicate'].get_group() of an (R, S) mesh)")
    if shard_plan is not None and rep is None:
        raise ValueError(f"{_OWNER}: shard_plan is for HSDP (the intra-node reduce-scatter); with plain FSDP, "
                         f"give the plan as plan=")
    if shard_plan is not None:
        found["shard_plan"] = checked_plan(shard_plan, model)  # the check every adapter makes
    found.update(units=units, native_hsdp=native_hsdp, shard_size=shard_size, rep=rep)
    settings.update(shard_size=shard_size, replicate_size=rep_size)


def _install(state: "FSDPState", units: list, native_hsdp: bool, rep, all_gather_bits, restore: list) -> None:
    """Swap FastML's collectives into every unit (recording in ``restore`` how to undo it)."""
    _, ReduceScatter, FSDPMeshInfo, _ = _fsdp_api()
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather

    for unit in units:
        g, mod = unit.group, unit.module
        # Every parameter that requires a gradient takes part in every reduce-scatter (zeros when no
        # rank used it): the layout then depends only on requires_grad, the same on every rank.
        was_unused = g.reduce_scatter_unused_params
        g.reduce_scatter_unused_params = True
        restore.append(lambda g=g, v=was_unused: setattr(g, "reduce_scatter_unused_params", v))
        if native_hsdp:
            # FastML takes the cross-replica all-reduce over: FSDP sees a 1-D shard mesh (its own
            # reduce-scatter then averages over the shard only, and calls the all-reduce hook).
            hsdp_info = g.mesh_info
            one_d = FSDPMeshInfo(mesh=hsdp_info.mesh, shard_mesh_dim=hsdp_info.shard_mesh_dim)
            one_d.reduce_scatter_process_group = hsdp_info.reduce_scatter_process_group
            post = g.post_forward_mesh_info
            g.mesh_info = one_d
            if post is hsdp_info:  # reshard_after_forward=True: after forward, back to the same mesh
                g.post_forward_mesh_info = one_d
            restore.append(lambda g=g, m=hsdp_info, pf=post: (setattr(g, "mesh_info", m),
                                                              setattr(g, "post_forward_mesh_info", pf)))
        if state._rs is not None or rep is not None:
            old = g._reduce_scatter_comm
            mod.set_custom_reduce_scatter(_make_comm(ReduceScatter, state, unit, state._rs is not None))
            restore.append(lambda g=g, c=old: setattr(g, "_reduce_scatter_comm", c))
        if all_gather_bits is not None or rep is not None:
            old_ag = g._all_gather_comm
            mod.set_custom_all_gather(_make_all_gather(AllGather, state, unit, all_gather_bits is not None))
            restore.append(lambda g=g, c=old_ag: setattr(g, "_all_gather_comm", c))
        if rep is not None:
            old_hook = g._all_reduce_hook
            mod.set_all_reduce_hook(lambda out, unit=unit: state._all_reduce(unit, out))
            restore.append(lambda g=g, h=old_hook: setattr(g, "_all_reduce_hook", h))



def register(
    model: torch.nn.Module,
    plan: Any = None,
    *,
    replicate_group: Any = None,
    shard_plan: Any = None,
    all_gather_bits: Optional[int] = None,
    layer_stats_every: int = LAYER_STATS_EVERY,
) -> FSDPState:
    """Compress an FSDP2 model's gradient reduction with FastML; returns its :class:`FSDPState`.

    Call on every rank after ``fully_shard`` has been applied (submodules first, the root last) and
    before the first backward. ``plan``: a :class:`~fastml_strategy.Plan`, a recipe name, a plan
    JSON path, a dict, or None (``FASTML_PLAN``, else ``int4``), keyed by the names of
    ``model.named_parameters()``; it compresses the reduce-scatter (FSDP) or, with HSDP, the
    cross-replica all-reduce. ``replicate_group``: HSDP with a 1-D shard mesh, the process group of
    this rank's replicas (omit it for a 2-D ``("replicate", "shard")`` mesh: FastML reads it there).
    ``shard_plan``: HSDP only, a plan for the intra-node reduce-scatter too (default None: FSDP's own,
    uncompressed, for the fast link inside a node). ``all_gather_bits``: opt-in, quantize FSDP's
    parameter all-gathers (forward, and backward when resharded) to this many bits (8: ZeRO++ "qwZ";
    blocks of 256, round to nearest): forward and backward then compute with quantized copies of the
    parameters, while the optimizer updates the exact shards. Default None: FSDP's own all-gather.
    ``layer_stats_every``: measure per-layer error every N steps (0: never).

    Every rank raises the same error before any step if the model, the plans or the groups are wrong
    on any of them.
    """
    _fsdp_api()  # FSDP2 and the extension points FastML needs, or an error naming the torch version
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{_OWNER}: torch.distributed is not initialised; call dist.init_process_group "
                           f"(torchrun sets the environment) before fully_shard")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{_OWNER}: model is a {type(model).__name__}; pass the root module that fully_shard "
                        f"was applied to")
    world, world_size = dist.group.WORLD, dist.get_world_size()
    # Everything that can be wrong is checked locally first (_inspect), then agreed across ranks (no
    # rank hangs): a bad argument on one rank raises the same error on every rank, and so do settings
    # that differ: what ranks must share beside the plan (they change the collectives; _inspect adds
    # the mesh).
    settings: dict = {"all_gather_bits": all_gather_bits, "shard_plan": shard_plan is not None}
    found: dict = {"names": [], "aliases": {}, "frozen": []}  # filled by _inspect
    names, aliases, frozen = found["names"], found["aliases"], found["frozen"]
    plan_obj = agreed_plan(plan, names, world, world_size, aliases=aliases, frozen=frozen, settings=settings,
                           owner=_OWNER, check=lambda: _inspect(model, replicate_group, shard_plan, all_gather_bits,
                                                                layer_stats_every, found, settings))
    shard_plan_obj = found.get("shard_plan")
    if shard_plan_obj is not None:  # the same on every rank too
        shard_plan_obj = agreed_plan(shard_plan_obj, names, world, world_size, aliases=aliases, frozen=frozen)
    for p in (plan_obj, shard_plan_obj):  # agreed: every rank raises alike
        if p is not None:
            refuse_lowrank(p, _OWNER, "FSDP2's reduce-scatter and HSDP's cross-replica all-reduce carry flat "
                           "shards of each parameter, not its matrix")
    units, native_hsdp, shard_size, rep = (found["units"], found["native_hsdp"], found["shard_size"],
                                           found["rep"])
    if dist.get_rank() == 0 and plan_obj is not None:  # the DDP hook's advice (min_numel holding back a lossy plan)
        little = little_compressed(plan_obj, model.named_parameters(), world_size, owner="FastML FSDP")
        if little is not None:
            advise("min_numel", little, stacklevel=2)
    restore: list = []
    state = FSDPState(model, units, plan_obj, shard_plan_obj, shard_size, units[0].group.mesh_info.shard_mesh_rank,
                      rep, layer_stats_every, restore)
    _REGISTERED[model] = state
    if rep is not None:
        state._channel = FailureChannel(world, dist.get_rank())
        if units[0].params[0].sharded_param.device.type == "cpu":  # (NCCL's wait does not block)
            for eng in (state._ar, state._rs):
                if eng is not None:
                    eng.wait = state._channel.wait
    if all_gather_bits is not None:
        state._ag = _AllGatherCounter(all_gather_bits, shard_size)
    _install(state, units, native_hsdp, rep, all_gather_bits, restore)
    return state
