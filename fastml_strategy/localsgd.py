"""Below 1 Gbit/s: local steps with a compressed outer synchronisation (DiLoCo, Streaming DiLoCo).

What it does
------------
Every rank trains its own copy of the model with its own (inner) optimizer, with no communication,
for ``every`` = H inner steps. Then the ranks synchronise: each computes its *pseudo-gradient*, the
parameters at the last synchronisation minus its parameters now, FastML's compressed
scatter-reduce-allgather averages it (per-layer plan, error-feedback residuals kept from one
synchronisation to the next; :mod:`fastml_strategy.collective`), and an outer optimizer (Nesterov SGD,
lr 0.7, momentum 0.9 as in DiLoCo) applies the average to the shared parameters. Every rank decodes the
same bytes and runs the same outer step, so the replicas are bit-identical after every
synchronisation.

Streaming (``fragments=F``, ``delay=tau``; Streaming DiLoCo): the parameters are cut into F fragments
(consecutive parameters of about equal size), synchronised at staggered inner steps (fragment f at
steps ``f * H / F`` + multiples of H), so each synchronisation moves 1/F of the model and the link is
busy all the time instead of in bursts. A fragment's all-reduce runs on a communication thread while
the inner steps go on; its outer update is applied ``delay`` inner steps later, and its parameters are
then set to the new shared values (the local progress of those ``delay`` steps on that fragment is
dropped, ``mix=1``; ``mix=a`` keeps ``1 - a`` of it and gives up identical replicas for that fragment
until its next synchronisation).

Usage::

    model = MyModel()                                   # not wrapped in DDP: no per-step all-reduce
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    local = fastml_strategy.LocalSGD(model, inner, every=50, plan="int4")   # broadcasts rank 0's weights
    for x, y in loader:
        loss_fn(model(x), y).backward()
        inner.step(); inner.zero_grad()
        local.step()                                    # synchronises every 50 steps
    local.stats()   # inner_steps, outer_steps, bytes_sent, bytes_per_inner_step, compression ratios

A plan written by ``fastml-autotune`` that chose local steps records H, F, the delay and the outer
optimizer beside its codecs (``Plan.local_steps``)::

    local = fastml_strategy.LocalSGD.from_plan(model, inner, "tune-out/plan.json")

Islands (DiLoCo across machines, DDP inside): on N machines of R ranks, wrap the model in DDP over the
ranks of its machine and give LocalSGD the DDP model::

    ddp = DDP(model, process_group=fastml_strategy.localsgd.machine_group())
    local = fastml_strategy.LocalSGD(ddp, inner, every=50, plan="int4")

Inner steps all-reduce inside the machine every step (DDP, uncompressed, the fast link); the
synchronisation crosses machines only, as the DDP hook's hierarchical all-reduce does it
(:mod:`fastml_strategy.hierarchical`): local rank l of every machine reduces part l of each fragment's
pseudo-gradient, compressed, with its counterparts on the other machines (R groups in parallel, error
feedback on the part), and the machine all-gathers the parts. Every rank of every machine then holds
the same shared parameters. Plan names are the module's (``ddp.module``), as for a plain model.

An island may be sharded instead (FSDP2 over the ranks of one machine, for a model one device cannot
hold)::

    mesh = DeviceMesh.from_group(fastml_strategy.localsgd.machine_group(), "cuda")
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    local = fastml_strategy.LocalSGD(model, inner, every=50, plan="int4")

Each rank then holds shard l of every parameter, and so does local rank l of every other machine: the
synchronisation is the compressed all-reduce of each rank's shards with its counterparts across
machines (R groups in parallel, error feedback on the shard), with nothing to reduce or gather inside
the machine; the shared parameters (and ``state_dict()``'s) are this rank's shards.

Checkpoints: ``local.state_dict()`` holds the shared (last-synchronised) parameters, the outer
optimizer's state, the residuals, the counters and any fragment update still waiting for its delay;
save it with the model's and the inner optimizer's state dicts, and ``load_state_dict`` resumes exactly.
"""

from __future__ import annotations

import concurrent.futures
import logging
import sys
from typing import Any, Optional

import torch
import torch.distributed as dist

from fastml_strategy._advice import advise, little_compressed
from fastml_strategy._checkpoint import (STATE_FORMAT_VERSION, check_saved_state, check_state_kind,
                                         fitting_residuals, gather_states, gather_to_rank_zero, own_rank_state)
from fastml_strategy.comm._lowrank import refuse_lowrank
from fastml_strategy.comm._distributed import agreed_machines, agreed_plan, default_group_timeout, model_names
from fastml_strategy.comm._halving import may_halve
from fastml_strategy._integration import resolve_local_steps
from fastml_strategy.comm._peers import FailureChannel
from fastml_strategy._validate import LAYER_STATS_EVERY_LOCALSGD, whole_number
from fastml_strategy.comm.collective import CompressedAllReduce, CompressionError, DecodeError, StepChecks
from fastml_strategy.config import OUTER_OPTIMIZERS, LocalSteps, Plan, check_local_steps
from fastml_strategy.wire.fragments import split_fragments  # the fragments (the cost model prices the same)

