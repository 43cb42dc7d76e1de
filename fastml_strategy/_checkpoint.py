"""The checkpoint envelope of every FastML state (the DDP hook's, FSDP's, LocalSGD's), in one place.

One rank's state is a dict with ``format_version`` (:data:`STATE_FORMAT_VERSION`), a ``kind`` (none for
the DDP hook's, ``"fsdp"``, ``"localsgd"``), the plan, the rank and world size, and what the owner keeps
(residuals, counters, ...). Every rank's together, for a checkpoint that one rank writes, is
``{"format_version", "per_rank": [state of rank 0, ...]}`` (:func:`gather_states`, or
:func:`gather_to_rank_zero` where only rank 0 needs them). Loading goes the other way: :func:`own_rank_state`
picks this rank's entry and checks the version and the world size, :func:`check_state_kind` that it is
the owner's kind, :func:`check_saved_state` that it is this rank's, of this world size and (strictly)
of this plan, and :func:`fitting_residuals` keeps the residuals that fit the model. Each check raises
ValueError naming the mismatch and the fix, before anything is loaded.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import torch
import torch.distributed as dist

from fastml_strategy.config import Plan

__all__ = ["STATE_FORMAT_VERSION", "gather_states", "gather_to_rank_zero", "own_rank_state", "check_state_kind",
           "check_saved_state", "fitting_residuals"]

# The version of the envelope and of every kind's fields; raise it when a saved state would be misread.
STATE_FORMAT_VERSION = 1


def gather_states(own: dict, group: Any = None, world_size: int | None = None) -> dict:
    """Every rank's ``own`` state, as ``{"format_version", "per_rank": [...]}`` indexed by rank in
    ``group`` (default: every rank). A collective of ``group``: call it on every rank of it."""
    if world_size is None:
        world_size = dist.get_world_size(group) if dist.is_initialized() else 1
    if world_size == 1:
        return {"format_version": STATE_FORMAT_VERSION, "per_rank": [own]}
    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, own, group=group)
    return {"format_version": STATE_FORMAT_VERSION, "per_rank": gathered}


def _to_cpu(obj: Any) -> Any:
    """A copy of a (nested) state with every tensor on the CPU, to gather and save."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def gather_to_rank_zero(own: dict) -> Optional[dict]:
    """Every rank's part of a checkpoint that rank 0 alone writes (the framework adapters: between two
    synchronisations each rank's model, inner optimizer and LocalSGD state are its own). A collective of
    the default group: call it on every rank. Rank 0 gets ``{"format_version", "per_rank": [...]}``,
    indexed by rank, the other ranks None; ``own`` is copied to the CPU first."""
    own = _to_cpu(own)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return {"format_version": STATE_FORMAT_VERSION, "per_rank": [own]}
    rank = dist.get_rank()
    gathered: Optional[list] = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(own, gathered, dst=0)
    return {"format_version": STATE_FORMAT_VERSION, "per_rank": gathered} if rank == 0 else None


def check_saved_state(sd: dict, rank: int, world_size: int, plan: Optional[Plan], strict: bool,
                      owner: str, plan_key: str = "plan") -> None:
    """Raise ValueError, naming the mismatch and the fix, if a saved state is another rank's, from
    another world size or (``strict``) from another plan."""
    saved_rank, saved_world = sd.get("rank"), sd.get("world_size")
    if saved_world is not None and saved_world != world_size:
        raise ValueError(
            f"{owner}.load_state_dict: the state was saved by a run of {saved_world} ranks, this run has "
            f"{world_size}; error-feedback residuals belong to one rank, so resume with {saved_world} "
            f"ranks, or do not load the FastML state (its residuals then start from zero)")
    if saved_rank is not None and saved_rank != rank:
        raise ValueError(
            f"{owner}.load_state_dict: this is rank {saved_rank}'s state, loaded on rank {rank}; save with "
            f"state_dict(all_ranks=True) (or one file per rank) and give each rank its own")
    saved = sd.get(plan_key)
    saved_plan = Plan.from_dict(saved) if saved is not None else None
    if (saved_plan is None) != (plan is None) or (
            saved_plan is not None and saved_plan.digest() != plan.digest()):
        what = (f"the state was saved with {plan_key} {saved_plan.name if saved_plan else None!r}, "
                f"this run uses {plan.name if plan else None!r}")
        if strict:
            raise ValueError(
                f"{owner}.load_state_dict: {what}; pass the checkpoint's plan (Plan.from_dict("
                f"state['{plan_key}'])) to resume exactly, or load_state_dict(..., strict=False) to keep "
                f"the residuals of the layers both plans compress alike")
        warnings.warn(f"FastML: {what}; residuals are loaded for the layers both plans give one of the "
                      f"same size", stacklevel=3)


