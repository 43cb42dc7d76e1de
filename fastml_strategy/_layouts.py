"""Where every chunk of a compressed collective lies: the layouts of a DDP bucket (all-reduce) and of an
FSDP unit (reduce-scatter), built once per shape and kept by the engine's
:class:`~fastml_strategy._residuals.ResidualStore` with the error-feedback residuals they own.

A layout splits its gradients by parameter into *groups* (:class:`_DenseGroup`: one per compressed
layer, whose codec comes from the plan, and one batched group of the uncompressed tensors; top-k layers
are :class:`_TopkParam`), cuts each group into W chunks on codec-unit boundaries (a quantization block
never spans two chunks, so it never mixes two ranks' scales) and places every chunk in the messages:
for destination j, ``[header | group 0 chunk j | group 1 chunk j | ...]`` (:class:`_Messages`). A
bucket is also cut into pipeline pieces (:class:`_Piece`, :data:`PIECE_NUMEL`), each with its own
all_to_all and all_gather messages. Sizes and offsets come from the codecs
(:func:`fastml_strategy.codecs.chunk_nbytes`), the header from :mod:`fastml_strategy._status`.
"""

from __future__ import annotations

import functools
import math
import operator
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from fastml_strategy import codecs
from fastml_strategy._seeds import layer_key  # noqa: F401  (re-exported: the collectives import it from here)
from fastml_strategy._status import HEADER
from fastml_strategy.config import RECIPES, CodecConfig, Plan

__all__ = ["BucketLayout", "ShardLayout", "ShardedTensor", "PIECE_NUMEL", "chunk_bounds", "part_bounds_of",
           "bucket_groups",
           "piece_slices", "pack_pieces", "BucketWire", "PieceWire", "bucket_wire"]


@dataclass
class _Param:
    name: str
    boff: int  # offset in the bucket buffer (elements); -1 in a reduce-scatter (see _DenseGroup.pieces)
    numel: int
    goff: int = 0  # offset in its group's flat vector


@dataclass
class _DenseGroup:
    """One segment of the message: a single parameter (read from and decoded straight into the
    communication buffer when that is fp32, or always in a reduce-scatter), or the uncompressed
    parameters gathered into one flat vector.

    The group's flat vector is cut into W chunks at ``bounds``; chunk j is encoded for (all-reduce:
    reduced by) rank j. ``pieces`` say where the flat vector lies in the buffer."""

    cfg: CodecConfig
    params: list[_Param]
    length: int  # elements
    bounds: list[int]  # W + 1 chunk boundaries (elements)
    nbytes: list[int]  # encoded bytes of chunk j
    pieces: list[tuple[int, int, int]]  # (buffer offset, flat offset, elements)
    direct: bool = False  # True: chunk j is the buffer slice at chunk_base[j], no copy
    chunk_base: list[int] = field(default_factory=list)
    send_off: list[int] = field(default_factory=list)  # offset of chunk j in the all_to_all buffer
    recv_off: int = 0  # offset inside this rank's chunk message
    gather_off: list[int] = field(default_factory=list)  # offset in rank j's all_gather message
    x: torch.Tensor | None = None  # flat fp32 staging vector (not direct)
    res_cur: torch.Tensor | None = None
    res_next: torch.Tensor | None = None  # None: the residual is updated in place (one buffer)
    res_off: int = -1  # offset of the residuals in the layout's res_flat buffers (-1: own tensors)
    acc: torch.Tensor | None = None  # this rank's chunk sum
    # A segment of a pipelined bucket: a slice [bounds[0], bounds[W]) of ``parent``'s flat vector,
    # cut into W chunks of its own. The parent keeps the staging vector and the residuals; ``bounds``
    # are positions in the parent's flat vector, so ``parent.res_cur[a:b]`` is chunk j's residual.
    parent: "_DenseGroup | None" = None
    codec: Any = field(init=False, repr=False)  # codecs.codec_for(cfg)

    def __post_init__(self) -> None:
        self.codec = codecs.codec_for(self.cfg)

    @property
    def base(self) -> "_DenseGroup":
        """The group that owns the staging vector and the residuals (itself unless a segment)."""
        return self if self.parent is None else self.parent

    @property
    def ef(self) -> bool:
        """Whether the group keeps an error-feedback residual (``cfg.uses_residual``)."""
        return self.cfg.error_feedback and self.codec.error_feedback

    @property
    def key(self) -> int:
        return layer_key(self.params[0].name)

    def chunk(self, buf: torch.Tensor, j: int) -> torch.Tensor:
        """Chunk j of the flat vector: a view of ``buf`` (direct) or of the staging vector."""
        a, b = self.bounds[j], self.bounds[j + 1]
        if self.direct:
            return buf[self.chunk_base[j]: self.chunk_base[j] + b - a]
        return self.base.x[a:b]

    def _ranges(self):
        """(buffer offset, flat offset, elements) of the pieces that fall in this group's slice."""
        lo, hi = self.bounds[0], self.bounds[-1]
        for boff, goff, n in self.base.pieces:
            a, b = max(goff, lo), min(goff + n, hi)
            if a < b:
                yield boff + a - goff, a, b - a

    def gather(self, buf: torch.Tensor) -> None:
        x = self.base.x
        for boff, goff, n in self._ranges():
            x[goff: goff + n].copy_(buf[boff: boff + n])

    def scatter(self, buf: torch.Tensor) -> None:
        x = self.base.x
        for boff, goff, n in self._ranges():
            buf[boff: boff + n].copy_(x[goff: goff + n])

    def alloc_residual(self, device: torch.device, double_buffer: bool) -> None:
        if self.ef:
            dt = self.cfg.residual_torch_dtype
            self.res_cur = torch.zeros(self.length, dtype=dt, device=device)
            if double_buffer:
                self.res_next = torch.zeros(self.length, dtype=dt, device=device)

    def residual_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.res_cur, self.res_next) if t is not None)


