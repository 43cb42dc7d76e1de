"""Measured step times, to check the cost model's predictions.

Launched distributed (torchrun), each plan runs for real: the workload wrapped in DDP, FastML's hook
registered (uncompressed DDP: no hook), a few warm-up steps, then the median of the timed steps; the
slowest rank's figure counts. Sharded runs wrap the workload in FSDP2 instead (``fully_shard`` on each
unit of :func:`~fastml_strategy.autotune.profile.fsdp_unit_modules`, then the root; HSDP on a
``(replicate, shard)`` mesh of nodes x ranks per node) and register
:func:`fastml_strategy.fsdp.register` (uncompressed: FSDP's own collectives). Plans take turns in rounds so that load from other processes on a
shared machine is spread over all of them. In a single process there is no link to measure, so the check covers
what can be measured: compute plus the codecs' round trips (:class:`SimulatedCompression`), against
the model's prediction of the same (:func:`predict_local`).
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Mapping

import torch

from fastml_strategy.autotune.calibrate import preserved_rng
from fastml_strategy.autotune.costmodel import CANDIDATES, Profile
from fastml_strategy.autotune.profile import SimulatedCompression
from fastml_strategy.autotune.workload import Workload
from fastml_strategy.config import Plan

__all__ = ["LossModule", "measure_distributed", "measure_local", "predict_local", "prefixed", "steps_per_plan"]


class LossModule(torch.nn.Module):
    """``forward(batch) = loss_fn(model, batch)``, so that DDP sees the whole step's forward."""

    def __init__(self, model: torch.nn.Module, loss_fn: Any) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, batch: Any) -> torch.Tensor:
        return self.loss_fn(self.model, batch)


def prefixed(plan: Plan, prefix: str) -> Plan:
    """The same plan for parameters seen under ``prefix`` (exact names only; patterns get the prefix)."""
    import re

    layers = []
    for k, v in plan.layers:
        layers.append((f"re:{re.escape(prefix)}(?:{k[3:]})" if k.startswith("re:") else prefix + k, v))
    return Plan(default=plan.default, layers=tuple(layers), min_numel=plan.min_numel, seed=plan.seed,
                name=plan.name)


