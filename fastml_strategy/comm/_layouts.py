"""Where every chunk of a compressed collective lies: the layouts of a DDP bucket (all-reduce) and of an
FSDP unit (reduce-scatter), built once per shape and kept by the engine's
:class:`~fastml_strategy.comm._residuals.ResidualStore` with the error-feedback residuals they own.

A layout splits its gradients by parameter into *groups* (:class:`_DenseGroup`: one per compressed
layer, whose codec comes from the plan, and one batched group of the uncompressed tensors; top-k layers
are :class:`_TopkParam`), cuts each group into W chunks on codec-unit boundaries (a quantization block
never spans two chunks, so it never mixes two ranks' scales) and places every chunk in the messages:
for destination j, ``[header | group 0 chunk j | group 1 chunk j | ...]`` (:class:`_Messages`). A
bucket is also cut into pipeline pieces (:class:`_Piece`, :data:`PIECE_NUMEL`), each with its own
all_to_all and all_gather messages.

Every boundary, size and offset comes from :mod:`fastml_strategy.wire` (:func:`~fastml_strategy.wire.bucket_wire`,
:func:`~fastml_strategy.wire.shard_wire`), the tensor-free layouts the autotuner's cost model prices
too; this module only turns them into tensor views, buffers and residuals.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from fastml_strategy import codecs
from fastml_strategy.config import CodecConfig, Plan
import fastml_strategy.wire.bucket as _wire
from fastml_strategy.wire.bucket import BucketWire, PieceWire, pack_pieces, piece_slices  # noqa: F401
from fastml_strategy.wire.messages import PIECE_NUMEL, chunk_bounds, layer_key, message_offsets  # noqa: F401
from fastml_strategy.wire.shard import shard_wire

__all__ = ["BucketLayout", "ShardLayout", "ShardedTensor", "PIECE_NUMEL", "chunk_bounds", "part_bounds_of",
           "bucket_groups", "piece_slices", "pack_pieces", "BucketWire", "PieceWire", "bucket_wire", "layer_key"]


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



def part_bounds_of(cfg: CodecConfig, numel: int, parts: int) -> list[int]:
    """:func:`fastml_strategy.wire.part_bounds_of` with this registry's codecs."""
    return _wire.part_bounds_of(codecs, cfg, numel, parts)


def bucket_groups(numels, planned, world_size: int, dtype: torch.dtype = torch.float32, shapes=None):
    """:func:`fastml_strategy.wire.bucket_groups` with this registry's codecs."""
    return _wire.bucket_groups(codecs, numels, planned, world_size, dtype, shapes)


def bucket_wire(numels, planned, world_size: int, dtype: torch.dtype = torch.float32,
                piece_numel: int = PIECE_NUMEL, shapes=None) -> BucketWire:
    """:func:`fastml_strategy.wire.bucket_wire` with this registry's codecs: the layout
    :class:`BucketLayout` is built from."""
    return _wire.bucket_wire(codecs, tuple(int(n) for n in numels), tuple(planned), world_size, dtype,
                             piece_numel, None if shapes is None else tuple(tuple(x) for x in shapes))


class _Messages:
    """The all_to_all message of a layout's dense groups: for destination j,
    ``[header | group 0 chunk j | group 1 chunk j | ...]``."""

    dense: list[_DenseGroup]

    def _plan_all_to_all(self, W: int, rank: int, sizes: Sequence[int], offsets: Sequence[Sequence[int]]) -> None:
        """Place the groups in the messages of :func:`fastml_strategy.wire.message_offsets`: message j
        (``sizes[j]`` bytes) to rank j, group g's chunk j at ``offsets[g][j]`` in it."""
        self.world_size, self.rank = W, rank
        self.split_sizes = list(sizes)
        self.send_starts = [0]
        for n in self.split_sizes[:-1]:
            self.send_starts.append(self.send_starts[-1] + n)
        for g, off in zip(self.dense, offsets):
            g.send_off = [start + o for start, o in zip(self.send_starts, off)]
            g.recv_off = off[rank]
        self.send_size = sum(self.split_sizes)
        self.my_chunk = self.split_sizes[rank]
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