@dataclass
class _TopkParam:
    cfg: CodecConfig
    param: _Param
    nbytes: int
    gather_off: int = 0
    residual: torch.Tensor | None = None
    pending: torch.Tensor | None = None



def chunk_bounds(length: int, unit: int, W: int) -> list[int]:
    """W + 1 boundaries cutting ``length`` elements into W near-equal chunks on ``unit`` boundaries."""
    units = math.ceil(length / unit)
    return [min(length, (j * units // W) * unit) for j in range(W)] + [length]


def part_bounds_of(cfg: CodecConfig, numel: int, parts: int) -> list[int]:
    """The ``parts + 1`` boundaries of a parameter of ``numel`` elements whose plan names ``cfg``, cut
    into the hierarchical all-reduce's parts (part j: local rank j's) on the codec's
    :meth:`~fastml_strategy.codecs.WireCodec.part_unit`. Tensor-free: the runtime
    (:func:`fastml_strategy.hierarchical.part_bounds`) and the autotuner's cost model cut with it."""
    return chunk_bounds(numel, codecs.codec_for(cfg).part_unit(), parts)


class _Messages:
    """The all_to_all message of a layout's dense groups: for destination j,
    ``[header | group 0 chunk j | group 1 chunk j | ...]``."""

    dense: list[_DenseGroup]

    def _plan_all_to_all(self, W: int, rank: int) -> None:
        self.world_size, self.rank = W, rank
        self.split_sizes: list[int] = []
        pos = 0
        for j in range(W):
            size = HEADER
            for g in self.dense:
                g.send_off.append(pos + size)
                size += g.nbytes[j]
            self.split_sizes.append(size)
            pos += size
        self.send_size = pos
        self.my_chunk = self.split_sizes[rank]
        size = HEADER
        for g in self.dense:
            g.recv_off = size
            size += g.nbytes[rank]
        self.send = self.recv = None

    # Message and staging buffers: kept for the layout's life (DDP: allocated once, reused every step)
    # or, with persistent=False (FSDP: memory is the point), allocated per call and dropped after.
    def acquire(self) -> bool:
        """Allocate the buffers if they are not there; returns whether :meth:`release` should follow."""
        if self.send is not None:
            return False
        self._alloc()
        return True

    def _alloc(self) -> None:
        dev, W, r = self.device, self.world_size, self.rank
        self.send = torch.zeros(self.send_size, dtype=torch.uint8, device=dev)
        self.recv = torch.zeros(W * self.my_chunk, dtype=torch.uint8, device=dev)
        for g in self.dense:
            g.acc = torch.empty(g.bounds[r + 1] - g.bounds[r], dtype=torch.float32, device=dev)
            if not g.direct:
                g.x = torch.zeros(g.length, dtype=torch.float32, device=dev)

    def release(self) -> None:
        self.send = self.recv = None
        for g in self.dense:
            g.acc = g.x = None

    def residual_nbytes(self) -> int:
        return sum(g.residual_nbytes() for g in self.dense)

    def commit_residuals(self) -> None:
        """Make the residuals the last encode wrote into the second buffers the current ones (a
        layout with one buffer per residual updates them in place: nothing to do)."""
        for g in self.dense:
            if g.ef and g.res_next is not None:
                g.res_cur, g.res_next = g.res_next, g.res_cur


# Pipelining: a bucket is cut into pieces of about this many gradient elements, each with its own
# all_to_all and all_gather, so that piece k+1 is encoded while piece k is on the wire and piece k-1
# is decoded. 4M elements is 16 MB of fp32 gradient and 2 MB of int4 message (17 ms at 1 Gbit/s); the
# README MLP's 16.8M-element layer becomes 4 pieces. Measured on that MLP (2 ranks on a shared 2-core
# EPYC, load 3; steps alternating between pieces and one piece per bucket in one process): 4M elements
# 1.07-1.11x faster at 1 Gbit/s and 1.00-1.04x with no link limit; 2M elements 1.05-1.08x and
# 0.91-0.96x (with a fast link, the extra collectives' thread hand-offs cost more than they hide).
PIECE_NUMEL = 1 << 22


class _Piece(_Messages):
    """One step of a bucket's pipeline: some of its segments (whole groups, or slices of one large
    group), exchanged by one all_to_all (``send``/``recv``) and one all_gather (``gsend``/``grecv``),
    each message starting with its 64-byte header. The buffers are views of the layout's."""

    def __init__(self, segments: list[_DenseGroup], topk: list[_TopkParam], W: int, rank: int,
                 device: torch.device) -> None:
        self.device = device
        self.dense = segments
        self.topk = topk  # the bucket's top-k messages travel in its last piece's all_gather
        self._plan_all_to_all(W, rank)
        # all_gather message of rank j: [header | reduced segment chunks j | top-k section]
        dense_sizes = []
        for j in range(W):
            size = HEADER
            for g in segments:
                g.gather_off.append(size)
                size += g.nbytes[j]
            dense_sizes.append(size)
        pos = max(dense_sizes)
        for t in topk:
            t.gather_off = pos
            pos += t.nbytes
        self.gather_size = pos
        self.send_starts = [sum(self.split_sizes[:j]) for j in range(W)]
        self.gsend = self.grecv = None
        self.acc_flat: torch.Tensor | None = None
        self.acc_table = 0
        self.tables: dict | None = None  # segment tables by codec, built on first use (_SegmentTables)


def _table_group(g: _DenseGroup) -> bool:
    """Whether a segment can be encoded and decoded through its codec's segment tables (one kernel
    launch for many chunks): a layer whose codec has them (quantize), read from and decoded into an
    fp32 bucket buffer (direct), with fp32 residuals in the layout's flat buffers or none."""
    return (g.codec.segment_tables and g.direct
            and (not g.ef or (g.base.res_off >= 0 and g.base.res_next is not None)))


def piece_slices(length: int, unit: int, piece_numel: int) -> list[tuple[int, int]]:
    """``(start, end)`` of the slices a group of ``length`` elements is cut into for the pipeline:
    the whole group if it is at most ``piece_numel`` long, else near-equal parts on ``unit``
    boundaries (the codec's chunk unit), about ``piece_numel`` each. Tensor-free: the cost model
    prices a bucket with it (:func:`bucket_wire`)."""
    if length <= piece_numel:
        return [(0, length)]
    cuts = chunk_bounds(length, unit, math.ceil(length / piece_numel))
    return [(lo, hi) for lo, hi in zip(cuts[:-1], cuts[1:]) if hi > lo]


def pack_pieces(lengths: Sequence[int], piece_numel: int) -> list[list[int]]:
    """Which segments (by index, in bucket order; ``lengths``: their elements) travel in each piece:
    a piece closes before a segment that would take it past ``piece_numel`` once it holds a quarter
    of that, so a small segment joins its neighbours rather than costing a collective of its own.
    Always at least one piece (a bucket of top-k layers only has an empty one)."""
    runs: list[list[int]] = [[]]
    filled = 0
    for i, n in enumerate(lengths):
        if runs[-1] and filled + n > piece_numel and 4 * filled >= piece_numel:
            runs.append([])
            filled = 0
        runs[-1].append(i)
        filled += n
    return runs


def _segments(g: _DenseGroup, W: int, piece_numel: int) -> list[_DenseGroup]:
    """``g`` itself, or, if it is longer than ``piece_numel``, its slices (:func:`piece_slices`),
    each cut into W chunks. A slice starts on a multiple of the unit (the quantization block) from
    the group's start, so every block holds the same elements as when the group is cut into W chunks
    only: deterministic codecs give the same values either way."""
    if g.length <= piece_numel:
        return [g]
    unit = codecs.chunk_unit(g.cfg)
    out = []
    for lo, hi in piece_slices(g.length, unit, piece_numel):
        bounds = [lo + b for b in chunk_bounds(hi - lo, unit, W)]
        seg = _DenseGroup(g.cfg, g.params, hi - lo, bounds,
                          [codecs.chunk_nbytes(bounds[j + 1] - bounds[j], g.cfg) for j in range(W)],
                          pieces=[], direct=g.direct, parent=g,
                          chunk_base=[g.params[0].boff + bounds[j] for j in range(W)] if g.direct else [])
        out.append(seg)
    return out


def bucket_groups(numels: Sequence[int], planned: Sequence[CodecConfig], world_size: int,
                  dtype: torch.dtype = torch.float32, shapes: Sequence | None = None
                  ) -> tuple[list[CodecConfig], list[tuple[CodecConfig, list[int]]], list[int], bool, list[int]]:
    """How a bucket's parameters (``numels``, in bucket order, each with the codec its plan names,
    ``planned``, and its shape where ``shapes`` gives them) travel at ``world_size``: ``(wire codec per
    parameter, dense groups as (codec, parameter indices), top-k parameter indices, uncompressed,
    low-rank parameter indices)``. Each compressed layer is a group of its own; the uncompressed ones
    (fp32 in the plan, or a top-k or low-rank layer's fp32 fall-back) share one batched group per wire
    codec; low-rank layers are the bucket's low-rank sections (:mod:`fastml_strategy._lowrank`);
    ``uncompressed``: nothing is lossy, so one plain all-reduce does the bucket. Tensor-free: the cost
    model prices a bucket with it (:func:`bucket_wire`)."""
    configs: list[CodecConfig] = []
    dense: dict[tuple, list[int]] = {}
    topk: list[int] = []
    lowrank: list[int] = []
    uncompressed = True
    for i, (n, p) in enumerate(zip(numels, planned)):
        eff = codecs.effective_config(p, n, world_size, None if shapes is None else shapes[i])
        uncompressed = uncompressed and not eff.lossy
        cfg = codecs.wire_config(eff, dtype)
        configs.append(cfg)
        if codecs.codec_for(cfg).lowrank:
            lowrank.append(i)
        elif codecs.is_sparse(cfg):
            topk.append(i)
        elif not eff.lossy:
            dense.setdefault(("batch", cfg), []).append(i)  # uncompressed: one batched segment
        else:
            dense.setdefault((i, cfg), []).append(i)  # one segment per compressed layer
    return configs, [(cfg, idx) for (_, cfg), idx in dense.items()], topk, uncompressed, lowrank


def lowrank_sections(configs: Sequence[CodecConfig], lowrank: Sequence[int], shapes: Sequence
                     ) -> list[tuple[CodecConfig | None, list[int], int, int]]:
    """The low-rank sections of a bucket: ``(factor codec or None for fp32, parameter indices, P
    elements, Q elements)`` per factor codec, in bucket order; each is one P round and one Q round."""
    by: dict = {}
    for i in lowrank:
        codec = codecs.codec_for(configs[i])
        sec = by.setdefault(codec.factor, [codec.factor, [], 0, 0])
        pm, qm = codec.factor_numels(shapes[i])
        sec[1].append(i)
        sec[2] += pm
        sec[3] += qm
    return [tuple(v) for v in by.values()]


def factor_round_bytes(factor: CodecConfig | None, numel: int, world_size: int, rank: int | None = None) -> int:
    """Bytes ``rank`` sends in one factor round of ``numel`` elements, headers included, as
    :class:`fastml_strategy._lowrank.LowRankSection` counts them: a plain fp32 all-reduce, or the
    compressed all-reduce of one tensor in ``factor``."""
    if world_size <= 1:
        return 0
    if factor is None:
        return int(round(2.0 * (world_size - 1) / world_size * numel * 4))
    return bucket_wire((numel,), (factor,), world_size).bytes_sent(rank)


@dataclass(frozen=True)
class PieceWire:
    """What one pipeline piece puts on the wire, without tensors: its all_to_all message to each
    destination (``split_sizes``, headers included) and its all_gather message (``gather_size``:
    the header, the largest reduced chunk, then the bucket's top-k messages in the last piece), and
    which gradient elements it carries (``parts``: (dense group index, elements); ``topk``:
    parameter indices)."""

    split_sizes: tuple[int, ...]
    gather_size: int
    parts: tuple[tuple[int, int], ...]
    topk: tuple[int, ...] = ()

    def all_to_all_bytes(self, rank: int | None = None) -> float:
        """Bytes ``rank`` sends in the piece's all_to_all (None: the mean over ranks)."""
        total = sum(self.split_sizes)
        if rank is None:
            return total * (len(self.split_sizes) - 1) / len(self.split_sizes)
        return total - self.split_sizes[rank]

    def all_gather_bytes(self) -> int:
        """Bytes every rank sends in the piece's all_gather."""
        return (len(self.split_sizes) - 1) * self.gather_size

    def bytes_sent(self, rank: int | None = None) -> float:
        return self.all_to_all_bytes(rank) + self.all_gather_bytes()


@dataclass(frozen=True)
class BucketWire:
    """What one bucket puts on the wire at ``world_size`` (:func:`bucket_wire`): a plain all-reduce
    of ``numel`` elements of ``elem_size`` bytes when ``uncompressed``, else its ``pieces``, issued in
    this order. ``groups``: the parameter indices of each dense group; ``configs``: each parameter's
    wire codec."""

    world_size: int
    numel: int
    elem_size: int
    uncompressed: bool
    configs: tuple[CodecConfig, ...]
    groups: tuple[tuple[int, ...], ...]
    pieces: tuple[PieceWire, ...]
    # the low-rank sections: (factor codec or None for fp32, P elements, Q elements), each two rounds
    lowrank: tuple[tuple[CodecConfig | None, int, int], ...] = ()

    def lowrank_bytes(self, rank: int | None = None) -> int:
        """Bytes ``rank`` sends in the bucket's factor rounds (two per low-rank section)."""
        return sum(factor_round_bytes(f, n, self.world_size, rank) for f, pn, qn in self.lowrank for n in (pn, qn))

    def rounds(self) -> int:
        """The bucket's collectives that wait for each other (latency rounds): two per piece (one
        for a plain bucket), plus two per low-rank section (four with compressed factors)."""
        if self.uncompressed:
            return 1
        return 2 * len(self.pieces) + sum(2 if f is None else 4 for f, _, _ in self.lowrank)

    def bytes_sent(self, rank: int | None = None) -> int:
        """Bytes ``rank`` sends for this bucket per step, headers included, as
        :attr:`fastml_strategy.collective.CompressedAllReduce.bytes_sent` counts them (None: the
        mean over ranks, rounded)."""
        W = self.world_size
        if W <= 1:
            return 0
        if self.uncompressed:
            return int(round(2.0 * (W - 1) / W * self.numel * self.elem_size))
        return int(round(sum(p.bytes_sent(rank) for p in self.pieces))) + self.lowrank_bytes(rank)


@functools.lru_cache(maxsize=65536)
def bucket_wire(numels: tuple[int, ...], planned: tuple[CodecConfig, ...], world_size: int,
                dtype: torch.dtype = torch.float32, piece_numel: int = PIECE_NUMEL,
                shapes: tuple | None = None) -> BucketWire:
    """The messages :class:`BucketLayout` builds for a bucket of parameters of ``numels`` elements
    (bucket order) whose plan names ``planned``, at ``world_size`` ranks, without allocating a
    tensor: the same grouping (:func:`bucket_groups`), chunking (:func:`chunk_bounds`), slicing
    (:func:`piece_slices`), packing (:func:`pack_pieces`), codec sizes
    (:func:`fastml_strategy.codecs.chunk_nbytes`) and :data:`HEADER` per message. The autotuner's
    cost model prices a DDP bucket with it (cached: a search asks for the same buckets again).
    ``shapes``: the parameters' shapes (what a low-rank layer's factors are sized by; None: flat)."""
    W = world_size
    cfgs, groups, topk, uncompressed, lowrank = bucket_groups(numels, planned, W, dtype, shapes)
    elem = torch.empty(0, dtype=dtype).element_size()
    piece_numel = max(1, int(piece_numel))
    segs: list[tuple[int, int, list[int]]] = []  # (group index, elements, bytes of chunk j)
    for gi, (cfg, idx) in enumerate(groups):
        unit = codecs.chunk_unit(cfg)
        length = sum(numels[i] for i in idx)
        nbytes: dict[int, int] = {}  # chunks of a slice take one or two sizes: encode each once
        for lo, hi in piece_slices(length, unit, piece_numel):
            b = chunk_bounds(hi - lo, unit, W)
            sizes = [nbytes.get(n) or nbytes.setdefault(n, codecs.chunk_nbytes(n, cfg))
                     for n in map(operator.sub, b[1:], b[:-1])]
            segs.append((gi, hi - lo, sizes))
    runs = pack_pieces([n for _, n, _ in segs], piece_numel)
    pieces = []
    for k, run in enumerate(runs):
        sizes = [HEADER] * W
        for i in run:
            sizes = list(map(operator.add, sizes, segs[i][2]))
        last = k == len(runs) - 1
        top = tuple(topk) if last else ()
        gather = max(sizes) + sum(codecs.chunk_nbytes(numels[i], cfgs[i]) for i in top)
        pieces.append(PieceWire(tuple(sizes), gather, tuple((segs[i][0], segs[i][1]) for i in run), top))
    sections = tuple((f, pn, qn) for f, _, pn, qn in lowrank_sections(cfgs, lowrank, shapes)) if lowrank else ()
    return BucketWire(W, int(sum(numels)), elem, uncompressed, tuple(cfgs),
                      tuple(tuple(idx) for _, idx in groups), tuple(pieces), sections)


class BucketLayout(_Messages):
    """How one bucket's parameters map to groups, pipeline pieces, chunks and message offsets (built
    once per bucket shape; DDP's bucket rebuild after iteration 1 builds a new one).

    ``dense``: the groups (one per compressed layer, one batched group of the uncompressed tensors),
    which own the residuals; ``pieces``: the pipeline (:class:`_Piece`), in the order every rank
    issues their collectives."""

    def __init__(self, names, offsets, numels, plan: Plan, world_size: int, rank: int,
                 device: torch.device, dtype: torch.dtype = torch.float32,
                 double_buffer: bool = True, persistent: bool = True,
                 plan_numels: Sequence[int] | None = None, piece_numel: int = PIECE_NUMEL,
                 shapes: Sequence | None = None, q_store: dict | None = None) -> None:
        self.device = device
        self.names = tuple(names)
        self.total_numel = int(sum(numels))
        self.world_size, self.rank = world_size, rank
        # plan_numels: the parameters' own sizes, when the bucket holds only a shard of them (HSDP):
        # whether a tensor is small enough to travel uncompressed is a property of the parameter.
        planned = [plan.for_parameter(name, pn) for name, pn in zip(names, plan_numels or numels)]
        cfgs, groups, topk, self.uncompressed, lowrank = bucket_groups(numels, planned, world_size, dtype, shapes)
        self.configs = dict(zip(self.names, cfgs))
        self.shapes = {} if shapes is None else dict(zip(self.names, (tuple(s) for s in shapes)))
        params = [_Param(name, int(off), int(n)) for name, off, n in zip(names, offsets, numels)]
        # the low-rank sections (one P and one Q round each) and the warm starts Q they keep, by name
        self.q_store = {} if q_store is None else q_store
        self.lowrank = self._lowrank_sections(cfgs, lowrank, shapes, params) if lowrank else []
        self.topk = [_TopkParam(cfgs[i], params[i], codecs.chunk_nbytes(params[i].numel, cfgs[i])) for i in topk]
        self.dense = [self._group(cfg, [params[i] for i in idx], dtype == torch.float32) for cfg, idx in groups]
        self._alloc_residuals(double_buffer)
        self.pieces = self._pipeline(piece_numel)
        self.send = self.recv = self.gsend = self.grecv = None
        self.topk_acc: dict[str, torch.Tensor] = {}
        if persistent and not self.uncompressed:
            self._alloc()

    def _lowrank_sections(self, cfgs, lowrank, shapes, params) -> list:
        from fastml_strategy._lowrank import LowRankSection, _LowRankParam, matrix_shape

        out = []
        for factor, idx, _, _ in lowrank_sections(cfgs, lowrank, shapes):
            lps = [_LowRankParam(params[i].name, params[i].boff, params[i].numel, *matrix_shape(shapes[i]),
                                 cfgs[i].rank, cfgs[i]) for i in idx]
            out.append(LowRankSection(lps, factor, self.device, self.world_size, self.rank, type(self)))
        return out

    def _group(self, cfg: CodecConfig, params: list[_Param], fp32_buffer: bool) -> _DenseGroup:
        """The group of ``params`` (one compressed layer, or the batched uncompressed tensors), cut
        into W chunks on its codec's unit; read straight from the buffer when it is one fp32 layer."""
        W = self.world_size
        pos = 0
        for p in params:
            p.goff = pos
            pos += p.numel
        bounds = chunk_bounds(pos, codecs.chunk_unit(cfg), W)
        nbytes = [codecs.chunk_nbytes(bounds[j + 1] - bounds[j], cfg) for j in range(W)]
        direct = fp32_buffer and len(params) == 1
        return _DenseGroup(cfg, params, pos, bounds, nbytes,
                           pieces=[(p.boff, p.goff, p.numel) for p in params], direct=direct,
                           chunk_base=[params[0].boff + bounds[j] for j in range(W)] if direct else [])

    def _alloc_residuals(self, double_buffer: bool) -> None:
        """The residuals: fp32 ones of a double-buffered layout are views of two flat buffers, swapped
        together at commit, so that one kernel launch (a segment table) reaches every layer's."""
        device = self.device
        self.res_flat: list[torch.Tensor] | None = None
        flat = [g for g in self.dense if g.ef and double_buffer and g.cfg.residual_torch_dtype == torch.float32]
        if flat:
            total = sum(g.length for g in flat)
            self.res_flat = [torch.zeros(total, dtype=torch.float32, device=device) for _ in range(2)]
            pos = 0
            for g in flat:
                g.res_off = pos
                g.res_cur, g.res_next = (t[pos: pos + g.length] for t in self.res_flat)
                pos += g.length
        for g in self.dense:
            if g.res_off < 0:
                g.alloc_residual(device, double_buffer)
        for t in self.topk:
            t.residual = torch.zeros(t.param.numel, dtype=t.cfg.residual_torch_dtype, device=device)

    def _pipeline(self, piece_numel: int) -> list[_Piece]:
        """The pieces: segments in bucket order (:func:`piece_slices`), packed into pieces of about
        ``piece_numel`` elements (:func:`pack_pieces`); the bucket's top-k messages travel in the
        last piece's all_gather."""
        piece_numel = max(1, int(piece_numel))
        segs = [seg for g in self.dense for seg in _segments(g, self.world_size, piece_numel)]
        runs = [[segs[i] for i in run] for run in pack_pieces([seg.length for seg in segs], piece_numel)]
        return [_Piece(segs, self.topk if i == len(runs) - 1 else [], self.world_size, self.rank, self.device)
                for i, segs in enumerate(runs)]

    @property
    def segments(self) -> list[_DenseGroup]:
        return [g for piece in self.pieces for g in piece.dense]

    def _alloc(self) -> None:
        # One buffer per kind for the whole bucket; each piece's messages are views of it.
        dev, W, r = self.device, self.world_size, self.rank
        sizes = [(p.send_size, W * p.my_chunk, p.gather_size, W * p.gather_size) for p in self.pieces]
        self.send, self.recv, self.gsend, self.grecv = (
            torch.zeros(sum(s[i] for s in sizes), dtype=torch.uint8, device=dev) for i in range(4))
        pos = [0, 0, 0, 0]
        for p, size in zip(self.pieces, sizes):
            p.send, p.recv, p.gsend, p.grecv = (
                whole[pos[i]: pos[i] + size[i]] for i, whole in
                enumerate((self.send, self.recv, self.gsend, self.grecv)))
            pos = [a + b for a, b in zip(pos, size)]
            # this rank's chunk sums of the piece: one buffer, segment-table groups first
            order = sorted(p.dense, key=lambda g: not _table_group(g))
            p.acc_flat = torch.empty(sum(g.bounds[r + 1] - g.bounds[r] for g in order),
                                     dtype=torch.float32, device=dev)
            p.acc_table = 0
            at = 0
            for g in order:
                n = g.bounds[r + 1] - g.bounds[r]
                g.acc, g.acc_off = p.acc_flat[at: at + n], at
                at += n
                if _table_group(g):
                    p.acc_table = at
        for g in self.dense:
            if not g.direct:
                g.x = torch.zeros(g.length, dtype=torch.float32, device=dev)
        self.topk_acc = {t.param.name: torch.empty(t.param.numel, dtype=torch.float32, device=dev)
                         for t in self.topk}

    def release(self) -> None:
        self.send = self.recv = self.gsend = self.grecv = None
        for p in self.pieces:
            p.send = p.recv = p.gsend = p.grecv = p.acc_flat = None
            for g in p.dense:
                g.acc = None
        for g in self.dense:
            g.x = None
        self.topk_acc = {}

    # residual views by parameter name (unpadded)
    def residual_views(self) -> dict[str, torch.Tensor]:
        out = {}
        for g in self.dense:
            if g.ef:
                for p in g.params:
                    out[p.name] = g.res_cur[p.goff: p.goff + p.numel]
        for t in self.topk:
            if t.cfg.uses_residual:
                out[t.param.name] = t.residual
        for sec in self.lowrank:
            out.update(sec.residual_views())
        return out

    def residual_nbytes(self) -> int:
        return super().residual_nbytes() + sum(
            t.residual.numel() * t.residual.element_size() for t in self.topk if t.cfg.uses_residual) + sum(
            sec.residual_nbytes() for sec in self.lowrank)

    def commit_residuals(self) -> None:
        super().commit_residuals()
        for sec in self.lowrank:
            sec.commit(self.q_store)
        if self.res_flat:
            self.res_flat.reverse()
        for t in self.topk:
            if t.cfg.uses_residual and t.pending is not None:
                if t.residual.dtype == t.pending.dtype:
                    t.residual, t.pending = t.pending, None  # a fresh tensor (TopkCodec.encode_rest): no copy
                else:
                    t.residual.copy_(t.pending)
                    t.pending = None

    def layer_rows(self, world_size: int, rank: int) -> dict[str, tuple[CodecConfig, int, int]]:
        """name -> (codec, elements, bytes this rank sends per step)."""
        numel = {p.name: p.numel for g in self.dense for p in g.params}
        numel.update({t.param.name: t.param.numel for t in self.topk})
        for sec in self.lowrank:
            numel.update({p.name: p.numel for p in sec.params})
        return {n: (cfg, numel[n], codecs.wire_bytes(numel[n], cfg, world_size, self.shapes.get(n)))
                for n, cfg in self.configs.items()}


@dataclass(frozen=True)
class ShardedTensor:
    """One gradient in a reduce-scatter input: ``chunk_numels[j]`` real elements in row j, padded to
    ``padded`` elements (FSDP2 pads each parameter's dim-0 chunks to equal size)."""

    name: str
    chunk_numels: tuple[int, ...]
    padded: int

    @property
    def numel(self) -> int:
        return sum(self.chunk_numels)


class ShardLayout(_Messages):
    """The compressed reduce-scatter of one flat input of W equal rows (FSDP2's layout): row j is the
    concatenation, over ``tensors`` in order, of each tensor's chunk j padded to its ``padded`` size.
    Rank r receives the sum of rows r into an output of one row's size (padding zero).

    Each compressed tensor is a group of its own whose chunk j is read straight from row j; the
    uncompressed ones are gathered into one batched group. Residuals cover the tensor's real elements
    of every row (the unsharded gradient), updated in place (one buffer)."""

    def __init__(self, tensors: Sequence[ShardedTensor], plan: Plan, world_size: int, rank: int,
                 device: torch.device, dtype: torch.dtype = torch.float32) -> None:
        W = world_size
        self.device = device
        self.tensors = tuple(tensors)
        self.names = tuple(t.name for t in self.tensors)
        self.row_numel = sum(t.padded for t in self.tensors)
        self.input_numel = W * self.row_numel
        self.dtype = dtype
        self.configs: dict[str, CodecConfig] = {}
        offsets, pos = {}, 0
        for t in self.tensors:
            if len(t.chunk_numels) != W or any(n < 0 or n > t.padded for n in t.chunk_numels):
                raise ValueError(f"ShardLayout: {t.name}: chunk sizes {t.chunk_numels} do not fit "
                                 f"{W} rows of {t.padded} elements")
            offsets[t.name] = pos
            pos += t.padded
        batched: list[ShardedTensor] = []
        self.dense: list[_DenseGroup] = []
        for t in self.tensors:
            planned = plan.for_parameter(t.name, t.numel)
            cfg = codecs.wire_config(planned, dtype)
            self.configs[t.name] = cfg
            if not planned.lossy:
                batched.append(t)
                continue
            bounds = [0]
            for n in t.chunk_numels:
                bounds.append(bounds[-1] + n)
            g = _DenseGroup(cfg, [_Param(t.name, -1, t.numel)], t.numel, bounds,
                            [codecs.chunk_nbytes(n, cfg) for n in t.chunk_numels],
                            pieces=[], direct=True,
                            chunk_base=[j * self.row_numel + offsets[t.name] for j in range(W)])
            g.alloc_residual(device, double_buffer=False)
            g.out_pieces = [(offsets[t.name], 0, t.chunk_numels[rank])]
            self.dense.append(g)
        if batched:
            cfg = codecs.wire_config(RECIPES["none"], dtype)
            params = [_Param(t.name, -1, t.numel) for t in batched]
            pieces, bounds, out_pieces, goff = [], [0], [], 0
            for j in range(W):  # chunk-major: chunk j of the group is every tensor's chunk j
                for t in batched:
                    n = t.chunk_numels[j]
                    pieces.append((j * self.row_numel + offsets[t.name], goff, n))
                    if j == rank:
                        out_pieces.append((offsets[t.name], goff - bounds[-1], n))
                    goff += n
                bounds.append(goff)
            g = _DenseGroup(cfg, params, goff, bounds,
                            [codecs.chunk_nbytes(bounds[j + 1] - bounds[j], cfg) for j in range(W)],
                            pieces=pieces)
            g.out_pieces = out_pieces
            self.dense.append(g)
        # the output's padding: zero, as in FSDP's own reduce-scatter of zero-padded rows
        self.padding = [(offsets[t.name] + t.chunk_numels[rank], t.padded - t.chunk_numels[rank])
                        for t in self.tensors if t.padded > t.chunk_numels[rank]]
        self._plan_all_to_all(W, rank)  # buffers: allocated per call (acquire/release)
        # bytes the uncompressed reduce-scatter would send from this rank (in the input's dtype)
        self.baseline_bytes = (W - 1) * self.row_numel * torch.empty(0, dtype=dtype).element_size()

    def residual_views(self) -> dict[str, torch.Tensor]:
        return {g.params[0].name: g.res_cur for g in self.dense if g.ef}

    def layer_rows(self, world_size: int, rank: int) -> dict[str, tuple[CodecConfig, int, int]]:
        by_name = {t.name: t for t in self.tensors}
        return {n: (cfg, by_name[n].numel,
                    codecs.reduce_scatter_bytes(list(by_name[n].chunk_numels), cfg, rank))
                for n, cfg in self.configs.items()}