def _sharded_module(model: torch.nn.Module, loss_fn: Any, sharding: Any, ranks_per_node: int,
                    plan: Plan | None) -> tuple[torch.nn.Module, Any]:
    """The workload under FSDP2 (or HSDP) as the cost model sees it, FastML registered with ``plan``
    (None: FSDP's own collectives). Returns the root module and FastML's state (or None)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from fastml_strategy.autotune.profile import fsdp_unit_modules
    from fastml_strategy.fsdp import register

    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    mp = MixedPrecisionPolicy(param_dtype=dtypes[sharding.param_dtype],
                              reduce_dtype=dtypes[sharding.reduce])
    kw: dict[str, Any] = {"mp_policy": mp, "reshard_after_forward": sharding.reshard_after_forward}
    if sharding.kind == "hsdp":
        from torch.distributed.device_mesh import init_device_mesh

        device = "cuda" if next(model.parameters()).is_cuda else "cpu"
        w = dist.get_world_size()
        kw["mesh"] = init_device_mesh(device, (w // ranks_per_node, ranks_per_node),
                                      mesh_dim_names=("replicate", "shard"))
    root = LossModule(model, loss_fn)
    for path in fsdp_unit_modules(model):
        fully_shard(model.get_submodule(path), **kw)
    root_kw = dict(kw)
    root_kw.pop("reshard_after_forward")  # FSDP2 keeps the root unsharded after forward by default
    fully_shard(root, **root_kw)
    state = register(root, plan=prefixed(plan, "model.")) if plan is not None else None
    return root, state


# Timed steps of one plan in one round, at least: one step per round is the median of nothing.
MIN_ROUND_STEPS = 2


def steps_per_plan(steps: int, warmup: int = 2, rounds: int = 3) -> int:
    """Steps :func:`measure_distributed` runs of each plan for ``steps`` timed ones (untimed
    included): what the budget keeps for it."""
    return warmup + rounds * (1 + max(MIN_ROUND_STEPS, -(-steps // rounds)))


def measure_distributed(wl: Workload, plans: Mapping[str, Plan | None], steps: int = 10,
                        warmup: int = 2, rounds: int = 3, sharding: Any = None,
                        ranks_per_node: int = 1,
                        bucket_mb: Mapping[str, float | None] | None = None) -> dict[str, float]:
    """Seconds per step of each plan (None: plain DDP, or FSDP's own collectives when ``sharding``
    is FSDP/HSDP), as the slowest rank saw it. All ranks call. ``bucket_mb``: DDP's
    ``bucket_cap_mb`` by plan label (absent or None: DDP's default buckets).

    Every plan gets its own DDP model (and hook) up front and ``warmup`` untimed steps; then the
    plans take turns, ``rounds`` rounds of ``ceil(steps / rounds)`` (at least
    :data:`MIN_ROUND_STEPS`) timed steps each, so load from other processes on a shared machine hits
    every plan alike. Each round of a plan starts with one more untimed step: the first step after
    another plan pays for what that plan left behind (on a ``tc``-shaped link, TCP windows collapsed
    by its drops: after fp32 DDP's 10.8 MB per step, a plan was once timed at 3.66 s per step that
    trained at 1.35 s). A step counts at the slowest rank's time; per plan, the median step.
    """
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from fastml_strategy import register_hook

    runs = {}
    states = []  # FastML's FSDP states, kept alive with their models
    for label, plan in plans.items():
        with preserved_rng():  # every plan starts from the same weights; the caller's RNG untouched
            torch.manual_seed(0)
            model = wl.fresh_model()
        if sharding is not None and sharding.sharded:
            ddp, st = _sharded_module(model, wl.loss_fn, sharding, ranks_per_node, plan)
            states.append(st)
        else:
            mb = (bucket_mb or {}).get(label)
            ddp = DDP(LossModule(model, wl.loss_fn), **({} if mb is None else {"bucket_cap_mb": mb}))
            if plan is not None:
                register_hook(ddp, prefixed(plan, "model."))
        # fully_shard swaps the model's parameters for their shards in place: same model object
        runs[label] = (ddp, wl.make_optimizer(model), wl.batch_stream(), [])

    def one_step(ddp: Any, opt: Any, stream: Any) -> float:
        batch = next(stream)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        ddp(batch).backward()
        opt.step()
        return time.perf_counter() - t0

    for ddp, opt, stream, _ in runs.values():
        for _ in range(warmup):
            one_step(ddp, opt, stream)
    per_round = max(MIN_ROUND_STEPS, -(-steps // rounds))
    for _ in range(rounds):
        for ddp, opt, stream, times in runs.values():
            dist.barrier()
            one_step(ddp, opt, stream)  # re-entry after another plan: not timed
            times.extend(one_step(ddp, opt, stream) for _ in range(per_round))
    # every rank timed the same steps: each step at its slowest rank, then the median per plan
    t = torch.tensor([r[3] for r in runs.values()], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return {label: statistics.median(row) for label, row in zip(runs, t.tolist())}


def measure_local(wl: Workload, choices: Mapping[str, Mapping[str, str] | None], steps: int = 10,
                  warmup: int = 2, rounds: int = 3) -> dict[str, float]:
    """Median seconds per step in one process: compute plus each layer's codec round trip (no link).

    Plans take turns (``rounds`` rounds of ``steps / rounds`` steps each), so a burst of load from
    other processes on a shared machine hits every plan alike; the median drops preempted steps.
    """
    runs = {}
    for label, choice in choices.items():
        with preserved_rng():  # every plan starts from the same weights; the caller's RNG untouched
            torch.manual_seed(0)
            model = wl.fresh_model()
        opt = wl.make_optimizer(model)
        sim = SimulatedCompression(model, {n: CANDIDATES[o] for n, o in (choice or {}).items()})
        runs[label] = (model, opt, sim, wl.batch_stream(), [])

    def one_step(model: Any, opt: Any, sim: Any, stream: Any) -> float:
        batch = next(stream)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        wl.loss_fn(model, batch).backward()
        sim.apply()
        opt.step()
        return time.perf_counter() - t0

    for model, opt, sim, stream, _ in runs.values():
        for _ in range(warmup):
            one_step(model, opt, sim, stream)
    per_round = max(1, -(-steps // rounds))
    for _ in range(rounds):
        for model, opt, sim, stream, times in runs.values():
            times.extend(one_step(model, opt, sim, stream) for _ in range(per_round))
    return {label: statistics.median(r[4]) for label, r in runs.items()}


def predict_local(profile: Profile, choice: Mapping[str, str] | None) -> float:
    """The model's single-process step time: compute plus one round trip per compressed layer."""
    codec = 0.0
    for lp in profile.layers:
        o = (choice or {}).get(lp.name, "none")
        if lp.tunable and o != "none":
            codec += lp.codec_s[o]
    return profile.compute_s + codec