__all__ = ["LocalSGD", "machine_group", "island_model", "check_arguments", "resolve_settings", "gather_to_rank_zero",
           "SETTINGS"]

log = logging.getLogger(__name__)


def _is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (an FSDP2 parameter or optimizer state).
    A DTensor exists only once its module is imported, so an unloaded module answers False without
    importing it (0.4 s, measured on torch 2.13 CPU): a plain model never pays for it."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter (or optimizer state): the local shard of an FSDP2 DTensor, a plain
    tensor itself. Writing into it writes into the parameter."""
    return t.to_local() if _is_dtensor(t) else t


def _fsdp_island(model: torch.nn.Module) -> Optional[list]:
    """The ranks an FSDP2-sharded model is sharded over (its parameters' one mesh), or None for a model
    FSDP2 does not shard. ValueError for a mesh that is not one flat group (HSDP, several meshes)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2
        return None
    if not isinstance(model, FSDPModule):
        return None
    meshes = {tuple(p.device_mesh.mesh.flatten().tolist()) + (p.device_mesh.ndim,)
              for p in model.parameters() if p.requires_grad and _is_dtensor(p)}
    plain = [n for n, p in model.named_parameters() if p.requires_grad and not _is_dtensor(p)]
    if plain or len(meshes) != 1 or next(iter(meshes))[-1] != 1:
        raise ValueError(
            "LocalSGD: an FSDP2 island must shard every trainable parameter over one 1-D mesh of one "
            f"machine's ranks (found {len(meshes)} mesh(es){', unsharded ' + str(plain[:3]) if plain else ''}); "
            "apply fully_shard(..., mesh=DeviceMesh.from_group(fastml_strategy.localsgd.machine_group(), "
            "device_type)) to every block and the root")
    return list(next(iter(meshes))[:-1])

OUTER = OUTER_OPTIMIZERS
# LocalSGD's defaults (DiLoCo's outer step), from LocalSteps: the settings the framework adapters take by
# name (Lightning, Fabric, Accelerate); FASTML_LOCALSGD_<NAME> supplies one when the argument is None
# (resolve_settings).
_DEFAULT = LocalSteps()
SETTINGS: dict[str, Any] = _DEFAULT.kwargs()


def check_arguments(every: int, outer: str, outer_lr: float, outer_momentum: float, fragments: int = 1,
                    delay: int = 0, mix: float = 1.0, layer_stats_every: int = LAYER_STATS_EVERY_LOCALSGD) -> None:
    """Raise ValueError, naming the argument and what to use, for settings no model can take (the local
    steps' through :func:`fastml_strategy.config.check_local_steps`, as :class:`LocalSteps` checks
    them). The constructor calls it on every rank; the framework adapters call it when they are built,
    before any process group exists."""
    whole_number("layer_stats_every", layer_stats_every, 0, owner="LocalSGD")
    check_local_steps(every, fragments, delay, outer, outer_lr, outer_momentum, owner="LocalSGD")
    if isinstance(mix, bool) or not isinstance(mix, (int, float)) or not 0 < mix <= 1:
        raise ValueError(f"LocalSGD: mix={mix!r}; use a number in (0, 1] (1: replicas identical)")


def resolve_settings(plan: Any = None, **given: Any) -> tuple[Plan, dict]:
    """The plan and the settings (``SETTINGS``' names) for a LocalSGD an adapter will build: each is the
    argument, else ``FASTML_LOCALSGD_<NAME>`` (``FASTML_LOCALSGD_EVERY=100``), else what the plan records
    (``Plan.local_steps``, written by ``fastml-autotune``), else LocalSGD's default. ``plan`` None reads
    ``FASTML_PLAN`` (default int4). Checked at once (:func:`check_arguments`' rules): the same error on
    every process, before any process group exists. The adapters' settings table reads the variables
    (:func:`fastml_strategy._integration.resolve_local_steps`)."""
    return resolve_local_steps(plan, owner="LocalSGD", **given)


def machine_group(ranks_per_node: Optional[int] = None) -> Any:
    """The process group of this rank's machine, to wrap a DiLoCo island in: ``DDP(model,
    process_group=machine_group())``, then ``LocalSGD(ddp_model, ...)``. Which ranks share a machine
    comes from ``ranks_per_node`` or the launcher (:mod:`fastml_strategy.topology`); every rank agrees
    first. A collective on the default group: call it on every rank, once."""
    from fastml_strategy.comm.topology import agreed_topology, node_groups

    topo = agreed_topology(dist.group.WORLD, dist.get_rank(), dist.get_world_size(), ranks_per_node)
    intra, _ = node_groups(topo, timeout=default_group_timeout(), cross=False)
    return intra


def island_model(module: torch.nn.Module, ranks_per_node: Optional[int] = None, required: bool = False,
                 owner: str = "LocalSGD") -> torch.nn.Module:
    """``module`` in DDP over the ranks of its machine when there are several machines of several ranks
    (``ranks_per_node`` or the launcher says so; agreed on every rank), else ``module`` itself (one
    replica per rank). ``required``: raise ValueError, on every rank, when there are no such machines.
    A collective on the default group. What the framework adapters call to build DiLoCo islands."""
    from fastml_strategy.comm.topology import agreed_topology, node_groups

    topo = agreed_topology(dist.group.WORLD, dist.get_rank(), dist.get_world_size(), ranks_per_node)
    if not topo.hierarchical:
        if required:
            raise ValueError(
                f"{owner}: islands need several machines of several processes; this run is {topo.nodes} "
                f"machine(s) x {topo.ranks_per_node} ({topo.source}). Set FASTML_RANKS_PER_NODE or launch "
                f"one torchrun per machine, or train one replica per process")
        return module
    intra, _ = node_groups(topo, timeout=default_group_timeout(), cross=False)
    dev = next(module.parameters()).device
    if dist.get_rank() == 0:
        log.info("%s: DiLoCo islands, %d machines x %d ranks (%s): DDP inside each machine, local steps "
                 "across machines", owner, topo.nodes, topo.ranks_per_node, topo.source)
    return torch.nn.parallel.DistributedDataParallel(
        module, process_group=intra, device_ids=[dev.index] if dev.type == "cuda" else None)


def _island(model: torch.nn.Module, process_group: Any) -> tuple:
    """``(ranks, sharded, error)``: the ranks of the machine ``model`` is an island of (DDP over them, or
    FSDP2 sharded over them; None for a plain model), whether it is sharded, and an error to raise on
    every rank alike (a mesh LocalSGD cannot take). Raises at once what every rank sees alike: DDP or
    FSDP2 over every rank, or a ``process_group`` with an island."""
    try:
        ranks = _fsdp_island(model)
        error = None
    except ValueError as e:
        ranks, error = None, e
    sharded = ranks is not None
    if not sharded and isinstance(model, torch.nn.parallel.DistributedDataParallel):
        ranks = dist.get_process_group_ranks(model.process_group)
    if ranks is None:
        return None, False, error
    how = ("is sharded with FSDP2 over every rank, which reduce-scatters" if sharded else
           "is wrapped in DistributedDataParallel over every rank, which all-reduces")
    fix = ("shard it over the ranks of one machine (fully_shard(..., mesh=DeviceMesh.from_group("
           "fastml_strategy.localsgd.machine_group(), device_type))), or train one replica per process"
           if sharded else
           "pass the plain module (model.module), or, for DiLoCo islands, wrap it in DDP over the ranks of "
           "one machine: DDP(model, process_group=fastml_strategy.localsgd.machine_group())")
    if len(ranks) == dist.get_world_size():
        raise TypeError(f"LocalSGD: the model {how} every step across machines; {fix}")
    if process_group is not None:
        raise ValueError(f"LocalSGD: process_group is for plain models; with {'an FSDP2' if sharded else 'a DDP'} "
                         f"island the outer synchronisation runs over every rank (each part with its "
                         f"counterparts across machines): drop process_group")
    return ranks, sharded, error


def _check_island(island: Optional[list], sharded: bool) -> None:
    """ValueError unless ``island`` (None: no island) holds the ranks of one machine (contiguous)."""
    if island is None:
        return
    world, R = dist.get_world_size(), len(island)
    node = dist.get_rank() // R
    if world % R or island != list(range(node * R, (node + 1) * R)):
        what = "FSDP2 mesh" if sharded else "DDP model's process group"
        fix = ("shard it with fully_shard(..., mesh=DeviceMesh.from_group(fastml_strategy.localsgd."
               "machine_group(), device_type))" if sharded else
               "wrap it as DDP(model, process_group=fastml_strategy.localsgd.machine_group())")
        raise ValueError(f"LocalSGD: the {what} holds ranks {island}, which are not the ranks of one machine "
                         f"(machines hold contiguous ranks; {world} ranks): {fix}")


class _Fragment:
    """A run of consecutive parameters synchronised together, with its flat pseudo-gradient buffer."""

    def __init__(self, index: int, names: list, params: list, offset: int) -> None:
        self.index = index
        self.names = names
        self.params = params
        self.numels = [_local(p).numel() for p in params]  # this rank's (its shards' on an FSDP2 island)
        self.full_numels = [p.numel() for p in params]
        self.offsets = [sum(self.numels[:i]) for i in range(len(params))]
        self.offset = offset  # its first synchronisation step (staggered by fragment)
        self.numel = sum(self.numels)
        self.full_numel = sum(self.full_numels)
        # DDP's all-reduce of these gradients would move them in their own dtype (bf16: 2 bytes)
        self.full_nbytes = sum(n * p.element_size() for n, p in zip(self.full_numels, params))
        self.pending: Optional[tuple] = None  # (apply at inner step, future of the averaged delta)


class LocalSGD:
    """Local steps with compressed outer synchronisation for a model on every rank (see the module
    docstring). Call :meth:`step` after every inner ``optimizer.step()``.

    ``every``: inner steps between two synchronisations of a fragment (H). ``outer``: ``"nesterov"``
    (DiLoCo) or ``"sgd"``; ``outer_lr``, ``outer_momentum``: its settings (``outer="sgd",
    outer_lr=1, outer_momentum=0`` is plain parameter averaging). ``plan``: the compression of the
    pseudo-gradients (a recipe, a Plan, a plan file, or None: ``FASTML_PLAN``, else int4), keyed by
    parameter name. ``fragments``: F (1: the whole model at once). ``delay``: inner steps between a
    fragment's synchronisation and its outer update (0: at once; then the collective runs in
    :meth:`step`). ``mix``: share of the new shared value a delayed fragment takes (1: replicas identical).
    ``process_group``: the ranks to average over (default: a new group of all ranks).

    The constructor is a collective: every rank calls it, before the first inner step; it broadcasts
    rank 0's parameters and buffers so the replicas start identical, and every rank raises the same
    error for a bad argument or plan.

    One of FastML's engines (:class:`fastml_strategy.engine.Engine`, ``kind == "localsgd"``).
    """

    kind = "localsgd"

    def __init__(self, model: torch.nn.Module, inner_optimizer: Optional[torch.optim.Optimizer] = None, *,
                 every: int = _DEFAULT.every, outer: str = _DEFAULT.outer, outer_lr: float = _DEFAULT.outer_lr,
                 outer_momentum: float = _DEFAULT.outer_momentum, plan: Any = None,
                 fragments: int = _DEFAULT.fragments, delay: int = _DEFAULT.delay, mix: float = 1.0,
                 process_group: Any = None, layer_stats_every: int = LAYER_STATS_EVERY_LOCALSGD) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"LocalSGD: model is a {type(model).__name__}; pass the torch.nn.Module every "
                            f"rank trains")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("LocalSGD: torch.distributed is not initialised; call dist.init_process_group "
                               "(torchrun sets the environment) first")
        island, sharded, island_error = _island(model, process_group)
        self.model = model
        self._ddp = model if island is not None and not sharded else None
        self._sharded = sharded  # an FSDP2 island: this rank holds shards
        module = model.module if self._ddp is not None else model
        self.inner_optimizer = inner_optimizer
        self.every = every
        self.outer, self.outer_lr, self.outer_momentum = outer, outer_lr, outer_momentum
        self.fragments, self.delay, self.mix = fragments, delay, mix
        self.layer_stats_every = layer_stats_every
        self._own_group = process_group is None  # made here: close() destroys it (a re-fit must not leak it)
        if process_group is None:
            process_group = dist.new_group(ranks=list(range(dist.get_world_size())),
                                           timeout=default_group_timeout())
        self.process_group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        trainable, aliases, frozen = model_names(module)
        R = len(island) if island is not None else 1

        def check() -> None:
            if island_error is not None:
                raise island_error
            _check_island(island, sharded)
            check_arguments(self.every, self.outer, self.outer_lr, self.outer_momentum, self.fragments,
                            self.delay, self.mix, self.layer_stats_every)
            if not named:
                raise ValueError("LocalSGD: the model has no parameter that requires a gradient")
            if self.fragments > len(named):
                raise ValueError(f"LocalSGD: fragments={self.fragments} but the model has {len(named)} "
                                 f"trainable parameters; use at most {len(named)} fragments")
            devices = {p.device for _, p in named}
            if len(devices) > 1:
                raise ValueError(f"LocalSGD: the parameters are on several devices ({sorted(map(str, devices))});"
                                 f" keep one model replica on one device per rank")

        # every setting that moves the synchronisations or changes the outer step: a rank with another
        # value would issue its collectives at other steps (a hang) or drift from the others silently
        shared = {"every": every, "fragments": fragments, "delay": delay, "outer": outer,
                  "outer_lr": outer_lr, "outer_momentum": outer_momentum, "mix": mix, "island_ranks": R,
                  "island_sharded": self._sharded}
        try:
            self.plan: Plan = agreed_plan(plan, trainable, process_group, self.world_size, check=check,
                                          aliases=aliases, frozen=frozen, local_steps=True,
                                          settings=shared, owner="LocalSGD")
            refuse_lowrank(self.plan, "LocalSGD", "the outer synchronisation all-reduces flat fragments of "
                           "the pseudo-gradients, whose matrices it does not see")
        except BaseException:
            if self._own_group:  # refused on every rank alike: leave no group behind
                dist.destroy_process_group(process_group)
            raise
        self._advise(named)
        topo, groups = None, ()
        if island is not None:
            topo, groups = agreed_machines(process_group, self.rank, self.world_size, R)
        self._start_identical(module, topo, groups)
        self._named = named
        self._anchor, self._outer = self._outer_optimizer(named)
        self._fragments = self._split(named, fragments, every)
        self.ranks_per_node = R
        self._engine, self._channel = self._build_engine(topo, groups, named)
        self._hier = not isinstance(self._engine, CompressedAllReduce)
        # one thread issues the fragments' collectives in order (every rank in the same order)
        self._runner = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="fastml-localsgd")
        self.inner_steps = 0
        self.outer_steps = 0
        self.nonfinite_syncs = 0
        self._failure: Optional[BaseException] = None

    def _advise(self, named: list) -> None:
        """The advice the DDP hook gives (rank 0): a lossy plan that min_numel keeps from compressing."""
        little = little_compressed(self.plan, named, self.world_size, owner="FastML LocalSGD") if self.rank == 0 else None
        if little is not None:
            advise("min_numel", little, stacklevel=3)

    def _outer_optimizer(self, named: list) -> tuple[dict, torch.optim.Optimizer]:
        """The shared parameters (the last synchronisation's result; this rank's shards of an FSDP2
        island), fp32, and the outer optimizer on them."""
        anchor = {n: _local(p.detach()).to(torch.float32, copy=True).requires_grad_(True) for n, p in named}
        return anchor, torch.optim.SGD(list(anchor.values()), lr=self.outer_lr, momentum=self.outer_momentum,
                                       nesterov=self.outer == "nesterov")

    def _build_engine(self, topo: Any, groups: tuple, named: list) -> tuple[Any, Optional[FailureChannel]]:
        """The engine of the outer synchronisation and, on CPU islands, its failure channel."""
        if groups:
            # islands: local rank l of every machine reduces part l of each fragment across machines
            # (the hierarchical all-reduce of the DDP hook; inside a machine the pseudo-gradients are
            # equal, DDP having kept the island's replicas equal; an FSDP2 island's part l is the shard
            # rank l holds, and only the cross-machine stage runs)
            from fastml_strategy.comm.hierarchical import HierarchicalAllReduce

            engine = HierarchicalAllReduce(self.plan, self.process_group, self.rank, self.world_size,
                                            topo, *groups)
        else:  # one replica per rank, or one machine (nothing crosses machines; DDP averages it all)
            engine = CompressedAllReduce(self.plan, self.process_group, self.rank, self.world_size)
        # Islands on CPU (gloo): ranks meet in groups that do not all hold one another, so a rank that
        # fails publishes it in the job's store and every wait of the synchronisation reads it
        # (fastml_strategy.comm._peers). Without it, when rank 3 of two machines of two dies, rank 1 (its
        # counterpart) sees the closed connection, but rank 0 meets rank 2 across machines, which
        # failed in the island's own collective and never issues its part: rank 0 would wait for the
        # whole group timeout. (A collective: rank 0 draws the key. NCCL's wait does not block.)
        # The same holds flat when the plan may run recursive halving (a rank meets only its partners
        # of each round: fastml_strategy.comm._halving).
        channel: Optional[FailureChannel] = None
        if (groups or may_halve(self.plan, self.world_size)) and not any(p.is_cuda for _, p in named):
            channel = FailureChannel(self.process_group, self.rank)
            engine.use_channel(channel)
        return engine, channel

    def _start_identical(self, module: torch.nn.Module, topo: Any, groups: tuple) -> None:
        """Rank 0's parameters and buffers everywhere (an FSDP2 island: each shard from its counterpart
        on machine 0, over this local rank's cross-machine group)."""
        group = self.process_group
        src = dist.get_global_rank(group, 0) if group is not dist.group.WORLD else 0
        with torch.no_grad():
            for p in module.parameters():
                if self._sharded and groups:
                    dist.broadcast(_local(p.data), src=topo.local_rank, group=groups[2])
                elif not self._sharded:
                    dist.broadcast(p.data, src=src, group=group)
            for t in module.buffers():
                dist.broadcast(t.data, src=src, group=group)

    @classmethod
    def from_plan(cls, model: torch.nn.Module, inner_optimizer: Optional[torch.optim.Optimizer] = None,
                  plan: Any = None, **overrides: Any) -> "LocalSGD":
        """LocalSGD with the settings a plan records (``Plan.local_steps``: ``every``, ``fragments``,
        ``delay``, the outer optimizer), the plan's codecs compressing the pseudo-gradients.
        ``plan``: a Plan, a plan file (``fastml-autotune``'s plan.json), or None (``FASTML_PLAN``);
        ``overrides``: any other LocalSGD argument, or one of the plan's to replace. A plan without
        local steps is an error on every rank (it was tuned for per-step compression)."""
        from fastml_strategy.config import resolve_plan

        try:
            p = resolve_plan(plan)
            missing = p.local_steps is None
        except ValueError:  # the constructor reports it, on every rank alike
            p, missing = plan, False
        if missing:
            raise ValueError(f"LocalSGD.from_plan: plan {p.name!r} records no local steps (it compresses "
                             f"every step: use it with fastml_strategy.register_hook); pass "
                             f"LocalSGD(model, inner, plan=..., every=H) to choose H yourself")
        kwargs = {**(p.local_steps.kwargs() if isinstance(p, Plan) else {}), **overrides}
        return cls(model, inner_optimizer, plan=p, **kwargs)

    # -- fragments -------------------------------------------------------------------------------------------
    @staticmethod
    def _split(named: list, fragments: int, every: int) -> list:
        """Consecutive parameters in fragments of about equal size (:func:`fastml_strategy.wire.split_fragments`);
        fragment f first syncs at step ``f * every // fragments`` past a multiple of ``every``
        (staggered)."""
        runs = split_fragments([p.numel() for _, p in named], fragments)
        return [_Fragment(f, [named[i][0] for i in run], [named[i][1] for i in run], f * every // fragments)
                for f, run in enumerate(runs)]

    def _due(self, frag: _Fragment, t: int) -> bool:
        """Whether fragment ``frag`` synchronises after inner step ``t`` (1-based): at its offset, then
        every ``every`` steps."""
        return t > 0 and t >= frag.offset and (t - frag.offset) % self.every == 0

    # -- the synchronisation of one fragment -------------------------------------------------------------
    def _delta(self, frag: _Fragment) -> torch.Tensor:
        """The flat pseudo-gradient of a fragment: shared - local, in fp32."""
        out = torch.empty(frag.numel, dtype=torch.float32, device=frag.params[0].device)
        with torch.no_grad():
            for n, p, off, k in zip(frag.names, frag.params, frag.offsets, frag.numels):
                torch.sub(self._anchor[n].detach().reshape(-1), _local(p.detach()).reshape(-1).to(torch.float32),
                          out=out[off: off + k])
        return out

    def _all_reduce(self, frag: _Fragment, delta: torch.Tensor, outer_step: int) -> tuple:
        """Runs on the communication thread: the compressed mean of ``delta`` over the ranks. A failure
        is published at once (islands: :attr:`_channel`), not when the main thread next waits for
        this fragment, which may be ``delay`` inner steps later."""
        try:
            return self._reduce(frag, delta, outer_step)
        except BaseException as e:
            if self._channel is not None:  # ranks of other groups stop waiting for this one
                self._channel.publish(f"{type(e).__name__}: {e}")
            raise

    def _reduce(self, frag: _Fragment, delta: torch.Tensor, outer_step: int) -> tuple:
        eng = self._engine
        if delta.is_cuda:
            torch.cuda.set_device(delta.device)  # the current device is per thread
        every = self.layer_stats_every
        stats_now = every > 0 and outer_step % every == 0
        if self._hier and self._sharded:  # this rank's shards with their counterparts across machines
            finite = eng.reduce_shards(frag.names, frag.offsets, frag.numels, frag.full_numels, delta,
                                       outer_step, stats_now)
            if delta.is_cuda:
                torch.cuda.current_stream(delta.device).synchronize()
            return delta, finite
        lay = eng.layout_for(frag.names, frag.offsets, frag.numels, delta.device, delta.dtype)
        if self._hier:  # one check of every rank of the world at the end (errors and finiteness)
            checks = StepChecks()
            tail = eng.start(lay, delta, outer_step, stats_now, checks)
            if tail is not None:
                tail()
            finite = eng.finish(checks, delta.device, exchange=True)
            if finite:
                eng.commit(lay)
            if delta.is_cuda:
                torch.cuda.current_stream(delta.device).synchronize()
            return delta, finite
        error: Optional[BaseException] = None
        try:
            finite = eng.run(lay, delta, outer_step, layer_stats=every > 0 and outer_step % every == 0)
        except DecodeError as e:  # after the last collective: every rank hears of it just below
            error, finite = e, False
        eng.exchange_status(error, "decoding", delta.device)
        if delta.is_cuda:
            torch.cuda.current_stream(delta.device).synchronize()
        return delta, finite

    def _apply(self, frag: _Fragment, mean: torch.Tensor, finite: bool) -> None:
        """The outer step on a fragment's shared parameters, then the local ones take them (mix). A
        non-finite average (some rank's pseudo-gradient held a NaN/inf) skips the outer step on every
        rank; every rank takes the fragment's shared values, and a rank whose model is not finite
        elsewhere too is made whole (:meth:`_restore_rank`)."""
        with torch.no_grad():
            if finite:
                for n, off, k in zip(frag.names, frag.offsets, frag.numels):
                    a = self._anchor[n]
                    a.grad = mean[off: off + k].view_as(a)
                self._outer.step()
                for n in frag.names:
                    self._anchor[n].grad = None
            else:  # a rank diverged (NaN/inf): skip the outer step, every rank restarts from the shared values
                self.nonfinite_syncs += 1
                self._restore_rank()
            mix = self.mix if finite else 1.0
            for n, p in zip(frag.names, frag.params):
                p = _local(p)
                shared = self._anchor[n].detach().to(p.dtype)
                if mix == 1.0:
                    p.copy_(shared)
                else:
                    p.mul_(1 - mix).add_(shared, alpha=mix)

    def _restore_rank(self) -> None:
        """After a non-finite synchronisation: if this rank's parameters (any fragment's) or inner
        optimizer state are not finite, set every parameter to its shared value (the last
        synchronisation of its fragment) and drop the inner optimizer's state of every parameter whose
        state is not finite (it restarts as in a fresh optimizer: Adam's moments and step count).
        Without this a NaN in one fragment spreads back into the others through the next inner step,
        and each fragment's synchronisation only ever cleans itself (replicas would never agree
        again). Ranks whose model is finite keep their local progress on the other fragments."""
        params = [p for _, p in self._named]
        bad_params = not all(bool(torch.isfinite(_local(p)).all()) for p in params)
        opt = self.inner_optimizer
        bad_state = []
        if opt is not None:
            for p in params:
                st = opt.state.get(p)
                if st and not all(bool(torch.isfinite(_local(v)).all()) for v in st.values()
                                  if isinstance(v, torch.Tensor) and v.is_floating_point()):
                    bad_state.append(p)
        if not bad_params and not bad_state:
            return
        with torch.no_grad():
            if bad_params:
                for n, p in self._named:
                    _local(p).copy_(self._anchor[n].detach().to(p.dtype))
            for p in bad_state:
                del opt.state[p]
        log.warning("FastML LocalSGD: rank %d held non-finite %s at inner step %d; restored %s from the "
                    "last synchronisation%s", self.rank,
                    " and ".join(w for w, b in (("parameters", bad_params), ("optimizer state", bad_state)) if b),
                    self.inner_steps, "every parameter" if bad_params else "nothing",
                    f" and reset the inner optimizer's state of {len(bad_state)} parameter(s)" if bad_state else "")

    def _explain(self, e: BaseException, frag: _Fragment) -> BaseException:
        if isinstance(e, CompressionError):
            return e
        err = CompressionError(
            f"FastML LocalSGD: the synchronisation of fragment {frag.index} at inner step {self.inner_steps} "
            f"failed on rank {self.rank} ({type(e).__name__}: {e}). If another rank died or timed out, its "
            f"log has the cause; restart from the last checkpoint.")
        err.__cause__ = e
        return err

    def _wait(self, frag: _Fragment) -> None:
        _, fut = frag.pending
        frag.pending = None
        try:
            mean, finite = fut.result()
        except BaseException as e:  # noqa: BLE001
            self._failure = self._explain(e, frag)
            raise self._failure  # noqa: B904 - its cause is set (a plain raise keeps it)
        self._apply(frag, mean, finite)
        self.outer_steps += 1

    # -- public -------------------------------------------------------------------------------------------------
    def step(self) -> None:
        """Count one inner step; synchronise the fragments that are due, apply the delayed ones."""
        if self._failure is not None:
            raise self._failure
        if self._runner is None:
            raise RuntimeError("LocalSGD: close() was called; create a new LocalSGD to train on")
        self.inner_steps += 1
        t = self.inner_steps
        for frag in self._fragments:
            if frag.pending is not None and frag.pending[0] <= t:
                self._wait(frag)
        for frag in self._fragments:
            if not self._due(frag, t):
                continue
            if frag.pending is not None:  # cannot happen with a valid delay; keep the order anyway
                self._wait(frag)
            delta = self._delta(frag)
            if delta.is_cuda:
                torch.cuda.current_stream(delta.device).synchronize()  # the thread reads it
            outer_step = (t - frag.offset) // self.every
            fut = self._runner.submit(self._all_reduce, frag, delta, outer_step)
            frag.pending = (t + self.delay, fut)
            if self.delay == 0:
                self._wait(frag)

    def synchronize(self) -> None:
        """Apply every fragment update still waiting for its delay (call before evaluating or saving
        if you want the shared parameters in the model now)."""
        for frag in self._fragments:
            if frag.pending is not None:
                self._wait(frag)

    @property
    def failure(self) -> Optional[BaseException]:
        """The first error of a synchronisation, which every later one raises (None: none)."""
        return self._failure

    def stats(self) -> dict:
        """Cumulative figures of this rank: bytes sent by the synchronisations, and what DDP's
        all-reduce would have sent for the same inner steps (``ddp_bytes``: one ring all-reduce of every
        gradient per inner step, in the parameters' own dtype: a bf16 model's in bf16)."""
        eng = self._engine
        sent = eng.bytes_sent
        W = self.world_size
        nbytes = sum(f.full_nbytes for f in self._fragments)
        ddp = 2.0 * (W - 1) / W * nbytes * self.inner_steps if W > 1 else 0.0
        unc = eng.bytes_uncompressed
        steps = max(1, self.inner_steps)
        return {
            "engine": self.kind,
            "inner_steps": self.inner_steps,
            "outer_steps": self.outer_steps,
            "every": self.every,
            "fragments": self.fragments,
            "world_size": W,
            "plan": self.plan.name,
            "bytes_sent": int(sent),
            "bytes_uncompressed": int(round(unc)),
            "compression_ratio": unc / sent if sent else 1.0,
            "bytes_per_inner_step": sent / steps,
            "ddp_bytes": int(round(ddp)),
            "ratio_vs_ddp": ddp / sent if sent else float("inf") if ddp else 1.0,
            "residual_bytes": eng.residual_nbytes(),
            "nonfinite_syncs": self.nonfinite_syncs,
            "ranks_per_node": self.ranks_per_node,
            **({"bytes_sent_inter": int(eng.bytes_sent_inter), "bytes_sent_intra": int(eng.bytes_sent_intra)}
               if self._hier else {}),
            "layers": eng.layer_stats(),
        }

    def state_dict(self, all_ranks: bool = False) -> dict:
        """This rank's state: shared parameters, outer optimizer, residuals, counters, and the averaged
        updates of fragments still waiting for their delay (waits for their communication first).
        With ``all_ranks=True`` (a collective of LocalSGD's group: call on every rank) every rank's, as
        ``{"format_version", "per_rank": [...]}``, which :meth:`load_state_dict` takes on each rank."""
        own = self._own_state()
        if not all_ranks:
            return own
        return gather_states(own, self.process_group, self.world_size)

    def _own_state(self) -> dict:
        pending = {f.index: {"at": at, "mean": mean.detach().cpu().clone(), "finite": finite}
                   for f, (at, mean, finite) in self._settle().items()}
        return {
            "format_version": STATE_FORMAT_VERSION,
            "kind": "localsgd",
            "plan": self.plan.to_dict(),
            "rank": self.rank,
            "world_size": self.world_size,
            "every": self.every,
            "fragments": self.fragments,
            "ranks_per_node": self.ranks_per_node,
            "inner_steps": self.inner_steps,
            "outer_steps": self.outer_steps,
            "nonfinite_syncs": self.nonfinite_syncs,
            "shared": {n: a.detach().cpu().clone() for n, a in self._anchor.items()},
            "outer_optimizer": self._outer.state_dict(),
            "counters": {"bytes_sent": self._engine.bytes_sent,
                         "bytes_uncompressed": self._engine.bytes_uncompressed,
                         **({"bytes_sent_intra": self._engine.bytes_sent_intra,
                             "bytes_sent_inter": self._engine.bytes_sent_inter} if self._hier else {})},
            "residuals": {k: v.detach().cpu().clone() for k, v in self._engine.residuals().items()},
            "pending": pending,
        }

    def load_state_dict(self, sd: dict, strict: bool = True) -> None:
        """Load what :meth:`state_dict` returned on this rank (same world size, ``every``,
        ``fragments`` and, with ``strict``, plan); raises ValueError naming any mismatch first."""
        sd = own_rank_state(sd, self.rank, self.world_size, STATE_FORMAT_VERSION, "LocalSGD")
        check_state_kind(sd, "localsgd", "LocalSGD")
        check_saved_state(sd, self.rank, self.world_size, self.plan, strict, "LocalSGD")
        for key in ("every", "fragments", "ranks_per_node"):
            if sd.get(key, 1 if key == "ranks_per_node" else None) != getattr(self, key):
                raise ValueError(f"LocalSGD.load_state_dict: the state was saved with {key}={sd.get(key)}, "
                                 f"this run has {key}={getattr(self, key)}; resume with the same setting")
        shared = sd["shared"]
        missing = sorted(set(self._anchor) - set(shared))
        if missing or any(shared[n].shape != a.shape for n, a in self._anchor.items() if n in shared):
            raise ValueError(f"LocalSGD.load_state_dict: the saved shared parameters do not fit this model "
                             f"(missing or of another shape: {missing or 'shapes differ'}); resume the same model")
        sizes = {n: _local(p).numel() for n, p in self._named}  # (an FSDP2 island's: its shards)
        if self._hier and not self._sharded:  # this rank's part of each parameter
            sizes = self._engine.part_sizes(sizes)
        residuals = fitting_residuals(sd.get("residuals", {}), sizes, strict, "LocalSGD")
        with torch.no_grad():
            for n, a in self._anchor.items():
                a.copy_(shared[n].to(a.device))
        self._outer.load_state_dict(sd["outer_optimizer"])
        self.inner_steps = int(sd["inner_steps"])
        self.outer_steps = int(sd["outer_steps"])
        self.nonfinite_syncs = int(sd.get("nonfinite_syncs", 0))
        self._engine.load_counters(sd.get("counters", {}))
        self._engine.load_residuals(residuals)
        for frag in self._fragments:
            p = sd.get("pending", {}).get(frag.index)
            frag.pending = None if p is None else (
                int(p["at"]), _done(p["mean"].to(frag.params[0].device), bool(p["finite"])))

    def _settle(self) -> dict:
        """Wait for the communication of every fragment still pending; keep its averaged update pending
        (now a finished future). Returns ``{fragment: (apply at, mean, finite)}``."""
        out = {}
        for frag in self._fragments:
            if frag.pending is None:
                continue
            at, fut = frag.pending
            try:
                mean, finite = fut.result()
            except BaseException as e:  # noqa: BLE001
                self._failure = self._explain(e, frag)
                raise self._failure  # noqa: B904 - its cause is set
            frag.pending = (at, _done(mean, finite))
            out[frag] = (at, mean, finite)
        return out

    def close(self, apply_pending: bool = True) -> None:
        """Stop the communication thread and destroy LocalSGD's own process group (not one passed as
        ``process_group``); call on every rank. ``apply_pending``: first apply every fragment update
        still waiting for its delay (:meth:`synchronize`). ``False`` only waits for their communication
        and keeps them pending, so closing does not move the training trajectory: ``state_dict()``
        saves them and :meth:`synchronize` still applies them (the Lightning strategies close this way
        at the end of ``fit``). A second call does nothing."""
        if self._runner is None:
            return
        try:
            if self._failure is None:
                self.synchronize() if apply_pending else self._settle()
        finally:
            self._runner.shutdown(wait=True)
            self._runner = None
            if self._own_group:
                try:
                    dist.destroy_process_group(self.process_group)
                except Exception as e:  # noqa: BLE001 - already gone with the default group
                    log.debug("FastML LocalSGD: destroying the communication group: %s", e)
                self._own_group = False

    def __getstate__(self) -> dict:
        raise TypeError("LocalSGD holds a process group and a thread and cannot be pickled; save "
                        "state_dict() instead")


def _done(mean: torch.Tensor, finite: bool) -> concurrent.futures.Future:
    fut: concurrent.futures.Future = concurrent.futures.Future()
    fut.set_result((mean, finite))
    return fut
