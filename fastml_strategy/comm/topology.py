"""Which ranks share a machine: the topology a hierarchical collective is built on.

A cluster of N machines with R ranks each (W = N x R) has two links: a fast one inside a machine
(NVLink, PCIe, shared memory) and a slow network between machines. A collective that knows which ranks
share a machine can keep the slow link for what has to cross it (:mod:`fastml_strategy.hook`:
reduce-scatter inside the machine, compressed all-reduce of each 1/R shard across machines, all-gather
inside).

Where the answer comes from (first match wins; never from host names, since containers and the
emulated nodes of ``benchmarks/bench_topology.py`` share one):

1. an explicit setting: ``register_hook(..., ranks_per_node=R)`` (1: flat, whatever the launcher says);
2. ``FASTML_RANKS_PER_NODE``;
3. the launcher: torchrun / torchelastic (and Accelerate and Lightning under torchrun)
   ``LOCAL_WORLD_SIZE``; Open MPI (``accelerate launch`` MULTI_CPU) ``OMPI_COMM_WORLD_LOCAL_SIZE``;
   Slurm ``SLURM_NTASKS_PER_NODE`` (or ``SLURM_TASKS_PER_NODE``, which may read ``4(x2)``);
4. none of these: every rank on a machine of its own (flat).

Ranks of one machine are assumed contiguous (machine = rank // R, local rank = rank % R), as torchrun,
Lightning and Slurm's block distribution assign them. Where the launcher also says where this rank
sits (``LOCAL_RANK``, ``GROUP_RANK``, ``NODE_RANK``, ``SLURM_LOCALID``, ``SLURM_NODEID``,
``OMPI_COMM_WORLD_LOCAL_RANK``), that is checked, and a mismatch refused: a collective built on the
wrong machines would send the shards over the slow link and still be correct, but slower than flat,
so the error asks for an explicit ``ranks_per_node`` (1 for flat) instead.

Every rank must agree before the first collective (:func:`agreed_topology`): a rank that computed
another R (uneven machines: different ``LOCAL_WORLD_SIZE``), or an R that does not divide the world
size, makes every rank raise the same ValueError, naming the ranks.

Public here: :class:`Topology`, :func:`detect_ranks_per_node`, :func:`topology_for`,
:func:`agreed_topology`, :func:`node_groups`. Another user of the machine structure (LocalSGD islands:
one island per machine) needs only these.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional

__all__ = ["Topology", "detect_ranks_per_node", "topology_for", "agreed_topology", "node_groups"]

log = logging.getLogger(__name__)

ENV = "FASTML_RANKS_PER_NODE"


@dataclass(frozen=True)
class Topology:
    """Where one rank sits: ``nodes`` machines of ``ranks_per_node`` ranks each (``world`` in all);
    this rank is local rank ``local_rank`` of machine ``node_rank``. ``source`` says where
    ``ranks_per_node`` came from (for logs and errors)."""

    world: int
    ranks_per_node: int
    nodes: int
    node_rank: int
    local_rank: int
    source: str = "explicit"

    @property
    def hierarchical(self) -> bool:
        """Whether a two-level collective applies: more than one machine, more than one rank each."""
        return self.nodes > 1 and self.ranks_per_node > 1

    def node_members(self, node: int) -> list[int]:
        """The ranks of machine ``node`` (contiguous)."""
        R = self.ranks_per_node
        return list(range(node * R, (node + 1) * R))

    def local_peers(self, local_rank: int) -> list[int]:
        """The ranks with local rank ``local_rank`` on every machine, by machine (one cross-machine
        group per local rank)."""
        return [n * self.ranks_per_node + local_rank for n in range(self.nodes)]


def _slurm_tasks_per_node(env: Mapping[str, str]) -> Optional[int]:
    """Slurm's tasks per node as one number, or None if unset. ``SLURM_TASKS_PER_NODE`` reads like
    ``4(x2),3``: several numbers mean uneven machines (ValueError)."""
    for var in ("SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        text = env.get(var)
        if not text:
            continue
        counts = {int(m.group(1)) for m in re.finditer(r"(\d+)(?:\(x\d+\))?", text)}
        if len(counts) != 1:
            raise ValueError(f"{var}={text!r}: machines run different numbers of ranks; FastML's "
                             f"hierarchical all-reduce needs the same number on every machine. Launch "
                             f"as many tasks on each, or pass ranks_per_node=1 (flat)")
        return counts.pop()
    return None


# (variable giving R, variables giving this rank's local rank, its machine) per launcher
_LAUNCHERS = (
    ("LOCAL_WORLD_SIZE", ("LOCAL_RANK",), ("GROUP_RANK", "NODE_RANK")),  # torchrun, Accelerate, Lightning
    ("OMPI_COMM_WORLD_LOCAL_SIZE", ("OMPI_COMM_WORLD_LOCAL_RANK",), ()),  # Open MPI
)


def _positive(var: str, text: Any) -> int:
    try:
        value = int(str(text).strip())
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{var}={text!r}; ranks per machine must be a whole number >= 1 (1: flat)")
    return value


def detect_ranks_per_node(explicit: Optional[int] = None, env: Optional[Mapping[str, str]] = None
                          ) -> tuple[int, str]:
    """``(ranks per machine, where that came from)``, from ``explicit``, then ``FASTML_RANKS_PER_NODE``,
    then the launcher's variables (see the module docstring), else ``(1, "default")``. Purely local
    (no collective): check the answer with :func:`topology_for` and agree with
    :func:`agreed_topology`. ValueError for a value that is not a whole number >= 1."""
    env = os.environ if env is None else env
    if explicit is not None:
        if isinstance(explicit, bool) or not isinstance(explicit, int) or explicit < 1:
            raise ValueError(f"ranks_per_node={explicit!r}; use a whole number >= 1 (1: flat, every rank "
                             f"treated as its own machine) or None (detect it from the launcher)")
        return explicit, "ranks_per_node"
    if env.get(ENV):
        return _positive(ENV, env[ENV]), ENV
    for var, _, _ in _LAUNCHERS:
        if env.get(var):
            return _positive(var, env[var]), var
    slurm = _slurm_tasks_per_node(env)
    if slurm is not None:
        return slurm, "SLURM_NTASKS_PER_NODE"
    return 1, "default"


def topology_for(rank: int, world: int, explicit: Optional[int] = None,
                 env: Optional[Mapping[str, str]] = None) -> Topology:
    """This rank's :class:`Topology` (local: no collective). ValueError if ``ranks_per_node`` does not
    divide ``world``, or if the launcher places this rank elsewhere than ``rank // R`` (non-contiguous
    machines)."""
    env = os.environ if env is None else env
    R, source = detect_ranks_per_node(explicit, env)
    if world % R:
        raise ValueError(
            f"ranks_per_node={R} (from {source}) does not divide the world size {world}: machines must "
            f"hold the same number of ranks. Pass ranks_per_node=R with R dividing {world} (or "
            f"ranks_per_node=1 for the flat all-reduce)")
    topo = Topology(world, R, world // R, rank // R, rank % R, source)
    if source in ("ranks_per_node", ENV) or R == 1:
        return topo  # the user's own word: launcher positions are not cross-checked
    launcher = next((x for x in _LAUNCHERS if x[0] == source), None)
    if launcher is not None:
        checks = [(v, topo.local_rank, "local rank") for v in launcher[1]]
        checks += [(v, topo.node_rank, "machine") for v in launcher[2]]
    else:  # Slurm
        checks = [("SLURM_LOCALID", topo.local_rank, "local rank"), ("SLURM_NODEID", topo.node_rank, "machine")]
    for var, expected, what in checks:
        text = str(env.get(var, "")).strip()
        if text.isdigit() and int(text) != expected:
            raise ValueError(
                f"rank {rank} of {world} has {var}={text}, but with {R} ranks per machine ({source}) "
                f"FastML places it at {what} {expected} (machines hold contiguous ranks: machine = "
                f"rank // {R}). Launch so that each machine's ranks are contiguous (torchrun does), or "
                f"pass ranks_per_node=1 (flat)")
    return topo


def agreed_topology(group: Any, rank: int, world: int, explicit: Optional[int] = None,
                    env: Optional[Mapping[str, str]] = None) -> Topology:
    """:func:`topology_for` on every rank of ``group``, then agree (one ``all_gather_object``): if it
    failed on any rank, or ranks found different ranks per machine (uneven machines), every rank raises
    the same ValueError, naming the ranks. A collective: call on every rank of ``group``."""
    import torch.distributed as dist

    error, topo = None, None
    try:
        topo = topology_for(rank, world, explicit, env)
    except ValueError as e:
        error = str(e)
    reports: list = [None] * world
    if world > 1:
        dist.all_gather_object(reports, (error, topo.ranks_per_node if topo else None,
                                         topo.source if topo else None), group=group)
    else:
        reports = [(error, topo.ranks_per_node if topo else None, topo.source if topo else None)]
    bad = [r for r, rep in enumerate(reports) if rep[0] is not None]
    if bad:
        raise ValueError(f"FastML topology rejected on rank(s) {bad}: {reports[bad[0]][0]}")
    seen = {rep[1] for rep in reports}
    if len(seen) > 1:
        by = ", ".join(f"rank {r}: {rep[1]} ({rep[2]})" for r, rep in enumerate(reports))
        raise ValueError(
            f"FastML: ranks disagree on ranks per machine ({by}): machines with different numbers of "
            f"ranks are not supported by the hierarchical all-reduce. Run the same number of ranks on "
            f"every machine, or pass ranks_per_node=1 (FASTML_RANKS_PER_NODE=1) for the flat one")
    return topo


def node_groups(topo: Topology, timeout: Any = None, cross: bool = True) -> tuple[Any, Any]:
    """``(intra, cross)``: the process group of this rank's machine (its R ranks) and that of its
    counterparts on every machine (the N ranks of its local rank; None with ``cross=False``). A
    collective on the default group: every rank creates every group, in the same order
    (torch.distributed requires it). Call it again for further, independent groups (collectives on
    different groups never wait on each other)."""
    import torch.distributed as dist

    intra = mine = None
    for node in range(topo.nodes):
        g = dist.new_group(topo.node_members(node), timeout=timeout)
        if node == topo.node_rank:
            intra = g
    for local in range(topo.ranks_per_node if cross else 0):
        g = dist.new_group(topo.local_peers(local), timeout=timeout)
        if local == topo.local_rank:
            mine = g
    return intra, mine
