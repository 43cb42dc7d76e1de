"""Sharded training (``Sharding(kind="fsdp" | "hsdp")``, :func:`sharded_step_time`) replaces steps 2-5
with FSDP2's schedule over *units* (one ``fully_shard`` module each: see :func:`fsdp_units`):

- W = N x A ranks (A accelerators per node). FSDP shards every unit over all W ranks; HSDP shards it
  over the S = A ranks of a node and keeps R = N replicas.
- Forward: each unit's parameters are all-gathered (``(Ws-1)`` shards of the param dtype per rank,
  Ws the shard group) before its compute; the next unit's all-gather overlaps the current unit's
  compute (FSDP2's one-unit prefetch). Compute is split between units by parameter count.
- Backward, units in the order their gradients become ready: the all-gather again
  (``reshard_after_forward``; never for the root unit, which FSDP2 keeps unsharded), prefetched one
  unit ahead; the unit's backward; then its reduction, overlapping the next units' backward:
  FSDP: FastML's compressed reduce-scatter (one all_to_all; bytes from
  ``codecs.reduce_scatter_bytes`` per tensor on FSDP2's dim-0 chunks, ``fsdp.shard_chunks``, plus a
  :data:`~fastml_strategy._status.HEADER`-byte header per destination: a unit's reduce-scatter is one
  message per destination, never cut into pieces) or FSDP's own ring reduce-scatter (``(W-1)/W`` of the padded unit
  in the reduce dtype). HSDP: FSDP's own reduce-scatter inside the node (fast link), then the
  cross-node all-reduce of the rank's shard: FastML's scatter-reduce-allgather over the R replicas
  (the unit's shard as one bucket, priced as DDP's: :func:`fastml_strategy._layouts.bucket_wire`)
  or FSDP's ring all-reduce (``2(R-1)/R`` of the padded shard).
- Links: a ring collective crosses each node's link once (``bytes / B``); FastML's all_to_all sends
  each remote chunk directly, so the A ranks of a node put ``A x (W-A)/(W-1)`` of their bytes on
  the node's link at once; in HSDP the S ranks of a node all-reduce their shards at once (``S x``).
  Collectives on one link run in the order they are issued; the node link and the intra-node link
  are separate.
- Codec time: a reduce-scatter encodes and decodes every element once (one round trip); the HSDP
  all-reduce works on a shard (``1/S`` of the round trip, times the scatter-reduce-allgather factor).
  The optimizer steps on a shard: ``T_opt / Ws``.
- Memory per rank: error-feedback residuals of the compressed tensors (FSDP: full size; HSDP: the
  shard), beside FSDP's own state (fp32 parameter and gradient shards plus the optimizer state, which
  the profile measures: ``(8 + optimizer bytes per parameter) / Ws`` bytes per parameter).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from fastml_strategy.autotune.catalog import HardwareOption, Link
from fastml_strategy.autotune.costmodel.base import (CANDIDATES, DTYPE_BYTES, LayerProfile, Profile, Sharding,
                                                     StepBreakdown, _candidate_name, _cfg, _codec_factor,
                                                     family)
from fastml_strategy._layouts import PIECE_NUMEL, bucket_wire
from fastml_strategy._status import HEADER
from fastml_strategy.config import CodecConfig


# -- sharded training (FSDP2 / HSDP) ---------------------------------------------------------------------
def _unit_of(lp: LayerProfile) -> str:
    if lp.unit is not None:
        return lp.unit
    return lp.name.rsplit(".", 1)[0].split(".")[0] if "." in lp.name else ""


def fsdp_units(profile: Profile) -> list[tuple[str, list[LayerProfile]]]:
    """The model's FSDP units, ``(module path, its parameters)``, the root's own parameters (path
    ``""``) first (FSDP2 all-gathers them in the root's pre-forward), then in registration order.

    Which module is a unit was decided at profiling (``profile.fsdp_unit_modules``): every child of
    the root that holds parameters, looking through containers (``ModuleList``, ``ModuleDict``,
    ``Sequential``), so each block of ``model.layers`` is a unit, as ``fully_shard`` is usually
    applied; parameters outside every unit belong to the root."""
    by: dict[str, list[LayerProfile]] = {}
    for lp in sorted(profile.layers, key=lambda x: x.index):
        by.setdefault(_unit_of(lp), []).append(lp)
    return sorted(by.items(), key=lambda kv: (kv[0] != "", kv[1][0].index))


@functools.lru_cache(maxsize=65536)
def _chunks(shape: tuple[int, ...], world_size: int) -> tuple[tuple[int, ...], int]:
    from fastml_strategy.fsdp import shard_chunks

    return shard_chunks(shape, world_size)


def _layout(lp: LayerProfile, world_size: int) -> tuple[tuple[int, ...], int]:
    """FSDP2's dim-0 chunks of one parameter over ``world_size`` ranks, and the padded chunk size."""
    return _chunks(tuple(lp.shape) if lp.shape else (lp.numel,), world_size)


def _torch_dtype(name: str) -> Any:
    import torch

    return torch.bfloat16 if name == "bf16" else torch.float32


def reduce_scatter_unit_bytes(layers: Sequence[LayerProfile], choice: Mapping[str, str], world_size: int,
                              reduce_dtype: str = "fp32", hook: bool = True,
                              rank: int | None = None) -> int:
    """Bytes one rank sends in one FSDP unit's reduce-scatter over ``world_size`` ranks (``rank``
    None: the mean over ranks), as ``FSDPState.stats()["bytes_sent"]`` counts them.

    FastML (``hook``): each compressed tensor's chunks on their own
    (``codecs.reduce_scatter_bytes``), the uncompressed ones batched per destination in the reduce
    dtype, and a header per destination. FSDP's own: ``(W-1)`` padded rows in the reduce dtype."""
    from fastml_strategy import codecs

    W = world_size
    if W <= 1:
        return 0
    if not hook:
        return (W - 1) * sum(_layout(lp, W)[1] for lp in layers) * DTYPE_BYTES[reduce_dtype]
    dt = _torch_dtype(reduce_dtype)
    total = 0
    batched = [0] * W
    for lp in layers:
        chunks, _ = _layout(lp, W)
        _, cfg = _cfg(choice, lp)
        if not cfg.lossy:  # travels uncompressed, batched with the small tensors
            batched = [a + b for a, b in zip(batched, chunks)]
        else:
            total += codecs.reduce_scatter_bytes(list(chunks), codecs.wire_config(cfg, dt), rank)
    if any(batched):
        total += codecs.reduce_scatter_bytes(batched, codecs.wire_config(CANDIDATES["none"], dt), rank)
    return total + (W - 1) * HEADER


def _shard_cfg(choice: Mapping[str, str], lp: LayerProfile, shard_numel: int,
               replicas: int) -> tuple[str, CodecConfig]:
    """HSDP: the codec the cross-replica all-reduce really uses for one shard: the plan's, looked up
    by the parameter's own size (min_numel is a property of the parameter, not of its shard), with
    top-k's dense fallback at R replicas decided on the shard."""
    from fastml_strategy.codecs import effective_config

    name, cfg = _cfg(choice, lp)
    return name, effective_config(cfg, shard_numel, replicas)


def allreduce_unit_bytes(layers: Sequence[LayerProfile], choice: Mapping[str, str], shard_size: int,
                         replicas: int, reduce_dtype: str = "fp32", hook: bool = True,
                         shard_rank: int | None = None, piece_numel: int = PIECE_NUMEL) -> int:
    """HSDP: bytes one rank sends in one unit's cross-replica all-reduce of its shard (``shard_rank``
    None: the mean over the S shard ranks; the mean over the R replicas). FastML: the unit's shard
    tensors as one bucket of the compressed all-reduce at R replicas
    (:func:`fastml_strategy._layouts.bucket_wire`: the runtime's groups, pipeline pieces and a
    header per message), or, with nothing to compress, DDP's own all-reduce of the padded shard;
    FSDP's own ring all-reduce: ``2(R-1)/R`` of the padded shard in the reduce dtype."""
    R, S = replicas, shard_size
    if R <= 1:
        return 0
    if not hook:
        return int(round(2.0 * (R - 1) / R * sum(_layout(lp, S)[1] for lp in layers)
                         * DTYPE_BYTES[reduce_dtype]))
    dt = _torch_dtype(reduce_dtype)
    planned = tuple(_cfg(choice, lp)[1] for lp in layers)  # looked up by the parameter's own size
    ranks = range(S) if shard_rank is None else (shard_rank,)
    total = 0
    for s in ranks:
        wire = bucket_wire(tuple(_layout(lp, S)[0][s] for lp in layers), planned, R, dt, piece_numel)
        if wire.uncompressed:
            padded = sum(_layout(lp, S)[1] for lp in layers)
            total += int(round(2.0 * (R - 1) / R * padded * DTYPE_BYTES[reduce_dtype]))
        else:
            total += wire.bytes_sent()
    return int(round(total / len(ranks)))


def residual_bytes(profile: Profile, choice: Mapping[str, str], sharding: Sharding, shard_size: int,
                   replicas: int) -> int:
    """Error-feedback memory of one rank (the largest over shard ranks). FSDP: every compressed,
    error-fed tensor keeps a residual of its full size (its reduce-scatter sends every chunk); HSDP:
    of the rank's shard only. 4 bytes per element, 2 with ``residual_dtype="bf16"``."""
    if sharding.kind == "fsdp":
        total = 0
        for lp in profile.layers:
            _, cfg = _cfg(choice, lp)
            if cfg.uses_residual:
                total += lp.numel * DTYPE_BYTES[cfg.residual_dtype]
        return total
    best = 0
    for s in range(shard_size):
        total = 0
        for lp in profile.layers:
            n = _layout(lp, shard_size)[0][s]
            _, cfg = _shard_cfg(choice, lp, n, replicas)
            if cfg.uses_residual:
                total += n * DTYPE_BYTES[cfg.residual_dtype]
        best = max(best, total)
    return best


def fsdp_state_bytes(profile: Profile, shard_size: int) -> int:
    """FSDP's own memory per rank: the fp32 parameter shard, the fp32 gradient shard and the
    optimizer state of the shard (measured by the profile; 8 bytes per parameter, Adam, if not)."""
    numel = sum(lp.numel for lp in profile.layers)
    per_param = 8.0 if profile.optimizer_state_bytes is None or numel == 0 else \
        profile.optimizer_state_bytes / numel
    padded = sum(_layout(lp, shard_size)[1] for lp in profile.layers)
    return int(round(padded * (4 + 4 + per_param)))


def sharded_step_time(profile: Profile, choice: Mapping[str, str], option: HardwareOption,
                      sharding: Sharding, nodes: int | None = None, hook: bool = True) -> StepBreakdown:
    """Predicted step time of a plan under FSDP or HSDP (``hook=False``: FSDP's own collectives,
    the baseline). The schedule is described in the module docstring."""
    n = option.nodes if nodes is None else nodes
    f = option.compute_speed
    scale = profile.world_size / (n * option.accelerators_per_node * f)
    fwd_total, bwd_total = profile.forward_s * scale, profile.backward_s * scale
    hsdp = sharding.kind == "hsdp"
    c = _shard_group(option, sharding, n, profile.collective_overhead_s)
    opt_s = profile.optimizer_s / (c.Ws * f)
    total_numel = sum(lp.numel for lp in profile.layers) or 1
    rows = []
    for name, layers in fsdp_units(profile):
        ag, rs, ar = _unit_bytes(layers, choice, sharding, c, hook)
        rs_t, ar_t = (c.ring(rs), c.cross(ar)) if hsdp else (c.all_to_all(rs) if hook else c.ring(rs), 0.0)
        again = sharding.reshard_after_forward and name != "" and c.Ws > 1
        rows.append({"name": name, "ag_t": c.ring(ag), "again": again, "rs_t": rs_t, "ar_t": ar_t,
                     "codec": _unit_codec_s(profile, layers, choice, c, hsdp, hook, f),
                     "fwd": fwd_total * sum(lp.numel for lp in layers) / total_numel,
                     "ready": bwd_total if name == "" else max(lp.ready_s for lp in layers) * scale,
                     "ag": ag * (2 if again else 1), "rs": rs, "ar": ar})
    # Collectives on one link run in the order they are issued.
    links = _LinkQueue()
    ag_link = "intra" if c.gn == 1 else "net"
    t = _forward_end(rows, links, ag_link)
    end = _backward_end(rows, links, ag_link, "intra" if (hsdp or c.gn == 1) else "net", t, bwd_total)
    codec_total = wire_total = 0.0
    for r in rows:
        codec_total += r["codec"]
        wire_total += r["ag_t"] * (2 if r["again"] else 1) + r["rs_t"] + r["ar_t"]
    ag_bytes, rs_bytes, ar_bytes = (sum(r[k] for r in rows) for k in ("ag", "rs", "ar"))
    compute = fwd_total + bwd_total + opt_s
    step = end + opt_s
    exposed = max(0.0, step - compute - codec_total)
    res = residual_bytes(profile, choice, sharding, c.Ws, c.R) if hook else 0
    return StepBreakdown(compute, codec_total, wire_total, exposed, step, int(ag_bytes + rs_bytes + ar_bytes),
                         allgather_bytes=int(ag_bytes), reduce_scatter_bytes=int(rs_bytes),
                         allreduce_bytes=int(ar_bytes), residual_bytes=int(res),
                         state_bytes=fsdp_state_bytes(profile, c.Ws))


@dataclass(frozen=True)
class _ShardGroup:
    """The collectives of one sharded cluster shape and their time on its links."""

    Ws: int  # shard group size
    R: int  # replicas (HSDP; 1 for FSDP)
    gn: int  # nodes of the shard group
    ga: int  # ranks per node of the shard group
    net: Link
    intra: Link
    over: float  # FSDP's own cost per collective beyond the link (fitted; 0 if not)

    def ring(self, b: float) -> float:
        """FSDP's own all-gather / reduce-scatter of ``b`` bytes per rank over the shard group."""
        if self.Ws <= 1:
            return 0.0
        if self.gn == 1:
            return self.over + (self.ga - 1) * self.intra.latency_s + b / self.intra.bandwidth_Bps
        return (self.over + (self.gn - 1) * self.net.latency_s + (self.ga - 1) * self.intra.latency_s
                + b / self.net.bandwidth_Bps)

    def all_to_all(self, b: float) -> float:
        """FastML's reduce-scatter: every chunk straight to its owner."""
        if self.Ws <= 1:
            return 0.0
        if self.gn == 1:
            return self.over + (self.ga - 1) * self.intra.latency_s + b / self.intra.bandwidth_Bps
        node = self.ga * b * (self.Ws - self.ga) / (self.Ws - 1)
        local = b * (self.ga - 1) / (self.Ws - 1)
        return (self.over + (self.gn - 1) * self.net.latency_s + (self.ga - 1) * self.intra.latency_s
                + max(node / self.net.bandwidth_Bps, local / self.intra.bandwidth_Bps))

    def cross(self, b: float) -> float:
        """HSDP: S all-reduces over R replicas share each node's link."""
        return (self.over + 2 * (self.R - 1) * self.net.latency_s + self.ga * b / self.net.bandwidth_Bps
                if self.R > 1 else 0.0)


def _shard_group(option: HardwareOption, sharding: Sharding, nodes: int, over: float) -> _ShardGroup:
    """The shard group of ``nodes`` nodes of ``option``: FSDP shards over every rank, HSDP over the
    ranks of one node and replicates across nodes."""
    A = option.accelerators_per_node
    hsdp = sharding.kind == "hsdp"
    Ws, R = (A, nodes) if hsdp else (nodes * A, 1)
    gn, ga = (1, A) if hsdp else (nodes, A)
    return _ShardGroup(Ws=Ws, R=R, gn=gn, ga=ga, net=option.link, intra=option.intra_link or sharding.intra_link,
                       over=over)


def _unit_bytes(layers: list[LayerProfile], choice: Mapping[str, str], sharding: Sharding, c: _ShardGroup,
                hook: bool) -> tuple[int, int, int]:
    """Bytes one rank sends per step for one FSDP unit: the parameter all-gather (once), the
    reduce-scatter and (HSDP) the cross-node all-reduce."""
    Ws = c.Ws
    ag = (Ws - 1) * sum(_layout(lp, Ws)[1] for lp in layers) * DTYPE_BYTES[sharding.param_dtype] if Ws > 1 else 0
    if sharding.kind == "hsdp":
        rs = (Ws - 1) * sum(_layout(lp, Ws)[1] for lp in layers) * DTYPE_BYTES[sharding.reduce] if Ws > 1 else 0
        return ag, rs, allreduce_unit_bytes(layers, choice, Ws, c.R, sharding.reduce, hook)
    return ag, reduce_scatter_unit_bytes(layers, choice, Ws, sharding.reduce, hook), 0


def _unit_codec_s(profile: Profile, layers: list[LayerProfile], choice: Mapping[str, str], c: _ShardGroup,
                  hsdp: bool, hook: bool, f: float) -> float:
    """Codec seconds per step of one FSDP unit's tunable layers (HSDP: of the rank's shard, for the
    cross-node all-reduce), at compute speed ``f``."""
    codec = 0.0
    if not hook:
        return codec
    for lp in layers:
        if not lp.tunable:
            continue
        cname, cfg = _cfg(choice, lp)
        if hsdp:
            if c.R <= 1:
                continue
            cname, eff = _shard_cfg(choice, lp, max(1, lp.numel // c.Ws), c.R)
            t = lp.codec_s.get(cname, 0.0) if eff == CANDIDATES[cname] else lp.codec_s.get(
                _candidate_name(eff), lp.codec_s.get("int8", 0.0))
            factor = _codec_factor(eff, c.R) / c.Ws
        else:
            if c.Ws <= 1:
                continue
            eff, t, factor = cfg, lp.codec_s.get(cname, 0.0), 1.0
        codec += t * factor * profile.codec_scale.get(family(eff), 1.0) / f
    return codec


class _LinkQueue:
    """When each link ("net", "intra") is next free: collectives on one link run in issue order."""

    def __init__(self) -> None:
        self.free = {"net": 0.0, "intra": 0.0}

    def occupy(self, link: str, ready: float, dur: float) -> float:
        """Run a collective of ``dur`` seconds on ``link`` once it is ``ready``; return its end."""
        if dur <= 0.0:
            return ready
        start = max(ready, self.free[link])
        self.free[link] = start + dur
        return self.free[link]


def _forward_end(rows: list[dict[str, Any]], links: _LinkQueue, ag_link: str) -> float:
    """When the forward pass ends: unit i's all-gather may start once unit i-1 computes (one unit of
    prefetch)."""
    t = 0.0
    issue = 0.0
    for r in rows:
        done = links.occupy(ag_link, issue, r["ag_t"])
        start = max(t, done)
        issue = start
        t = start + r["fwd"]
    return t


def _backward_end(rows: list[dict[str, Any]], links: _LinkQueue, ag_link: str, rs_link: str, t: float,
                  bwd_total: float) -> float:
    """When the backward pass and its last collective end, from the forward's end ``t``: units in
    the order their gradients are ready (the root, never resharded, last), each unit's parameters
    all-gathered again (when resharded) while the previous one computes."""
    order = sorted(rows, key=lambda r: (r["name"] == "", r["ready"]))
    prev_ready = 0.0
    for i, r in enumerate(order):
        r["dur"] = (bwd_total if i == len(order) - 1 else max(r["ready"], prev_ready)) - prev_ready
        prev_ready = max(prev_ready, r["ready"])
    ag_done = {0: links.occupy(ag_link, t, order[0]["ag_t"]) if order and order[0]["again"] else t}
    comm_end = t
    for i, r in enumerate(order):
        start = max(t, ag_done[i])
        if i + 1 < len(order):  # prefetch the next unit's parameters now
            nxt = order[i + 1]
            ag_done[i + 1] = links.occupy(ag_link, start, nxt["ag_t"]) if nxt["again"] else start
        t = start + r["dur"] + r["codec"]
        rs_done = links.occupy(rs_link, t, r["rs_t"])
        comm_end = max(comm_end, rs_done, links.occupy("net", rs_done, r["ar_t"]))
    return max(t, comm_end)


def fit_collective_overhead(profile: Profile, option: HardwareOption, measured_s: float,
                            sharding: Sharding, hi: float = 1.0) -> float:
    """Sharded training: the per-collective overhead (seconds, in ``[0, hi]``) at which the
    predicted step time of FSDP's own collectives on ``option`` equals ``measured_s`` (bisection;
    the prediction grows with it). 0.0 when the model already predicts at least the measurement."""
    saved = profile.collective_overhead_s

    def pred(x: float) -> float:
        profile.collective_overhead_s = x
        return sharded_step_time(profile, {}, option, sharding, hook=False).step_s

    try:
        if pred(0.0) >= measured_s:
            return 0.0
        if pred(hi) <= measured_s:
            return hi
        a, b = 0.0, hi
        for _ in range(60):
            m = (a + b) / 2
            a, b = (m, b) if pred(m) < measured_s else (a, m)
        return (a + b) / 2
    finally:
        profile.collective_overhead_s = saved
