"""One interface for FastML's three engines, and the one call that attaches the right one.

FastML runs in one of three training modes, each with its own engine:

- :class:`~fastml_strategy.FastMLState` (``kind == "ddp"``): the DDP comm hook, flat or hierarchical;
- :class:`~fastml_strategy.fsdp.FSDPState` (``"fsdp"``): FSDP2's reduce-scatter / HSDP's
  cross-replica all-reduce and the quantized parameter all-gather;
- :class:`~fastml_strategy.LocalSGD` (``"localsgd"``): local steps with a compressed outer
  synchronisation.

Each implements :class:`Engine`, so an adapter (Accelerate, the Hugging Face Trainer, Lightning), a
checkpoint wrapper or a logger handles all three alike:

- ``stats()`` returns cumulative figures of this rank; every engine's dict has the keys of
  :data:`COMMON_STATS` (``bytes_sent`` counts what FastML sent through every collective it ran,
  ``bytes_uncompressed`` what the uncompressed baseline of that mode would have sent), plus its own;
- ``state_dict(all_ranks=False)`` / ``load_state_dict(sd, strict=True)``: what a checkpoint keeps
  (the dict's ``"kind"`` names the engine, so a DDP state loaded into LocalSGD fails with a message);
- ``close()``: give the model back and stop FastML's threads; a second call does nothing;
- ``failure``: the first error that broke the engine (every later collective raises it), or None.

:func:`attach` is the entry point for a model a framework has already wrapped: it finds the
DistributedDataParallel or FSDP2 module inside and registers the DDP hook or FSDP's engine on it, with
the same checks and errors whichever adapter calls it. LocalSGD is built on an unwrapped model instead
(:class:`~fastml_strategy.LocalSGD`), since DDP or FSDP would communicate every step.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Protocol, runtime_checkable

from fastml_strategy._integration import find_ddp, find_fsdp2, is_fsdp1
from fastml_strategy.config import Plan

__all__ = ["Engine", "COMMON_STATS", "attach"]

# Keys every engine's ``stats()`` has (tests/test_engine.py checks them on all three).
COMMON_STATS = ("engine", "world_size", "plan", "bytes_sent", "bytes_uncompressed", "compression_ratio",
                "layers")


@runtime_checkable
class Engine(Protocol):
    """What every FastML engine offers (see the module docstring)."""

    kind: str

    def stats(self) -> dict: ...

    def state_dict(self, all_ranks: bool = False) -> dict: ...

    def load_state_dict(self, sd: dict, strict: bool = True) -> None: ...

    def close(self) -> None: ...

    @property
    def failure(self) -> Optional[BaseException]: ...


def attach(model: Any, plan: Plan | str | os.PathLike | dict | None = None, *, owner: str = "fastml_strategy.attach",
           layer_stats_every: int | None = None, check_replicas_every: int = 0, ranks_per_node: int | None = None,
           shard_plan: Plan | str | os.PathLike | dict | None = None, replicate_group: Any = None,
           all_gather_bits: int | None = None) -> Optional[Engine]:
    """Register FastML's engine on ``model`` as a framework wrapped it; call it on every rank.

    A DistributedDataParallel inside ``model`` gets the DDP hook
    (:func:`~fastml_strategy.register_hook`), an FSDP2 module (``fully_shard``) FSDP's engine
    (:func:`fastml_strategy.fsdp.register`); None when there is neither (one process, DeepSpeed): the
    caller then checks the plan against the model and says that nothing is compressed.
    ``layer_stats_every``: None for the engine's default. ``check_replicas_every`` and
    ``ranks_per_node`` are DDP's; ``shard_plan``, ``replicate_group`` and ``all_gather_bits`` are
    FSDP's and refused for another model. ``owner`` names the caller in errors. Raises TypeError for
    FSDP1 (which FastML does not support), on every rank alike: the model's type is the same everywhere."""
    if is_fsdp1(model):
        raise TypeError(f"{owner}: the model is wrapped in FSDP1 (FullyShardedDataParallel), which FastML does "
                        f"not compress; use FSDP2 (torch.distributed.fsdp.fully_shard; in Accelerate "
                        f"fsdp_version: 2) or DDP")
    ddp = find_ddp(model)
    fsdp = find_fsdp2(model) if ddp is None else None
    fsdp_only = [k for k, v in (("shard_plan", shard_plan), ("replicate_group", replicate_group),
                                ("all_gather_bits", all_gather_bits)) if v is not None]
    if fsdp is None and fsdp_only:
        raise ValueError(f"{owner}: {fsdp_only} are for an FSDP2 model; this one is a {type(model).__name__}, "
                         f"not sharded with fully_shard (fsdp_version: 2)")
    every = {} if layer_stats_every is None else {"layer_stats_every": layer_stats_every}
    if ddp is not None:
        from fastml_strategy.hook import register_hook

        return register_hook(ddp, plan, check_replicas_every=check_replicas_every, ranks_per_node=ranks_per_node,
                             **every)
    if fsdp is not None:
        from fastml_strategy.fsdp import register

        return register(fsdp, plan, replicate_group=replicate_group, shard_plan=shard_plan,
                        all_gather_bits=all_gather_bits, **every)
    return None