class _Piece(_Messages):
    """One step of a bucket's pipeline: some of its segments (whole groups, or slices of one large
    group), exchanged by one all_to_all (``send``/``recv``) and one all_gather (``gsend``/``grecv``),
    each message starting with its 64-byte header. The buffers are views of the layout's."""

    def __init__(self, wire: PieceWire, segments: list[_DenseGroup], topk: list[_TopkParam], W: int, rank: int,
                 device: torch.device) -> None:
        self.device = device
        self.dense = segments
        self.topk = topk  # the bucket's top-k messages travel in its last piece's all_gather
        self._plan_all_to_all(W, rank, wire.split_sizes, wire.offsets)
        # all_gather message of rank j: [header | reduced segment chunks j | top-k section], the
        # chunks at the all_to_all's offsets
        for g, off in zip(segments, wire.offsets):
            g.gather_off = list(off)
        for t, off in zip(topk, wire.topk_offsets):
            t.gather_off = off
        self.gather_size = wire.gather_size
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
        self.wire = wire = bucket_wire(numels, planned, world_size, dtype, piece_numel, shapes)
        self.uncompressed = wire.uncompressed
        cfgs = wire.configs
        self.configs = dict(zip(self.names, cfgs))
        self.shapes = {} if shapes is None else dict(zip(self.names, (tuple(s) for s in shapes)))
        params = [_Param(name, int(off), int(n)) for name, off, n in zip(names, offsets, numels)]
        # the low-rank sections (one P and one Q round each) and the warm starts Q they keep, by name
        self.q_store = {} if q_store is None else q_store
        self.lowrank = self._lowrank_sections(cfgs, wire, shapes, params) if wire.lowrank else []
        self.topk = [_TopkParam(cfgs[i], params[i], nb) for i, nb in zip(wire.topk, wire.topk_nbytes)]
        self.dense = [self._group(gw, [params[i] for i in gw.params], dtype == torch.float32) for gw in wire.dense]
        self._alloc_residuals(double_buffer)
        self.pieces = self._pipeline()
        self.send = self.recv = self.gsend = self.grecv = None
        self.topk_acc: dict[str, torch.Tensor] = {}
        if persistent and not self.uncompressed:
            self._alloc()

    def _lowrank_sections(self, cfgs, wire: BucketWire, shapes, params) -> list:
        from fastml_strategy.comm._lowrank import LowRankSection, _LowRankParam, matrix_shape

        out = []
        for (factor, _, _), idx, (start, _) in zip(wire.lowrank, wire.lowrank_params, wire.lowrank_start):
            lps = [_LowRankParam(params[i].name, params[i].boff, params[i].numel, *matrix_shape(shapes[i]),
                                 cfgs[i].rank, cfgs[i]) for i in idx]
            out.append(LowRankSection(lps, factor, self.device, self.world_size, self.rank, type(self),
                                      start=start))
        return out

    def _group(self, gw: _wire.GroupWire, params: list[_Param], fp32_buffer: bool) -> _DenseGroup:
        """The group of ``params`` (one compressed layer, or the batched uncompressed tensors) as the
        wire lays it out; read straight from the buffer when it is one fp32 layer."""
        for p, goff in zip(params, gw.offsets):
            p.goff = goff
        direct = fp32_buffer and len(params) == 1
        return _DenseGroup(gw.config, params, gw.length, list(gw.bounds), list(gw.nbytes),
                           pieces=[(p.boff, p.goff, p.numel) for p in params], direct=direct,
                           chunk_base=[params[0].boff + b for b in gw.bounds[:-1]] if direct else [])

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

    def _pipeline(self) -> list[_Piece]:
        """The pieces of the wire (:class:`fastml_strategy.wire.PieceWire`): its segments, each a
        group or a slice of one (:meth:`_segment`); the bucket's top-k messages travel in the last
        piece's all_gather."""
        segs = [self._segment(sw) for sw in self.wire.segments]
        n = len(self.wire.pieces)
        return [_Piece(pw, [segs[i] for i in pw.segments], self.topk if k == n - 1 else [], self.world_size,
                       self.rank, self.device) for k, pw in enumerate(self.wire.pieces)]

    def _segment(self, sw: _wire.SegmentWire) -> _DenseGroup:
        """A pipeline segment: the group itself, or a slice of it whose chunks lie at the wire's
        bounds in the group's flat vector (the group keeps the staging vector and the residuals)."""
        g = self.dense[sw.group]
        if sw.whole:
            return g
        return _DenseGroup(g.cfg, g.params, sw.length, list(sw.bounds), list(sw.nbytes), pieces=[],
                           direct=g.direct, parent=g,
                           chunk_base=[g.params[0].boff + b for b in sw.bounds[:-1]] if g.direct else [])

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
        self.dtype = dtype
        self.wire = wire = shard_wire(codecs, [t.chunk_numels for t in self.tensors], [t.padded for t in self.tensors],
                                      [plan.for_parameter(t.name, t.numel) for t in self.tensors], W, dtype,
                                      names=self.names)
        self.row_numel = wire.row_numel
        self.input_numel = W * self.row_numel
        self.configs: dict[str, CodecConfig] = dict(zip(self.names, wire.configs))
        self.dense: list[_DenseGroup] = []
        for gi, gw in enumerate(wire.groups):
            params = [_Param(self.tensors[t].name, -1, self.tensors[t].numel) for t in gw.tensors]
            if gw.batched:  # gathered from the rows into a flat vector, chunk-major
                g = _DenseGroup(gw.config, params, gw.length, list(gw.bounds), list(gw.nbytes),
                                pieces=[(off, goff, n) for _, off, goff, n in gw.pieces])
            else:  # chunk j read straight from row j
                g = _DenseGroup(gw.config, params, gw.length, list(gw.bounds), list(gw.nbytes), pieces=[],
                                direct=True, chunk_base=[off for _, off, _, _ in gw.pieces])
                g.alloc_residual(device, double_buffer=False)
            g.out_pieces = wire.out_pieces(gi, rank)
            self.dense.append(g)
        # the output's padding: zero, as in FSDP's own reduce-scatter of zero-padded rows
        self.padding = wire.padding(rank)
        self._plan_all_to_all(W, rank, wire.split_sizes, wire.offsets_in)  # buffers: per call (acquire/release)
        # bytes the uncompressed reduce-scatter would send from this rank (in the input's dtype)
        self.baseline_bytes = wire.baseline_bytes()

    def residual_views(self) -> dict[str, torch.Tensor]:
        return {g.params[0].name: g.res_cur for g in self.dense if g.ef}

    def layer_rows(self, world_size: int, rank: int) -> dict[str, tuple[CodecConfig, int, int]]:
        by_name = {t.name: t for t in self.tensors}
        return {n: (cfg, by_name[n].numel,
                    codecs.reduce_scatter_bytes(list(by_name[n].chunk_numels), cfg, rank))
                for n, cfg in self.configs.items()}
