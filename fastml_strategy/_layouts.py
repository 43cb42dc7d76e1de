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

import math
import zlib
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from fastml_strategy import codecs
from fastml_strategy._status import HEADER
from fastml_strategy.config import RECIPES, CodecConfig, Plan

__all__ = ["BucketLayout", "ShardLayout", "ShardedTensor", "PIECE_NUMEL", "chunk_bounds"]

def layer_key(name: str) -> int:
    """A seed component that depends on the layer, not on its position in a bucket (buckets are
    rebuilt after the first iteration; stochastic rounding must not change with them)."""
    return zlib.crc32(name.encode())


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


def _segments(g: _DenseGroup, W: int, piece_numel: int) -> list[_DenseGroup]:
    """``g`` itself, or, if it is longer than ``piece_numel``, its slices: near-equal parts on chunk
    unit boundaries, each cut into W chunks. A slice starts on a multiple of the unit (the
    quantization block) from the group's start, so every block holds the same elements as when the
    group is cut into W chunks only: deterministic codecs give the same values either way."""
    if g.length <= piece_numel:
        return [g]
    unit = codecs.chunk_unit(g.cfg)
    cuts = chunk_bounds(g.length, unit, math.ceil(g.length / piece_numel))
    out = []
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        if hi <= lo:
            continue
        bounds = [lo + b for b in chunk_bounds(hi - lo, unit, W)]
        seg = _DenseGroup(g.cfg, g.params, hi - lo, bounds,
                          [codecs.chunk_nbytes(bounds[j + 1] - bounds[j], g.cfg) for j in range(W)],
                          pieces=[], direct=g.direct, parent=g,
                          chunk_base=[g.params[0].boff + bounds[j] for j in range(W)] if g.direct else [])
        out.append(seg)
    return out


class BucketLayout(_Messages):
    """How one bucket's parameters map to groups, pipeline pieces, chunks and message offsets (built
    once per bucket shape; DDP's bucket rebuild after iteration 1 builds a new one).

    ``dense``: the groups (one per compressed layer, one batched group of the uncompressed tensors),
    which own the residuals; ``pieces``: the pipeline (:class:`_Piece`), in the order every rank
    issues their collectives."""

    def __init__(self, names, offsets, numels, plan: Plan, world_size: int, rank: int,
                 device: torch.device, dtype: torch.dtype = torch.float32,
                 double_buffer: bool = True, persistent: bool = True,
                 plan_numels: Sequence[int] | None = None, piece_numel: int = PIECE_NUMEL) -> None:
        self.device = device
        self.names = tuple(names)
        self.total_numel = int(sum(numels))
        self.world_size, self.rank = world_size, rank
        self.topk: list[_TopkParam] = []
        self.configs: dict[str, CodecConfig] = {}
        # plan_numels: the parameters' own sizes, when the bucket holds only a shard of them (HSDP):
        # whether a tensor is small enough to travel uncompressed is a property of the parameter.
        self.uncompressed = True  # every tensor fp32 in the plan: a plain all-reduce does it
        dense: dict[tuple, list[_Param]] = {}
        for name, off, n, pn in zip(names, offsets, numels, plan_numels or numels):
            planned = codecs.effective_config(plan.for_parameter(name, pn), n, world_size)
            self.uncompressed = self.uncompressed and not planned.lossy
            cfg = codecs.wire_config(planned, dtype)
            self.configs[name] = cfg
            p = _Param(name, int(off), int(n))
            if codecs.is_sparse(cfg):
                self.topk.append(_TopkParam(cfg, p, codecs.chunk_nbytes(n, cfg)))
            elif not planned.lossy:
                dense.setdefault(("batch", cfg), []).append(p)  # uncompressed: one batched segment
            else:
                dense.setdefault((name, cfg), []).append(p)  # one segment per compressed layer
        self.dense = [self._group(cfg, params, dtype == torch.float32) for (_, cfg), params in dense.items()]
        self._alloc_residuals(double_buffer)
        self.pieces = self._pipeline(max(1, int(piece_numel)))
        self.send = self.recv = self.gsend = self.grecv = None
        self.topk_acc: dict[str, torch.Tensor] = {}
        if persistent and not self.uncompressed:
            self._alloc()

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
        """The pieces: segments in bucket order, packed into pieces of about ``piece_numel`` elements
        (a small segment joins its neighbours rather than costing a collective of its own); the
        bucket's top-k messages travel in the last piece's all_gather."""
        runs: list[list[_DenseGroup]] = [[]]
        filled = 0
        for g in self.dense:
            for seg in _segments(g, self.world_size, piece_numel):
                if runs[-1] and filled + seg.length > piece_numel and 4 * filled >= piece_numel:
                    runs.append([])
                    filled = 0
                runs[-1].append(seg)
                filled += seg.length
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
        return out

    def residual_nbytes(self) -> int:
        return super().residual_nbytes() + sum(
            t.residual.numel() * t.residual.element_size() for t in self.topk if t.cfg.uses_residual)

    def commit_residuals(self) -> None:
        super().commit_residuals()
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
        return {n: (cfg, numel[n], codecs.wire_bytes(numel[n], cfg, world_size))
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
