"""DDP's step time with FastML's hook (or plain DDP) on a cluster option.

1. Compute. The profile measures forward, backward and optimizer time on the profiling machine, at the
   reference world size ``W_ref``. A cluster runs the same training (same global batch, same number of
   steps), so each of its ``R`` ranks takes ``W_ref / R`` of the reference per-rank batch:
   compute scales by ``W_ref / (R * f)`` (linear in the batch: optimistic when per-rank batches get
   small enough to underuse an accelerator).
2. Buckets. Gradients are grouped the way DDP does (reverse parameter order, a 1 MiB first bucket, then
   25 MiB); a bucket is ready when its last gradient is (measured with post-accumulate-grad hooks).
3. Wire. Each bucket is priced as the hook sends it, by the function the hook's layouts are built
   from (:func:`fastml_strategy.wire.bucket_wire`; no sizes are restated here): the same groups
   (one per compressed layer, the uncompressed tensors batched), cut into the same pipeline pieces of
   about :data:`~fastml_strategy.wire.PIECE_NUMEL` elements, each piece one all_to_all and one
   all_gather whose message to every destination starts with a
   :data:`~fastml_strategy.wire.HEADER`-byte header, the all_gather padded to its largest chunk,
   the bucket's top-k messages in its last piece's all_gather (per-rank traffic about ``2(N-1)/N``
   of the compressed size for scatter-reduce-allgather, ``(N-1)`` messages for top-k, with the
   codec's own dense fallback at large ``N``); a bucket with nothing to compress is one plain
   all-reduce (``2(N-1)/N`` of its fp32 bytes). The bytes equal the hook's ``bytes_sent`` per step
   (:func:`ddp_bytes_per_rank` for one rank; ``StepBreakdown.bytes_per_rank`` is the mean over
   ranks). Wire time of a piece = ``2(N-1) a + bytes / B`` (its two collectives, or DDP's ring
   all-reduce). With a measured link, ``a`` and ``1/B`` are the fitted alpha and beta of timed
   collectives (so link sharing between ranks is already in them).
4. Overlap. One communication thread takes buckets in order as they become ready. A piece's codec
   work (its share of each layer's, by elements) runs on the thread once its bucket is ready and the
   wire has finished the piece before the previous one (the thread encodes piece k+1 while piece k
   travels, then waits for it); its transfer starts once that work and the previous transfer are
   done. So codec and wire overlap piece by piece, within a bucket and across buckets (the hook
   decodes a bucket's last piece once the next bucket's first is on the wire); with one piece and
   one bucket the step pays both in full. Encoding shares the processor with the backward pass, so
   backward ends ``T_codec`` later; exposed = what ends after the (stretched) backward pass.
5. Ranks per machine (``A = accelerators_per_node``; :func:`ddp_topology`), as the hook runs them
   (:mod:`fastml_strategy.topology`): with ``N > 1`` machines of ``A > 1`` ranks the hook is
   *hierarchical* (:mod:`fastml_strategy.hierarchical`; :func:`hier_bucket_wire`): every layer is cut
   into ``A`` parts on its codec's part unit, by the runtime's own function
   (:func:`fastml_strategy.wire.hier_parts`), and local rank ``l``'s row is its part of every
   layer. Per bucket a reduce-scatter and an all-gather inside the machine on the intra-node link
   (``2(A-1)`` rounds; each sends ``A-1`` rows padded to the longest, no header, 4 bytes per element,
   or 2 with a 16-bit ``Plan.intra_node``: ``intra_node`` here), between them each row's compressed
   all-reduce across the ``N`` machines, priced as a bucket as in 3 over ``N``, the machine's ``A``
   rows at once on its one network link (piece ``k`` of every row together; ``2(N-1)`` rounds per
   piece); codec time is that of each row's parts (their share of each layer's), the slowest row
   setting a piece's. A 16-bit hop also converts the bucket to and from 16 bits where the fp32 hop
   copies: the profile's fp16 round trip beyond its fp32 one (:func:`_intra_cast_s`). The end-of-step
   agreement (72 bytes per rank over every rank) is not priced. Everything else is *flat*: one machine (``N = 1``: the
   all-reduce over ``A`` ranks on the intra-node link), one rank per machine (the network, as above),
   or flat on request (``topology="flat"``, ``ranks_per_node=1`` in the hook: the scatter-reduce-
   allgather over all ``W`` ranks; a machine's link carries the all_to_all chunks its ``A`` ranks
   send to the other machines, ``A (W-A)/(W-1)`` of one rank's, and the ring all_gather once, piece
   by piece). Plain DDP (``hook=False``) is gloo's/NCCL's ring over all ``W``
   ranks: every link of the ring, the machines' included, carries ``2(W-1)/W`` of the fp32 gradient.
   The intra-node link is the option's ``intra_link``, else PCIe class (:data:`DEFAULT_INTRA_LINK`).
   ``StepBreakdown.node_net_bytes``: what leaves each machine per step; ``topology``: which schedule.
6. Codec time per layer is the measured round trip (one encode + one decode) scaled by how many of each
   the collective does: scatter-reduce-allgather encodes ``1 + 1/N`` of the tensor and decodes ``2`` of
   it, i.e. ``(3 + 1/N) / 2`` round trips; top-k encodes once and scatter-adds ``N-1`` small messages
   (counted as one round trip).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from fastml_strategy.autotune.catalog import HardwareOption, Link
from fastml_strategy.autotune.costmodel.base import (CANDIDATES, DEFAULT_INTRA_LINK, INTRA_NODE_BYTES,
                                                     LayerProfile, Profile, Sharding, StepBreakdown,
                                                     _candidate_name, _cfg, _codec_factor, codec_registry, family)
from fastml_strategy.autotune.costmodel.sharded import sharded_step_time
from fastml_strategy.wire import PIECE_NUMEL, BucketWire, bucket_wire, hier_parts
from fastml_strategy.wire import schedule as _schedule

# DDP's bucket sizes (torch.nn.parallel.DistributedDataParallel: bucket_cap_mb=25, and
# dist._DEFAULT_FIRST_BUCKET_BYTES = 1 MiB for the first bucket, the last layers).
FIRST_BUCKET_BYTES = 1 << 20
BUCKET_BYTES = 25 << 20
# Bucket caps (MiB, DDP's bucket_cap_mb) the search tries on each option's chosen plan, beside DDP's
# default (None: 1 MiB first, then 25). A small model fits in one default bucket, so nothing overlaps
# backward; smaller buckets overlap more but pay 2(N-1) latency rounds per piece each.
BUCKET_MB_CHOICES: tuple[int | None, ...] = (None, 1, 2, 4, 8, 16)


# -- buckets -------------------------------------------------------------------------------------
def ddp_buckets(profile: Profile, bucket_mb: float | None = None) -> list[list[LayerProfile]]:
    """Layers grouped as DDP buckets them: reverse registration order; by default (``bucket_mb``
    None) a 1 MiB first bucket, then 25 MiB; with ``bucket_cap_mb=bucket_mb`` given to DDP, every
    bucket (the first too, as torch does) up to that many MiB."""
    buckets: list[list[LayerProfile]] = []
    cur: list[LayerProfile] = []
    size = 0
    cap = FIRST_BUCKET_BYTES if bucket_mb is None else int(bucket_mb * (1 << 20))
    rest = BUCKET_BYTES if bucket_mb is None else cap
    for lp in sorted(profile.layers, key=lambda x: -x.index):
        cur.append(lp)
        size += 4 * lp.numel
        if size >= cap:
            buckets.append(cur)
            cur, size, cap = [], 0, rest
    if cur:
        buckets.append(cur)
    return buckets


def _layer_cost(profile: Profile, lp: LayerProfile, choice: Mapping[str, str], nodes: int,
                speed: float, hook: bool = True, numel: int | None = None) -> tuple[int, float]:
    """(bytes one rank sends, codec seconds) of one layer in one compressed all-reduce over
    ``nodes`` (``hook=False``: DDP's fp32 all-reduce, no codec); ``numel``: the elements all-reduced
    when that is a part of the layer (the hierarchical path's, :func:`hier_bucket_wire`), whose codec
    time is that share of the layer's."""
    from fastml_strategy.codecs import effective_config, wire_bytes

    if nodes <= 1:
        return 0, 0.0
    name, cfg = _cfg(choice, lp) if hook else ("none", CANDIDATES["none"])
    numel = lp.numel if numel is None else int(numel)
    share = numel / lp.numel if lp.numel else 0.0
    shape = _shape(lp) if numel == lp.numel else None
    nbytes = wire_bytes(numel, cfg, nodes, shape)
    if not (hook and lp.tunable):
        return nbytes, 0.0
    eff = effective_config(cfg, numel, nodes, shape)
    # a top-k layer past its fallback world size runs its dense fallback codec
    t = lp.codec_s.get(name, 0.0) if eff == cfg else lp.codec_s.get(
        _candidate_name(eff), lp.codec_s.get("int8", 0.0))
    return nbytes, t * _codec_factor(eff, nodes) * profile.codec_scale.get(family(eff), 1.0) / speed * share


def _shape(lp: LayerProfile) -> tuple[int, ...] | None:
    """The layer's shape as the hook sees it (a profile without shapes: None, a flat vector, which the
    low-rank codec does not compress)."""
    return tuple(lp.shape) if lp.shape else None


def ddp_topology(nodes: int, ranks_per_node: int, topology: str = "auto") -> str:
    """The schedule the DDP hook runs (and the cost model prices): ``"hierarchical"`` on more than one
    machine of more than one rank, unless ``topology="flat"`` (``register_hook(ranks_per_node=1)``);
    else ``"flat"``."""
    if topology not in ("auto", "flat", "hierarchical"):
        raise ValueError(f"topology={topology!r}; use 'auto' (as the hook detects it), 'flat' or "
                         f"'hierarchical'")
    if topology == "flat" or nodes <= 1 or ranks_per_node <= 1:
        return "flat"
    return "hierarchical"


def intra_node_choices(profile: Profile, option: HardwareOption, sharding: Sharding | None = None) -> tuple[str, ...]:
    """The ``Plan.intra_node`` values the search tries on ``option``: none where the hop does not exist
    (sharded training, one machine, one rank per machine: ``()``, and plans keep no ``intra_node``);
    else exact (``"none"``), ``"bf16"`` (fp32's range: no gradient overflows or flushes to zero) and
    ``"fp16"`` only where the profile measured the fp16 cast on the real gradients within twice its
    unit roundoff (no range loss seen: it then rounds 8x finer than bf16)."""
    from fastml_strategy.autotune.costmodel.base import INTRA_NODE_ERROR, measured_fp16_error

    if (sharding is not None and sharding.sharded) or ddp_topology(option.nodes, option.accelerators_per_node) != \
            "hierarchical":
        return ()
    fp16 = measured_fp16_error(profile)
    return ("none", "bf16") + (("fp16",) if fp16 is not None and fp16 <= 2 * INTRA_NODE_ERROR["fp16"] else ())


@dataclass(frozen=True)
class HierBucketWire:
    """What one DDP bucket puts on the links with the hierarchical hook
    (:mod:`fastml_strategy.hierarchical`), without tensors: ``parts[l][i]``, the elements of layer
    ``i`` in local rank ``l``'s row (cut by :func:`fastml_strategy.wire.hier_parts`, as the
    runtime cuts them); ``rows[l]``, that row's compressed all-reduce across the machines (None: the
    row is empty and the rank skips it); ``row_numel``, the rows' common padded length (the
    reduce-scatter's all_to_all and the all-gather inside the machine send equal rows)."""

    ranks_per_node: int
    row_numel: int
    parts: tuple[tuple[int, ...], ...]
    rows: tuple[BucketWire | None, ...]

    def intra_bytes(self, elem_size: int = 4) -> int:
        """Bytes every rank sends inside its machine per step: the reduce-scatter's all_to_all and the
        all-gather, ``A - 1`` padded rows each, of ``elem_size`` bytes per element (2 with a 16-bit
        ``Plan.intra_node``). The hop has no header: its errors surface in the end-of-step agreement."""
        return 2 * (self.ranks_per_node - 1) * self.row_numel * elem_size

    def inter_bytes(self, local_rank: int, node_rank: int | None = None) -> int:
        """Bytes local rank ``local_rank`` sends to other machines (of node rank ``node_rank``; None:
        the mean over machines), as the hook's ``bytes_sent_inter`` counts them."""
        row = self.rows[local_rank]
        return 0 if row is None else row.bytes_sent(node_rank)

    def node_bytes(self) -> int:
        """Bytes leaving each machine: its ranks' rows, all on its one network link."""
        return sum(self.inter_bytes(l) for l in range(self.ranks_per_node))


def hier_bucket_wire(bucket: Sequence[LayerProfile], choice: Mapping[str, str], nodes: int, ranks_per_node: int,
                     piece_numel: int = PIECE_NUMEL) -> HierBucketWire:
    """The messages of one DDP bucket of these layers on ``nodes`` machines of ``ranks_per_node``
    ranks with the hierarchical hook: every layer cut into parts on its codec's part unit (each
    layer's codec is the plan's for the whole parameter), local rank ``l``'s row (its part of every
    layer, bucket order, empty parts left out) priced by :func:`fastml_strategy.wire.bucket_wire`
    over the ``nodes`` machines, as :class:`fastml_strategy.hierarchical.HierLayout` builds it."""
    A = ranks_per_node
    reg = codec_registry()
    cfgs = [_cfg(choice, lp)[1] for lp in bucket]
    cut = hier_parts(reg, cfgs, [lp.numel for lp in bucket], A)
    rows = []
    for l in range(A):
        row = cut.row(l)
        rows.append(bucket_wire(reg, tuple(n for _, _, n in row), tuple(cfgs[i] for i, _, _ in row), nodes,
                                piece_numel=piece_numel) if row else None)
    return HierBucketWire(A, cut.row_numel, cut.parts, tuple(rows))


def bucket_wire_of(bucket: Sequence[LayerProfile], choice: Mapping[str, str], world_size: int,
                   piece_numel: int = PIECE_NUMEL) -> BucketWire:
    """The messages the hook sends for one DDP bucket of these layers at ``world_size`` ranks
    (:func:`fastml_strategy.wire.bucket_wire`: the runtime's own grouping, pipeline pieces of
    about ``piece_numel`` elements and headers; the hierarchical path's rows: :func:`hier_bucket_wire`)."""
    numels = tuple(lp.numel for lp in bucket)
    cfgs = tuple(_cfg(choice, lp)[1] for lp in bucket)
    shapes = tuple(_shape(lp) for lp in bucket) if any(c.wire.lowrank for c in cfgs) else None
    return bucket_wire(codec_registry(), numels, cfgs, world_size, piece_numel=piece_numel, shapes=shapes)


def bucket_schedule(wire: BucketWire, schedule: str, latency_s: float, bandwidth_Bps: float) -> str:
    """The schedule the runtime runs for this bucket (``"plain"``, ``"ring"``, ``"halving"``): the
    runtime's own choice (:func:`fastml_strategy.wire.schedule.choose_schedule`) on the same message sizes,
    ``schedule`` being ``Plan.schedule`` and the link its hint (the autotuner writes the option's link
    into the plans it makes: :func:`plan_link_hint`)."""
    return _schedule.choose_schedule(schedule, wire.world_size, [(p.split_sizes, p.gather_size) for p in wire.pieces],
                                    any(p.topk for p in wire.pieces), wire.uncompressed, latency_s, bandwidth_Bps)


def plan_link_hint(link: Link) -> dict:
    """The ``Plan`` fields that make the runtime's ``"auto"`` schedule pick what the cost model priced
    on ``link`` (``link_latency_us``, ``link_gbps``)."""
    return {"link_latency_us": round(link.latency_s * 1e6, 3), "link_gbps": round(link.bandwidth_Bps * 8 / 1e9, 6)}


def halving_codec_factor(world_size: int) -> float:
    """Codec round trips per layer and step of the halving schedule on its busiest rank, against the
    profiled one (:mod:`fastml_strategy.wire.schedule`): encodes ``1.5`` of the tensor (its own, the
    intermediate partial sums, the owner's mean) and decodes ``2.5 - 1/P``; a rank that takes a folded
    partner's piece also decodes that piece and re-encodes its first half: ``3 - 1/(2P)``."""
    P = 1 << (world_size.bit_length() - 1)
    return (2.0 if P == world_size else 3.0) - 1.0 / (2 * P)


def bucket_bytes(wire: BucketWire, schedule: str, rank: int | None = None) -> float:
    """Bytes ``rank`` sends for one bucket under ``schedule`` (None: the mean over ranks), as the hook's
    ``bytes_sent`` counts them: :meth:`BucketWire.bytes_sent` for the ring and plain all-reduce,
    :func:`fastml_strategy.wire.schedule.halving_bytes_sent` per piece for halving."""
    if schedule != "halving" or wire.world_size <= 1:
        return wire.bytes_sent(rank)
    return sum(_schedule.halving_bytes_sent(p.split_sizes, rank) for p in wire.pieces) + wire.lowrank_bytes(rank)


def ddp_bytes_per_rank(profile: Profile, choice: Mapping[str, str], world_size: int, rank: int | None = None,
                       bucket_mb: float | None = None, piece_numel: int = PIECE_NUMEL, schedule: str = "auto",
                       link: Link | None = None) -> int:
    """Bytes ``rank`` sends per step with the hook on ``world_size`` ranks (flat schedule), headers
    included, as ``state.stats()["bytes_sent"]`` counts them per step (None: the mean over ranks).
    ``schedule``/``link``: ``Plan.schedule`` and the link hint (None: the runtime's default)."""
    lat, bw = (link.latency_s, link.bandwidth_Bps) if link is not None else _schedule.link_hint(None)
    total = 0.0
    for b in ddp_buckets(profile, bucket_mb):
        wire = bucket_wire_of(b, choice, world_size, piece_numel=piece_numel)
        total += bucket_bytes(wire, bucket_schedule(wire, schedule, lat, bw), rank)
    return int(round(total))


def _piece_codec(profile: Profile, bucket: Sequence[LayerProfile], choice: Mapping[str, str], wire: BucketWire,
                 speed: float, numels: Sequence[int] | None = None) -> list[float]:
    """Codec seconds of each piece of ``wire``: each layer's (:func:`_layer_cost`) spread over the
    pieces in proportion to the elements of its group each carries; top-k layers in the last piece,
    whose all_gather carries them. ``numels``: the elements of each layer the wire carries (the
    hierarchical path's parts; None: the whole layers)."""
    W = wire.world_size
    numels = [lp.numel for lp in bucket] if numels is None else list(numels)
    per_layer = [_layer_cost(profile, lp, choice, W, speed, True, m)[1] for lp, m in zip(bucket, numels)]
    group_s = [sum(per_layer[i] for i in idx) for idx in wire.groups]
    group_n = [sum(numels[i] for i in idx) for idx in wire.groups]
    return [sum(group_s[g] * n / group_n[g] for g, n in p.parts if group_n[g])
            + sum(per_layer[i] for i in p.topk) for p in wire.pieces]


def _intra_cast_s(profile: Profile, bucket: Sequence[LayerProfile], speed: float) -> float:
    """Seconds a 16-bit hop inside the machine adds to the communication thread for one bucket: its
    stage fill and its copy back into the bucket convert to and from 16 bits where the fp32 hop only
    copies, one conversion each way of the whole bucket, which is what the profile's fp16 round trip
    costs beyond its fp32 one (tunable layers; the small ones are not timed, and are neglected)."""
    scale = profile.codec_scale.get("cast", 1.0)
    return sum(max(0.0, lp.codec_s.get("fp16", 0.0) - lp.codec_s.get("none", 0.0)) for lp in bucket
               if lp.tunable) * scale / speed


def _hier_bucket_comm(profile: Profile, bucket: Sequence[LayerProfile], choice: Mapping[str, str], n: int,
                      A: int, option: HardwareOption, intra: Link, piece_numel: int,
                      intra_node: str | None, schedule: str = "auto",
                      seen: dict | None = None) -> tuple[int, int, list[tuple[float, float]]]:
    """:func:`_bucket_comm` of the hierarchical schedule (``n`` machines of ``A`` ranks, the hook's
    default there)."""
    speed, net = option.compute_speed, option.link
    # the reduce-scatter and all-gather inside the machine (before and after; fp32, or 16-bit
    # with intra_node), between them each local rank's row of parts all-reduced across the n
    # machines, the machine's A ranks at once on its one link (pipeline piece k of every row
    # together: the rows' pieces are issued in step)
    hw = hier_bucket_wire(bucket, choice, n, A, piece_numel=piece_numel)
    half = intra_node not in (None, "none")
    inner = hw.intra_bytes(INTRA_NODE_BYTES["none" if intra_node is None else intra_node])
    inner_s = 2 * (A - 1) * intra.latency_s + inner / intra.bandwidth_Bps
    cast_s = _intra_cast_s(profile, bucket, speed) if half else 0.0
    # (codec seconds, bytes, latency rounds) per piece of each row; a row the runtime runs through
    # recursive halving (its own choice, on the row's messages) is one piece of its rounds
    per_row: list[list[tuple[float, float, int]]] = []
    node = 0.0
    for row, wire in zip(hw.parts, hw.rows):
        if wire is None:
            continue
        sched = bucket_schedule(wire, schedule, net.latency_s, net.bandwidth_Bps)
        node += bucket_bytes(wire, sched)
        if seen is not None:
            seen[sched] = seen.get(sched, 0) + 1
        if sched == "plain":
            per_row.append([(0.0, float(wire.bytes_sent()), 2 * (n - 1))])
            continue
        sub = [(lp, m) for lp, m in zip(bucket, row) if m > 0]
        codec = [0.0] * len(wire.pieces) if wire.uncompressed else \
            _piece_codec(profile, [lp for lp, _ in sub], choice, wire, speed, [m for _, m in sub])
        if sched == "halving":
            rounds = [_schedule.halving_rounds(p.split_sizes) for p in wire.pieces]
            per_row.append([(sum(codec) * halving_codec_factor(n) / ((3.0 + 1.0 / n) / 2.0),
                             float(sum(map(sum, rounds))), sum(map(len, rounds)))])
            continue
        per_row.append([(c, p.bytes_sent(), 2 * (n - 1)) for c, p in zip(codec, wire.pieces)])
    stages = []
    for k in range(max((len(r) for r in per_row), default=0)):
        at = [r[k] for r in per_row if k < len(r)]
        stages.append((max(c for c, _, _ in at), max(q for _, _, q in at) * net.latency_s
                       + sum(b for _, b, _ in at) / net.bandwidth_Bps))
    stages = [(cast_s / 2, inner_s / 2)] + stages + [(cast_s / 2, inner_s / 2)]
    node = int(round(node))  # hw.node_bytes() for ring rows
    return inner + int(round(node / A)), node, stages


def _bucket_comm(profile: Profile, bucket: Sequence[LayerProfile], choice: Mapping[str, str], n: int, A: int,
                 option: HardwareOption, intra: Link, hook: bool, topology: str,
                 piece_numel: int = PIECE_NUMEL,
                 intra_node: str | None = None, schedule: str = "auto",
                 seen: dict | None = None,
                 ring_element_bytes: int = 4) -> tuple[int, int, list[tuple[float, float]]]:
    """(bytes one rank sends, bytes leaving each machine, (codec seconds, wire seconds) per pipeline
    stage) of one DDP bucket on ``n`` machines of ``A`` ranks (module docstring, items 3 and 5);
    ``intra_node``: ``Plan.intra_node`` (the hierarchical hop inside the machine in fp16/bf16)."""
    W, speed, net = n * A, option.compute_speed, option.link
    numel = sum(lp.numel for lp in bucket)
    if W <= 1:
        return 0, 0, []
    if not hook:  # DDP's ring all-reduce over all W ranks, fp32 (2 bytes: torch's fp16/bf16 hooks)
        nbytes = int(round(2.0 * (W - 1) / W * ring_element_bytes * numel))
        link = net if n > 1 else intra
        lat = intra.latency_s if n <= 1 else max(net.latency_s, intra.latency_s) if A > 1 else net.latency_s
        return nbytes, nbytes if n > 1 else 0, [(0.0, 2 * (W - 1) * lat + nbytes / link.bandwidth_Bps)]
    if topology == "hierarchical":
        return _hier_bucket_comm(profile, bucket, choice, n, A, option, intra, piece_numel, intra_node, schedule, seen)
    wire = bucket_wire_of(bucket, choice, W, piece_numel=piece_numel)
    nbytes = wire.bytes_sent()
    # one machine: the intra-node link only. Flat over W ranks on n > 1 machines: the all_to_all
    # sends each chunk straight to its owner, so the machine's A ranks put A (W-A)/(W-1) of their
    # all_to_all bytes on its link; the all_gather (gloo's and NCCL's ring) crosses each machine's
    # link once: one rank's all_gather bytes. (Measured, DESIGN.md: 1.76 and 2.89 x S_c per machine
    # at A = 2 and 4 on two machines, against 1.75 and 2.875 here.)
    link = intra if n <= 1 else net
    lat = intra.latency_s if n <= 1 else max(net.latency_s, intra.latency_s) if A > 1 else net.latency_s
    share = A * (W - A) / (W - 1)
    sched = bucket_schedule(wire, schedule, lat, link.bandwidth_Bps)
    if seen is not None:
        seen[sched] = seen.get(sched, 0) + 1
    if sched == "plain":  # the hook's plain all-reduce: DDP's ring
        node = nbytes if n > 1 else 0
        return nbytes, node, [(0.0, 2 * (W - 1) * lat + (nbytes if n <= 1 else node) / link.bandwidth_Bps)]
    if sched == "halving":
        nb, node_b, st = _halving_bucket_comm(profile, bucket, choice, wire, n, A, lat, link, speed)
        low, low_node = _lowrank_stages(profile, bucket, choice, wire, W, lat, link, speed, n)
        return nb, node_b + int(round(low_node)), low + st
    stages, node = _lowrank_stages(profile, bucket, choice, wire, W, lat, link, speed, n)
    for c, p in zip(_piece_codec(profile, bucket, choice, wire, speed), wire.pieces):
        b = p.bytes_sent() if n <= 1 else share * p.all_to_all_bytes() + p.all_gather_bytes()
        node += b
        stages.append((c, 2 * (W - 1) * lat + b / link.bandwidth_Bps))
    return nbytes, int(round(node)) if n > 1 else 0, stages


def _lowrank_stages(profile: Profile, bucket: Sequence[LayerProfile], choice: Mapping[str, str], wire: BucketWire,
                    W: int, lat: float, link: Link, speed: float, n: int) -> tuple[list[tuple[float, float]], float]:
    """The bucket's low-rank factor rounds as one pipeline stage before its pieces (the hook runs them
    first): the low-rank layers' codec seconds (orthogonalisation and matmuls), and on the wire two
    all-reduces per section (each a ring's ``2(W-1)`` latency rounds; compressed factors: one piece of
    the compressed all-reduce each, the same rounds) plus their bytes; ``([], 0)`` without any.
    Returns ``(stages, bytes leaving each machine)``."""
    if not wire.lowrank:
        return [], 0.0
    codec = sum(_layer_cost(profile, lp, choice, W, speed)[1] for lp, cfg in zip(bucket, wire.configs)
                if cfg.wire.lowrank)
    nbytes = wire.lowrank_bytes()
    rounds = 2 * len(wire.lowrank) * 2 * (W - 1)
    return [(codec, rounds * lat + nbytes / link.bandwidth_Bps)], float(nbytes) if n > 1 else 0.0


def _halving_bucket_comm(profile: Profile, bucket: Sequence[LayerProfile], choice: Mapping[str, str],
                         wire: BucketWire, n: int, A: int, lat: float, link: Link,
                         speed: float) -> tuple[int, int, list[tuple[float, float]]]:
    """:func:`_bucket_comm` of a bucket the runtime runs through recursive halving/doubling
    (:mod:`fastml_strategy.wire.schedule`): per piece, one latency per round plus the round's largest
    message (:func:`fastml_strategy.wire.schedule.halving_piece_seconds`), and the codec work of the
    halving schedule (:func:`halving_codec_factor`), which runs between the rounds (serial with them:
    one stage per bucket). A machine of ``A`` consecutive ranks (flat on request) carries its ranks'
    messages to the other machines (:func:`fastml_strategy.wire.schedule.halving_node_bytes`), the
    rounds' latency once."""
    W = wire.world_size
    ring_f = (3.0 + 1.0 / W) / 2.0
    scale = halving_codec_factor(W) / ring_f
    codec = sum(_piece_codec(profile, bucket, choice, wire, speed)) * scale if not wire.uncompressed else 0.0
    rounds = [_schedule.halving_rounds(p.split_sizes) for p in wire.pieces]
    nbytes = bucket_bytes(wire, "halving")
    if n <= 1 or A <= 1:
        wire_s = sum(len(r) * lat + sum(r) / link.bandwidth_Bps for r in rounds)
        return int(round(nbytes)), int(round(nbytes)) if n > 1 else 0, [(codec, wire_s)]
    # flat on request: what each machine's link carries (the rounds whose partner is elsewhere)
    node = sum(_schedule.halving_node_bytes(p.split_sizes, A) for p in wire.pieces)
    wire_s = sum(len(r) for r in rounds) * lat + node / link.bandwidth_Bps
    return int(round(nbytes)), int(round(node)), [(codec, wire_s)]


def ddp_node_net_bytes(profile: Profile, choice: Mapping[str, str], option: HardwareOption,
                       hook: bool = True, topology: str = "auto", bucket_mb: float | None = None) -> int:
    """Bytes leaving each machine per DDP step (what a machine's network counter shows), as
    :func:`step_time` prices them (``Plan.intra_node`` does not change them)."""
    return step_time(profile, choice, option, hook=hook, bucket_mb=bucket_mb, topology=topology).node_net_bytes


def step_time(profile: Profile, choice: Mapping[str, str], option: HardwareOption,
              nodes: int | None = None, hook: bool = True,
              sharding: Sharding | None = None, bucket_mb: float | None = None,
              topology: str = "auto", piece_numel: int = PIECE_NUMEL,
              intra_node: str | None = None, schedule: str = "auto",
              ring_element_bytes: int = 4) -> StepBreakdown:
    """Predicted step time of a plan (``choice``: layer name -> CANDIDATES key) on ``option``
    (with ``nodes`` overriding the option's node count, for scaling predictions). ``hook=False`` is
    plain DDP (fp32 all-reduce, no encode/decode), the uncompressed baseline. With a sharded
    ``sharding``: :func:`sharded_step_time` (``hook=False``: FSDP's own collectives). ``topology``:
    the hook's schedule on several ranks per machine (:func:`ddp_topology`: ``"auto"`` as the hook
    runs it, ``"flat"`` as with ``register_hook(ranks_per_node=1)``); ``piece_numel``: the hook's
    pipeline piece (:data:`fastml_strategy.wire.PIECE_NUMEL`, what it runs with); ``intra_node``:
    ``Plan.intra_node`` (None or "none": exact; "bf16"/"fp16": the hierarchical hop inside the machine
    at 2 bytes per element; no effect on a flat schedule, as in the hook); ``schedule``:
    ``Plan.schedule`` (``"auto"``: per bucket, the runtime's own choice on the option's link, which the
    autotuner writes into its plans as the link hint; ``StepBreakdown.schedules`` says which ran);
    ``ring_element_bytes``: with ``hook=False``, the bytes per element DDP's ring all-reduces (2:
    torch's ``fp16_compress_hook`` or ``bf16_compress_hook``, whose cast is not priced)."""
    if sharding is not None and sharding.sharded:
        return sharded_step_time(profile, choice, option, sharding, nodes=nodes, hook=hook)
    n = option.nodes if nodes is None else nodes
    A = option.accelerators_per_node
    topo = ddp_topology(n, A, topology) if hook else "flat"
    intra = option.intra_link or (sharding.intra_link if sharding is not None else DEFAULT_INTRA_LINK)
    ranks = n * A
    scale = profile.world_size / (ranks * option.compute_speed)
    fwd, bwd, opt = (profile.forward_s * scale, profile.backward_s * scale, profile.optimizer_s * scale)
    codec_total = wire_total = 0.0
    total_bytes = node_total = 0
    # Two clocks: the communication thread's (codec work) and the wire's. A stage's codec work
    # starts when its bucket is ready, the thread is free, and the wire has finished the stage
    # before the previous one (the thread runs one piece ahead: it encodes piece k+1, then waits for
    # piece k); its transfer starts when both its codec work and the previous transfer are done.
    cpu = wire_end = 0.0
    done: list[float] = [0.0, 0.0]  # wire ends of the last two stages
    seen: dict[str, int] = {}  # buckets (hierarchical: rows) per schedule
    for bucket in ddp_buckets(profile, bucket_mb):
        nbytes, node_b, stages = _bucket_comm(profile, bucket, choice, n, A, option, intra, hook, topo, piece_numel,
                                              intra_node, schedule, seen, ring_element_bytes)
        node_total += node_b
        total_bytes += nbytes
        ready = max(lp.ready_s for lp in bucket) * scale
        for codec_s, wire_s in stages:
            cpu = max(cpu, ready, done[0]) + codec_s
            wire_end = max(wire_end, cpu) + wire_s
            done = [done[1], wire_end]
            codec_total += codec_s
            wire_total += wire_s
    # The codec shares the processor with backward, so backward's end moves by the codec time; the
    # communication ends after its last transfer.
    end = max(bwd + codec_total, wire_end)
    exposed = max(0.0, end - bwd - codec_total)
    step = fwd + end + opt
    return StepBreakdown(fwd + bwd + opt, codec_total, wire_total, exposed, step, total_bytes,
                         node_net_bytes=node_total, topology=topo, schedules=schedule_words(seen))


def schedule_words(seen: Mapping[str, int]) -> str:
    """``"halving"``, ``"ring"``, ``"ring 3 + halving 5"``: the schedules of a step's buckets (plain
    all-reduces named only when nothing else ran)."""
    kinds = {k: v for k, v in seen.items() if k != "plain"} or dict(seen)
    if len(kinds) <= 1:
        return next(iter(kinds), "")
    return " + ".join(f"{k} {v}" for k, v in sorted(kinds.items()))