# What each kind of saved FastML state is, and what loads it (a DDP state has no "kind").
_STATE_KINDS = {
    None: ("a DDP FastML state (from register_hook)", "FastMLState.load_state_dict"),
    "fsdp": ("an FSDP FastML state (from fastml_strategy.fsdp.register)", "FSDPState.load_state_dict"),
    "localsgd": ("a LocalSGD state", "LocalSGD.load_state_dict"),
}


def check_state_kind(sd: dict, expected: Optional[str], owner: str) -> None:
    """Raise ValueError naming what ``sd`` is and what loads it, if it is not of kind ``expected``."""
    kind = sd.get("kind")
    if kind == expected:
        return
    what, loader = _STATE_KINDS.get(kind, (f"a FastML state of kind {kind!r}", None))
    fix = f"load it with {loader}" if loader else "pass what this object's state_dict() returned"
    raise ValueError(f"{owner}.load_state_dict: this is {what}; {fix}, or drop it to start fresh")


def fitting_residuals(residuals: dict, sizes: dict, strict: bool, owner: str) -> dict:
    """The saved residuals that fit ``sizes`` (name -> elements); with ``strict`` a residual of a
    parameter the model lacks, or of another size, raises ValueError naming it."""
    bad = [(n, t.numel(), sizes.get(n)) for n, t in residuals.items() if sizes.get(n) != t.numel()]
    if bad and strict:
        n, got, want = bad[0]
        have = "no such parameter" if want is None else f"{want} elements here"
        raise ValueError(
            f"{owner}.load_state_dict: the saved residual of {n!r} has {got} elements, the model has "
            f"{have}{f' (and {len(bad) - 1} more)' if len(bad) > 1 else ''}; resume the same model "
            f"(and mesh), or load with strict=False to start those residuals from zero")
    if bad:
        warnings.warn(f"FastML: residuals of {[b[0] for b in bad]} do not fit this model and start from zero",
                      stacklevel=3)
    return {n: t for n, t in residuals.items() if sizes.get(n) == t.numel()}


def own_rank_state(sd: Any, rank: int, world_size: int, version: int = STATE_FORMAT_VERSION,
                   owner: str = "FastML") -> dict:
    """This rank's entry of a saved FastML state: ``sd`` itself (one rank's ``state_dict()``) or its
    ``per_rank[rank]`` (``state_dict(all_ranks=True)``), after checking the format version and the
    world size."""
    if not isinstance(sd, dict) or "format_version" not in sd:
        raise ValueError(f"{owner}.load_state_dict: not a FastML state (no 'format_version'); pass what "
                         f"state_dict() returned")
    if sd["format_version"] != version:
        raise ValueError(f"FastML state format_version {sd['format_version']!r} is not supported by "
                         f"{owner} (this FastML reads {version})")
    if "per_rank" not in sd:
        return sd
    per = sd["per_rank"]
    if len(per) != world_size:
        raise ValueError(
            f"the checkpoint holds FastML state of {len(per)} ranks but this run has {world_size}; "
            f"resume with the same world size, or drop the FastML entry from the checkpoint to restart "
            f"error feedback from zero")
    return per[rank]
