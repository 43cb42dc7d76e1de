"""FastML's compressed collectives: the all-reduce of one DDP bucket (scatter-reduce-allgather for
dense codecs, all_gather for top-k, two collectives per bucket in a fixed order) and, as its first
half, the reduce-scatter of one FSDP unit (one all_to_all).

Algorithm (per bucket, on every rank; W ranks, this one ``r``)
--------------------------------------------------------------
1. Split the bucket by parameter (``BucketLayout``). Each compressed layer (fp16 / bf16 / quantize)
   is a segment of its own, encoded straight from the bucket buffer and decoded straight back into
   it (no gather or scatter copies when the buffer is fp32), cut into W chunks on quantization-block
   boundaries, so a block never mixes two layers' scales. Small tensors (under ``plan.min_numel``)
   and fp32 layers are gathered into one fp32 segment: one message part for all of them.
2. Error feedback: the quantizer reads ``grad + residual`` and writes the new residual into a second
   buffer; the two are swapped only when the result is finite. The hook commits a whole step at once:
   a NaN/inf in any bucket, which makes GradScaler skip the step, leaves every residual untouched.
   Residuals are keyed by parameter name and migrate when DDP rebuilds its buckets after the first
   iteration.
3. ``all_to_all_single``: rank j receives every rank's encoded chunk j. Each rank decodes the W copies
   of its chunk in rank order, sums them in fp32, divides by W, and re-encodes the mean.
4. ``all_gather`` of [the re-encoded mean chunk | this rank's top-k values and indices]. Every rank,
   the chunk's owner included, decodes the same bytes in the same order, so replicas stay
   bit-identical. Top-k messages are scatter-added in rank order, then divided by W.

Pipelining (:class:`BucketLayout` ``pieces``): steps 3 and 4 run per piece of about
:data:`PIECE_NUMEL` elements, not per bucket. A group longer than that is cut into slices on
quantization-block boundaries, each slice into W chunks of its own; small groups share a piece. Every
rank issues the pieces' collectives asynchronously in one fixed order (all_to_all 0, all_to_all 1,
all_gather 0, all_to_all 2, all_gather 1, ...), so that while piece k is on the wire, piece k+1 is
encoded and piece k-1 decoded. Every block holds the same elements as without pieces, and each
element is summed over the ranks in the same order, so a deterministic codec gives bit for bit the
result of one piece (stochastic rounding draws other, equally distributed numbers for a slice).
Across buckets (:meth:`CompressedAllReduce.start`): the DDP hook holds a bucket's tail (the wait for
its last all_gather and that piece's decode, no collective) until the next queued bucket's first
all_to_all is on the wire, so the wire does not idle while one bucket is decoded and the next encoded.

Segment tables (:class:`_SegmentTables`, on CUDA with the Triton backend; ``segment_tables``): the
quantized layers of a piece that read from and decode into an fp32 bucket buffer are encoded (with
error feedback), summed (the W copies of this rank's chunks), re-encoded and decoded by one Triton
launch per stage and codec config, each program reading one row of a table built once per layout,
instead of one launch per chunk and layer. Their residuals are views of two flat buffers of the
layout (swapped together at commit), their chunk sums of one buffer per piece. Same bytes as the
per-chunk path (tests/test_segment_tables_dist.py).

Per-rank traffic of a dense codec is 2(W-1)/W of its encoded size, as for a ring all-reduce; a top-k
layer costs (W-1) messages, which is why :func:`fastml_strategy.codecs.effective_config` falls back to
a dense codec past the world size where that stops paying.

Reduce-scatter (:class:`ShardLayout`, :meth:`CompressedAllReduce.reduce_scatter`): the input holds W
rows, row j the part of every gradient that rank j owns (FSDP2's layout). Step 3 alone does it: each
rank encodes row j (per parameter, with its codec and error feedback; top-k too, since nothing is
re-encoded), one all_to_all, and rank j decodes and sums the W copies of row j into its output. No
re-encoding, so no second collective, and no replicas to keep identical (each rank owns its shard).
Per-rank traffic: (W-1)/W of the compressed size. The error-feedback residual of a rank covers every
row it sends, i.e. the unsharded gradient.

Every message starts with a 64-byte header. A rank whose encoder raises still takes part in the
collective with an error header, so every rank (that one included) raises the same
:class:`CompressionError`, naming the lowest failing rank, instead of hanging. In a pipelined bucket
a failing rank sends error headers for the rest of the bucket and every rank completes every
collective of the bucket before raising, so none is left pending.

Host reads (issue 10): nothing on the wire path reads a tensor's value on the host per chunk, piece or
bucket. The headers every rank received, the finiteness of every decoded result and this rank's own
errors are collected on the device (:class:`StepChecks`) and resolved in one host read
(:meth:`CompressedAllReduce.finish`, through :func:`_host`, which counts them: :func:`host_reads`):
per bucket for a caller that passes no checks (FSDP, LocalSGD), per step for the DDP hook, which
keeps one :class:`StepChecks` for all the buckets of a step. Until then the other ranks cannot know
that one rank failed, so they decode and sum what it sent (whatever its buffers held): decoding any
bytes is harmless (top-k indices are clamped), and the step raises at its end on every rank alike,
naming the lowest failing rank of the first message, in the order every rank read them, whose header
reported an error. A failing rank sends error headers for the rest of the step.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.distributed as dist

from fastml_strategy import codecs
from fastml_strategy.config import RECIPES, Codec, CodecConfig, Plan

__all__ = ["BucketLayout", "ShardLayout", "CompressedAllReduce", "CompressionError", "DecodeError", "StepChecks",
           "host_reads"]

HEADER = 64  # bytes: int32 status, int32 rank, 56 bytes of UTF-8 error text
_STATUS_OK, _STATUS_ERROR = 0, 1
_M32 = 0xFFFFFFFF


class CompressionError(RuntimeError):
    """Raised on every rank when compression or communication failed on one of them."""


class DecodeError(CompressionError):
    """Decoding failed on this rank after the bucket's last collective (the caller tells the others)."""


def _mix(*xs: int) -> int:
    h = 0x811C9DC5
    for x in xs:
        h = ((h ^ (int(x) & _M32)) * 0x01000193) & _M32
        h ^= h >> 15
    return h


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

    @property
    def base(self) -> "_DenseGroup":
        """The group that owns the staging vector and the residuals (itself unless a segment)."""
        return self if self.parent is None else self.parent

    @property
    def ef(self) -> bool:
        return self.cfg.uses_residual

    @property
    def key(self) -> int:
        """A seed component that depends on the layer, not on its position in a bucket (buckets are
        rebuilt after the first iteration; stochastic rounding must not change with them)."""
        return zlib.crc32(self.params[0].name.encode())

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


_host_reads = 0


def _host(t: torch.Tensor) -> torch.Tensor:
    """The one way the wire path reads a tensor's value on the host (counted: :func:`host_reads`).

    A CUDA tensor is copied into pinned memory on the current stream and the host waits for that
    copy's event: one host synchronisation, and an explicit one, so that the hot path can run under
    ``torch.cuda.set_sync_debug_mode("error")`` and any *other* read (``.item()``, ``bool(t)``,
    ``nonzero``) still raises there. The hook reads one small tensor per step this way."""
    global _host_reads
    _host_reads += 1
    if not t.is_cuda:
        return t.detach()
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t.detach(), non_blocking=True)
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(t.device))
    done.synchronize()
    return out


def host_reads() -> int:
    """How many times this process's wire path read a tensor on the host (:func:`_host`)."""
    return _host_reads


def _finite_t(t: torch.Tensor) -> torch.Tensor:
    """Whether every element of ``t`` is finite, as a 0-d bool tensor on ``t``'s device (no host
    read). ``aminmax`` reads ``t`` once and propagates NaN; an inf is the min or the max itself, and
    finite values never overflow a min or a max."""
    if t.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=t.device)
    mn, mx = torch.aminmax(t.reshape(-1))
    return torch.isfinite(mn) & torch.isfinite(mx)


def _finite(t: torch.Tensor) -> bool:
    """:func:`_finite_t`, read on the host."""
    return bool(_host(_finite_t(t)))


class StepChecks:
    """What the buckets of one step found, kept on the device until the step ends (no host read per
    bucket or per piece): the headers of every message received, in the order every rank reads them
    (W per all_to_all and per all_gather), the finiteness of every decoded result, and this rank's
    own errors. :meth:`CompressedAllReduce.finish` reads the headers' status and the finiteness in
    one host read; only when a header reports an error are the headers' texts read (to raise).

    ``error``: this rank's first error while encoding or reducing; every message this rank sends
    afterwards (in this step) carries it in its header, and the rank skips the rest of its work.
    ``decode_error``: an error after a bucket's last collective, which no header can carry: the
    ranks exchange it at the end of the step (:meth:`CompressedAllReduce.finish`, ``exchange``)."""

    def __init__(self) -> None:
        self.headers: list[tuple[str, torch.Tensor]] = []  # (stage, W x HEADER bytes)
        self.finite: list[torch.Tensor] = []  # 0-d bool tensors
        # buffers of plain all-reduces, checked for NaN/inf only when finiteness decides something
        # (:meth:`CompressedAllReduce.finish`, ``plain``): a step of plain buckets only has no
        # residual to hold back, and DDP's own hook checks nothing either
        self.plain: list[torch.Tensor] = []
        self.error: BaseException | None = None
        self.decode_error: BaseException | None = None

    def add_headers(self, stage: str, headers: list[torch.Tensor]) -> None:
        self.headers.append((stage, torch.stack([h[:HEADER] for h in headers])))

    def add_finite(self, ok: torch.Tensor) -> None:
        self.finite.append(ok.reshape(()))


def _chunk_bounds(length: int, unit: int, W: int) -> list[int]:
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
    """Whether a segment can be encoded and decoded through segment tables: a quantized layer read
    from and decoded into an fp32 bucket buffer (direct), with fp32 residuals in the layout's flat
    buffers or none."""
    return (g.cfg.codec is Codec.QUANTIZE and g.direct
            and (not g.ef or (g.base.res_off >= 0 and g.base.res_next is not None)))


class _SegmentTables:
    """The Triton segment tables of one piece and one quantization config (bits, block size, rounding,
    error feedback): one launch per stage for all its layers' chunks instead of one per chunk
    (:mod:`fastml_strategy.kernels.quantize_triton`). Offsets are fixed for the layout's life; only
    stochastic rounding's seeds change per step (a pinned, non-blocking upload of one column)."""

    def __init__(self, piece: "_Piece", groups: list[_DenseGroup], W: int, r: int, device) -> None:
        from fastml_strategy.kernels import quantize_triton as qt

        cfg = groups[0].cfg
        self.groups = groups
        self.bits, self.block_size, self.stochastic = cfg.bits, cfg.block_size, cfg.stochastic
        self.ef = cfg.uses_residual
        enc, red, dec = [], [], []
        self.enc_chunks: list[tuple[_DenseGroup, int]] = []  # (group, j) per encode-table chunk
        for g in groups:
            base = g.base
            for j in range(W):
                a, b = g.bounds[j], g.bounds[j + 1]
                roff = base.res_off + a if self.ef else 0
                enc.append((g.chunk_base[j], roff, roff, g.send_off[j], b - a, 0))
                self.enc_chunks.append((g, j))
                dec.append((j * piece.gather_size + g.gather_off[j], g.chunk_base[j], b - a))
            n_me = g.bounds[r + 1] - g.bounds[r]
            red.append((g.recv_off, g.acc_off, n_me))
        self.enc, self.g = qt.encode_table(enc, self.bits, self.block_size, device)
        self.enc_counts = self._counts(enc)
        self.reenc, _ = qt.encode_table([(g.acc_off, 0, 0, g.gather_off[r], g.bounds[r + 1] - g.bounds[r], 0)
                                         for g in groups], self.bits, self.block_size, device)
        self.reenc_counts = self._counts([(0, 0, 0, 0, g.bounds[r + 1] - g.bounds[r], 0) for g in groups])
        self.red, _ = qt.decode_table(red, self.bits, self.block_size, device)
        self.dec, _ = qt.decode_table(dec, self.bits, self.block_size, device)

    def _counts(self, rows) -> list[int]:
        from fastml_strategy.kernels import num_blocks

        return [-(-num_blocks(n, self.block_size) // self.g) if n > 0 else 0 for *_, n, _ in rows]

    @staticmethod
    def _set_seeds(table: torch.Tensor, counts: list[int], seeds: list[int]) -> None:
        from fastml_strategy.kernels import quantize_triton as qt

        col = torch.tensor([qt._seed_word(s) for s, c in zip(seeds, counts) for _ in range(c)],
                           dtype=torch.int64)
        if table.is_cuda:
            col = col.pin_memory()
        table[:, 7].copy_(col, non_blocking=table.is_cuda)


def _segments(g: _DenseGroup, W: int, piece_numel: int) -> list[_DenseGroup]:
    """``g`` itself, or, if it is longer than ``piece_numel``, its slices: near-equal parts on chunk
    unit boundaries, each cut into W chunks. A slice starts on a multiple of the unit (the
    quantization block) from the group's start, so every block holds the same elements as when the
    group is cut into W chunks only: deterministic codecs give the same values either way."""
    if g.length <= piece_numel:
        return [g]
    unit = codecs.chunk_unit(g.cfg)
    cuts = _chunk_bounds(g.length, unit, math.ceil(g.length / piece_numel))
    out = []
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        if hi <= lo:
            continue
        bounds = [lo + b for b in _chunk_bounds(hi - lo, unit, W)]
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
        W = world_size
        dense: dict[tuple, list[_Param]] = {}
        self.topk: list[_TopkParam] = []
        self.configs: dict[str, CodecConfig] = {}
        # plan_numels: the parameters' own sizes, when the bucket holds only a shard of them (HSDP):
        # whether a tensor is small enough to travel uncompressed is a property of the parameter.
        self.uncompressed = True  # every tensor fp32 in the plan: a plain all-reduce does it
        for name, off, n, pn in zip(names, offsets, numels, plan_numels or numels):
            planned = codecs.effective_config(plan.for_parameter(name, pn), n, W)
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
        self.dense: list[_DenseGroup] = []
        fp32_buffer = dtype == torch.float32
        for (_, cfg), params in dense.items():
            pos = 0
            for p in params:
                p.goff = pos
                pos += p.numel
            length = pos
            bounds = _chunk_bounds(length, codecs.chunk_unit(cfg), W)
            nbytes = [codecs.chunk_nbytes(bounds[j + 1] - bounds[j], cfg) for j in range(W)]
            direct = fp32_buffer and len(params) == 1
            g = _DenseGroup(cfg, params, length, bounds, nbytes,
                            pieces=[(p.boff, p.goff, p.numel) for p in params], direct=direct,
                            chunk_base=[params[0].boff + bounds[j] for j in range(W)] if direct else [])
            self.dense.append(g)
        # Residuals: fp32 ones of a double-buffered layout are views of two flat buffers, swapped
        # together at commit, so that one kernel launch (a segment table) reaches every layer's.
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
        # The pipeline: segments in bucket order, packed into pieces of about piece_numel elements (a
        # small segment joins its neighbours rather than costing a collective of its own).
        piece_numel = max(1, int(piece_numel))
        runs: list[list[_DenseGroup]] = [[]]
        filled = 0
        for g in self.dense:
            for seg in _segments(g, W, piece_numel):
                if runs[-1] and filled + seg.length > piece_numel and 4 * filled >= piece_numel:
                    runs.append([])
                    filled = 0
                runs[-1].append(seg)
                filled += seg.length
        self.pieces = [_Piece(segs, self.topk if i == len(runs) - 1 else [], W, rank, device)
                       for i, segs in enumerate(runs)]
        self.send = self.recv = self.gsend = self.grecv = None
        self.topk_acc: dict[str, torch.Tensor] = {}
        if persistent and not self.uncompressed:
            self._alloc()

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


class CompressedAllReduce:
    """Runs FastML's compressed collectives on one process group (call from one thread only):
    :meth:`run` all-reduces a DDP bucket (:class:`BucketLayout`), :meth:`reduce_scatter` reduces an
    FSDP unit's gradients (:class:`ShardLayout`)."""

    def __init__(self, plan: Plan, group, rank: int, world_size: int,
                 piece_numel: int = PIECE_NUMEL) -> None:
        self.plan = plan
        self.group = group
        self.rank = rank
        self.world_size = world_size
        # the rank error headers name: ``rank`` itself, or (the hierarchical path, whose group is one
        # local rank's machines) the rank in the whole world, so every rank's error names the same one
        self.report_rank = rank
        self.piece_numel = piece_numel  # elements per pipeline piece of a bucket (PIECE_NUMEL)
        # Triton segment tables for the quantized layers of fp32 buckets: one kernel launch per stage
        # and piece instead of one per chunk and layer. None: on CUDA when the Triton backend is used;
        # True: also for CPU tensors (the tests, through Triton's interpreter); False: never.
        self.segment_tables: bool | None = None
        self.layouts: dict[tuple, BucketLayout | ShardLayout] = {}
        # residuals loaded from a checkpoint before the layout that owns them exists
        self.pending_residuals: dict[str, torch.Tensor] = {}
        # statistics
        self.bytes_sent = 0
        self.bytes_uncompressed = 0.0
        self.layer_error: dict[str, float] = {}

    @staticmethod
    def wait(work) -> None:
        """Wait for one of :meth:`run`'s asynchronous collectives. A caller whose ranks meet in
        several groups (HSDP) replaces it by :meth:`fastml_strategy._peers.FailureChannel.wait`,
        which also raises as soon as a rank of another group has failed."""
        work.wait()

    # -- layouts and residuals ----------------------------------------------------------------------
    def layout_for(self, names, offsets, numels, device, dtype=torch.float32,
                   double_buffer: bool = True, persistent: bool = True,
                   plan_numels: Sequence[int] | None = None) -> BucketLayout:
        key = (tuple(names), tuple(offsets), tuple(numels), dtype)
        lay = self.layouts.get(key)
        if lay is not None:
            return lay
        lay = BucketLayout(names, offsets, numels, self.plan, self.world_size, self.rank, device, dtype,
                           double_buffer=double_buffer, persistent=persistent, plan_numels=plan_numels,
                           piece_numel=self.piece_numel)
        return self._adopt(key, lay)

    def shard_layout_for(self, tensors: Sequence[ShardedTensor], device, dtype) -> ShardLayout:
        key = ("rs", tuple(tensors), dtype)
        lay = self.layouts.get(key)
        if lay is not None:
            return lay
        lay = ShardLayout(tensors, self.plan, self.world_size, self.rank, device, dtype)
        return self._adopt(key, lay)

    def _adopt(self, key: tuple, lay):
        new = set(lay.names)
        old = self.residuals()
        # Layouts sharing a parameter with the new one are stale (DDP rebuilt its buckets, a layer was
        # frozen). Their other parameters' residuals wait in pending_residuals for their new layout.
        for k in [k for k, v in self.layouts.items() if new & set(v.names)]:
            for name, view in self.layouts.pop(k).residual_views().items():
                if name not in new:
                    self.pending_residuals[name] = view
        for name, view in lay.residual_views().items():
            src = self.pending_residuals.pop(name, None)
            if src is None:
                src = old.get(name)
            if src is not None:
                view.copy_(src.reshape(-1).to(view.device))
        self.layouts[key] = lay
        return lay

    def residuals(self) -> dict[str, torch.Tensor]:
        out = dict(self.pending_residuals)
        for lay in self.layouts.values():
            out.update(lay.residual_views())
        return out

    def residual_nbytes(self) -> int:
        """Bytes of error-feedback memory this rank holds."""
        return sum(lay.residual_nbytes() for lay in self.layouts.values()) + sum(
            t.numel() * t.element_size() for t in self.pending_residuals.values())

    def load_residuals(self, residuals: dict[str, torch.Tensor]) -> None:
        live: dict[str, torch.Tensor] = {}
        for lay in self.layouts.values():
            live.update(lay.residual_views())
        for name, t in residuals.items():
            if name in live:
                live[name].copy_(t.reshape(-1).to(live[name].device))
            else:
                self.pending_residuals[name] = t.detach().reshape(-1).clone()

    # -- collectives (run at world size 1 too: one code path everywhere) ------------------------------
    def _all_to_all(self, lay: _Messages, async_op: bool = False):
        work = dist.all_to_all_single(lay.recv, lay.send, output_split_sizes=[lay.my_chunk] * self.world_size,
                                      input_split_sizes=lay.split_sizes, group=self.group,
                                      async_op=async_op)
        self.bytes_sent += sum(lay.split_sizes) - lay.split_sizes[self.rank]
        return work

    def _all_gather(self, lay: BucketLayout | _Piece, async_op: bool = False):
        outs = list(lay.grecv.view(self.world_size, lay.gather_size).unbind(0))
        work = dist.all_gather(outs, lay.gsend, group=self.group, async_op=async_op)
        self.bytes_sent += (self.world_size - 1) * lay.gather_size
        return work

    # -- error headers ----------------------------------------------------------------------------------
    def _write_header(self, buf: torch.Tensor, error: BaseException | None) -> None:
        h = buf[:HEADER]
        if error is None:
            h[:4].view(torch.int32).fill_(_STATUS_OK)
            return
        h[:4].view(torch.int32).fill_(_STATUS_ERROR)
        h[4:8].view(torch.int32).fill_(self.report_rank)
        text = f"{type(error).__name__}: {error}".encode("utf-8", "replace")[: HEADER - 8]
        h[8:].zero_()
        h[8: 8 + len(text)].copy_(torch.frombuffer(bytearray(text), dtype=torch.uint8))

    @staticmethod
    def _header_error(headers: list[torch.Tensor], stage: str,
                      cause: BaseException | None = None) -> CompressionError | None:
        """The error the W headers report (None if none does). One device-to-host copy of the W
        headers (64 bytes each), not of the messages behind them. Headers are read in rank order, so
        every rank reports the same (lowest) failing rank with the same text; the failing rank itself
        reads its own header too and chains its exception (``cause``)."""
        for h in _host(torch.stack([h[:HEADER] for h in headers])).unbind(0):
            if int(h[:4].view(torch.int32)[0]) != _STATUS_OK:
                rank = int(h[4:8].view(torch.int32)[0])
                text = bytes(h[8:].tolist()).rstrip(b"\0").decode("utf-8", "replace")
                err = CompressionError(
                    f"FastML: compression failed on rank {rank} during {stage} ({text}); every rank "
                    f"stops here so none hangs. See rank {rank}'s log for the traceback.")
                err.__cause__ = cause
                return err
        return None

    @classmethod
    def _check_headers(cls, headers: list[torch.Tensor], stage: str,
                       cause: BaseException | None = None) -> None:
        err = cls._header_error(headers, stage, cause)
        if err is not None:
            raise err
        if cause is not None:  # unreachable: this rank's own header carries its error
            raise CompressionError(f"FastML: compression failed during {stage}") from cause

    # -- the shared first half: encode every chunk, all_to_all, sum this rank's chunk -------------------
    def _scatter_reduce(self, lay: _Messages, buf: torch.Tensor, base: int, layer_stats: bool) -> None:
        """Encode the dense groups' chunks of ``buf`` and exchange them: afterwards ``lay.recv`` holds
        every rank's encoding of this rank's chunks (the reduce-scatter's one collective)."""
        W = self.world_size
        local_error: BaseException | None = None
        try:
            for g in lay.dense:
                self._record_error(g, *self._encode_group(lay, g, buf, base, layer_stats), layer_stats)
        except Exception as e:  # noqa: BLE001 - forwarded to every rank below
            local_error = e
        for j in range(W):
            start = sum(lay.split_sizes[:j])
            self._write_header(lay.send[start:], local_error)
        self.wait(self._all_to_all(lay, async_op=True))
        headers = [lay.recv[j * lay.my_chunk:] for j in range(W)]
        self._check_headers(headers, "encoding", local_error)

    def _own_chunks(self, lay: _Messages, g: _DenseGroup) -> list[torch.Tensor]:
        """The W received encodings of this rank's chunk of ``g``, in rank order."""
        r = self.rank
        return [lay.recv[src * lay.my_chunk + g.recv_off:][: g.nbytes[r]] for src in range(self.world_size)]

    def _sum_own_chunks(self, lay: _Messages) -> None:
        """Decode the W received copies of this rank's chunk of each group and sum them into ``acc``
        (in rank order: every rank adds in the same order)."""
        r = self.rank
        for g in lay.dense:
            n_me = g.bounds[r + 1] - g.bounds[r]
            for src, chunk in enumerate(self._own_chunks(lay, g)):
                codecs.decode_chunk(chunk, n_me, g.cfg, g.acc, accumulate=src > 0)

    def _reduce_own_chunks(self, piece: "_Piece", base: int, tables: dict | None = None,
                           divisor: float | None = None) -> None:
        """The reduce step of a piece: for each group, the W received copies of this rank's chunk
        decoded, summed in rank order (every rank adds in the same order), divided by W and encoded
        into ``piece.gsend`` (:func:`fastml_strategy.codecs.reduce_chunk`: one pass on the compiled
        CPU path); with ``tables``, the groups of the segment tables in one launch per table and
        stage; ``divisor`` replaces W (1: the sum)."""
        W, r = self.world_size, self.rank
        div = W if divisor is None else divisor
        if tables:
            self._table_reduce(piece, tables, base, div)
        for g in piece.dense:
            if tables and _table_group(g):
                continue
            off = g.gather_off[r]
            codecs.reduce_chunk(self._own_chunks(piece, g), g.bounds[r + 1] - g.bounds[r], g.cfg,
                                piece.gsend[off: off + g.nbytes[r]], div, g.acc, seed=self._seed(base, 1, g))

    @staticmethod
    def _seed(base: int, stage: int, g: _DenseGroup, *more: int) -> int:
        # A slice of a pipelined group mixes in where it starts; a whole group (start 0) keeps the
        # seeds it had before pipelining.
        start = g.bounds[0]
        return _mix(base, stage, g.key, *more, start) if start else _mix(base, stage, g.key, *more)

    def _encode_group(self, lay: _Messages, g: _DenseGroup, buf: torch.Tensor, base: int,
                      layer_stats: bool):
        """Encode chunk j of ``g`` into ``lay``'s message for rank j (every j), with error feedback;
        returns (squared error, squared norm) of the encoding when ``layer_stats`` (0-d device
        tensors; else zeros)."""
        if not g.direct:
            g.gather(buf)
        owner = g.base
        err2 = nrm2 = 0.0
        for j in range(self.world_size):
            a, b = g.bounds[j], g.bounds[j + 1]
            x = g.chunk(buf, j)
            out = lay.send[g.send_off[j]: g.send_off[j] + g.nbytes[j]]
            res = owner.res_cur[a:b] if g.ef else None
            res_out = owner.res_next[a:b] if g.ef and owner.res_next is not None else None
            v = None
            if layer_stats and b > a:
                v = x.to(torch.float32, copy=True)
                if res is not None:
                    v += res
            codecs.encode_chunk(x, g.cfg, out, res, res_out, seed=self._seed(base, 0, g, j))
            if v is not None:
                # relative error ||decoded - input|| / ||input|| of the first-stage encoding
                # (0-d float64 tensors on the device: read only when stats() asks, see layer_stats)
                dec = torch.empty_like(v)
                codecs.decode_chunk(out, b - a, g.cfg, dec)
                err2 = err2 + (dec - v).square().sum(dtype=torch.float64)
                nrm2 = nrm2 + v.square().sum(dtype=torch.float64)
        return err2, nrm2

    def _record_error(self, g: _DenseGroup, err2, nrm2, layer_stats: bool) -> None:
        if layer_stats:
            if isinstance(nrm2, torch.Tensor):
                rel = torch.where(nrm2 > 0, (err2 / nrm2).sqrt(), torch.zeros_like(nrm2))
            else:
                rel = math.sqrt(err2 / nrm2) if nrm2 > 0 else 0.0
            for p in g.params:
                self.layer_error[p.name] = rel

    # -- the all-reduce of a DDP bucket ----------------------------------------------------------------
    @torch.no_grad()
    def run(self, lay: BucketLayout, buf: torch.Tensor, step: int, layer_stats: bool = False,
            commit: bool = True, baseline_elem_size: int = 4,
            checks: StepChecks | None = None, divisor: float | None = None) -> bool | None:
        """Replace flat bucket ``buf`` (any float dtype) by the mean over ranks of the compressed
        gradients. Returns whether the result is finite; the new residuals are committed only then
        (with ``commit=False`` not at all: the caller calls :meth:`commit` once the whole step is
        known to be finite, so a step that GradScaler skips leaves every bucket's residuals alone).
        ``baseline_elem_size``: bytes per element of the uncompressed all-reduce the statistics
        compare against (fp32 for DDP). ``divisor``: what the sum over ranks is divided by (default
        the world size: the mean; 1: the sum, as for an FSDP unit with a gradient divide factor,
        which its reduce-scatter has applied already).

        With ``checks`` (the DDP hook: one :class:`StepChecks` per step) nothing is read on the host
        and nothing raised for what the headers or the results say: they are added to ``checks``,
        which the caller resolves once per step with :meth:`finish`; returns None. Without, the
        bucket is resolved at once (one host read): an error in any rank's header raises the same
        :class:`CompressionError` on every rank, a decoding error of this rank :class:`DecodeError`."""
        own = checks is None
        if own:
            checks = StepChecks()
        tail = self.start(lay, buf, step, layer_stats, checks, baseline_elem_size, divisor=divisor)
        if tail is not None:
            tail()
        if not own:
            return None
        finite = self.finish(checks)
        if finite and commit:
            self.commit(lay)
        return finite

    @torch.no_grad()
    def start(self, lay: BucketLayout, buf: torch.Tensor, step: int, layer_stats: bool,
              checks: StepChecks, baseline_elem_size: int = 4, before=None,
              divisor: float | None = None):
        """:meth:`run` with ``checks``, less the bucket's tail: returns None when ``buf`` holds the
        result, else a callable that completes it (waits for the last piece's all_gather and decodes
        it into ``buf``; it issues no collective). The DDP hook runs the tail after the *next* bucket's
        first all_to_all is on the wire, so that the wire does not idle between buckets while one is
        decoded and the next encoded (pipelining across buckets). ``before``: called once this
        bucket's first message is on the wire (at once for a bucket that sends nothing compressed);
        the hook passes the previous bucket's tail. Neither moves a collective: every rank issues
        the same collectives in the same order whenever the tails run."""
        if lay.uncompressed:
            if before is not None:
                before()
            self._plain_all_reduce(lay, buf, baseline_elem_size, checks, divisor)
            return None
        transient = lay.acquire()
        try:
            tail = self._run(lay, buf, step, layer_stats, checks, baseline_elem_size, before, divisor)
        except BaseException:
            if transient:
                lay.release()
            raise

        @torch.no_grad()
        def complete() -> None:
            try:
                tail()
            finally:
                if transient:
                    lay.release()

        return complete

    @torch.no_grad()
    def finish(self, checks: StepChecks, device: torch.device | None = None, exchange: bool = False,
               stage: str = "decoding", plain: bool = True) -> bool:
        """Resolve what ``checks`` gathered: one host read of every header's status and every
        finiteness check. If a header reports an error, every rank raises the same
        :class:`CompressionError`, naming the lowest failing rank of the first message (in the order
        every rank read them) that carried one. With ``exchange`` (a collective: at the end of a
        step that decoded something), the ranks first all_gather a 64-byte header of this rank's
        ``checks.decode_error``, as a last message read after all others; without, a decoding error
        of this rank raises :class:`DecodeError` (the caller tells the others). Returns whether every
        checked result was finite; the results of plain all-reduces are checked only with ``plain``
        (the hook passes it when the step has compressed buckets, whose residuals a NaN holds back)."""
        W = self.world_size
        if plain:
            for buf in checks.plain:
                checks.add_finite(_finite_t(buf))
        checks.plain = []
        if exchange and W > 1:
            dev = device if device is not None and device.type == "cuda" else torch.device("cpu")
            mine = torch.zeros(HEADER, dtype=torch.uint8, device=dev)
            self._write_header(mine, checks.decode_error)
            out = torch.zeros(W * HEADER, dtype=torch.uint8, device=dev)
            dist.all_gather(list(out.view(W, HEADER).unbind(0)), mine, group=self.group)
            checks.add_headers(stage, list(out.view(W, HEADER).unbind(0)))
        parts = []
        if checks.headers:
            hdrs = torch.cat([h for _, h in checks.headers])
            parts.append(hdrs.view(torch.int32)[:, 0] != _STATUS_OK)
        if checks.finite:
            fin = torch.stack(checks.finite)
            parts.append(~fin.to(parts[0].device) if parts else ~fin)
        flags = _host(torch.cat(parts)).tolist() if parts else []
        cause = checks.error or checks.decode_error
        for i, (what, h) in enumerate(checks.headers):
            if any(flags[i * W: (i + 1) * W]):  # the error path: the texts are read only here
                raise self._header_error(list(_host(h).unbind(0)), what, cause)
        if checks.error is not None:  # unreachable: this rank's own headers carry its error
            raise CompressionError("FastML: compression failed") from checks.error
        if checks.decode_error is not None:
            if exchange:  # one rank: no header to exchange, the error is this rank's
                raise CompressionError(f"FastML: compression failed during {stage} "
                                       f"({checks.decode_error})") from checks.decode_error
            e = checks.decode_error
            raise DecodeError(f"{type(e).__name__}: {e}") from e
        return not any(flags[W * len(checks.headers):])

    def _plain_all_reduce(self, lay: BucketLayout, buf: torch.Tensor, baseline_elem_size: int,
                          checks: StepChecks, divisor: float | None = None) -> None:
        """A bucket with nothing to compress: exactly what DDP's own hook does (divide, then one
        all-reduce in the gradients' dtype), so ``none`` is DDP's result for every dtype (float64 too)
        and costs one collective; its finiteness is left to :meth:`finish` (``plain``)."""
        W = self.world_size
        div = W if divisor is None else divisor
        if div != 1:
            buf.div_(div)
        if W > 1:
            dist.all_reduce(buf, group=self.group)
        self.count_plain(lay.total_numel, buf, baseline_elem_size)
        checks.plain.append(buf)

    def count_plain(self, numel: int, buf: torch.Tensor, baseline_elem_size: int = 4) -> None:
        """Add a plain (ring) all-reduce of ``buf`` to the statistics, against ``numel`` elements of
        ``baseline_elem_size`` bytes."""
        W = self.world_size
        nbytes = buf.numel() * buf.element_size()
        self.bytes_sent += int(round(2.0 * (W - 1) / W * nbytes))
        self.bytes_uncompressed += 2.0 * (W - 1) / W * baseline_elem_size * numel

    def count_sparse(self, buf: torch.Tensor) -> None:
        """Add gloo's sparse all-reduce of ``buf`` (it all-gathers every rank's indices and values) to
        the statistics."""
        nbytes = buf._values().numel() * buf.element_size() + buf._indices().numel() * 8
        self.bytes_sent += (self.world_size - 1) * nbytes
        self.bytes_uncompressed += (self.world_size - 1) * nbytes

    @torch.no_grad()
    def sparse_all_reduce(self, buf: torch.Tensor, checks: StepChecks | None = None) -> bool | None:
        """A sparse gradient (its own DDP bucket): the exact sparse all-reduce DDP does, then the mean.
        Every rank sums the same rows in the same order, so replicas stay identical; uncompressed
        whatever the plan says. Returns whether the result is finite (with ``checks``: adds that to
        them and returns None)."""
        W = self.world_size
        self.count_sparse(buf)
        if W > 1:
            dist.all_reduce(buf, group=self.group)
            buf.div_(W)
        ok = _finite_t(buf._values())
        if checks is None:
            return bool(_host(ok))
        checks.add_finite(ok)
        return None

    def exchange_status(self, error: BaseException | None, stage: str, device: torch.device) -> None:
        """Every rank tells every other whether ``error`` happened on it (a 64-byte all_gather); if it
        did on any rank, every rank raises the same :class:`CompressionError`, naming the lowest."""
        checks = StepChecks()
        checks.decode_error = error
        self.finish(checks, device, exchange=True, stage=stage)

    def _run(self, lay: BucketLayout, buf: torch.Tensor, step: int, layer_stats: bool,
             checks: StepChecks, baseline_elem_size: int, before=None, divisor: float | None = None):
        """The pipeline over ``lay.pieces`` (P of them). Every rank issues the same collectives in the
        same order, whatever fails where: a2a 0, a2a 1, ag 0, a2a 2, ag 1, ..., ag P-1, so that

        - piece k+1 is encoded while piece k's all_to_all is on the wire,
        - piece k is reduced (decode W copies, sum, re-encode) and its all_gather issued,
        - piece k-1's all_gather is awaited and decoded into ``buf`` while pieces k and k+1 travel.

        Nothing here is read on the host. Errors travel in the headers: a rank whose encoding (or
        reduction) raised sends error headers from then on (for the rest of the step) and skips its
        work; the other ranks cannot know before the step's one host read (:meth:`finish`), so they
        decode and sum whatever the failing rank sent, which must be harmless (top-k indices are
        clamped, see :func:`fastml_strategy.codecs.decode_topk_add`). The headers each rank reads,
        in the same order on every rank, go to ``checks``, with the finiteness of the decoded
        chunks. Decoding into ``buf`` follows the last collective of its piece: an error there is
        this rank's alone (``checks.decode_error``; the ranks exchange it at the end of the step).

        Returns the tail (:meth:`start`): the last piece's decode and the bucket's bookkeeping.
        ``before`` runs once piece 0's all_to_all is issued."""
        W, r = self.world_size, self.rank
        base = _mix(self.plan.seed, step, r)
        pieces = lay.pieces
        P = len(pieces)
        finite: list[torch.Tensor] = []  # reduced to one check per bucket
        stats: dict[int, list] = {}  # id(group) -> [group, err2, nrm2] (a group's slices add up)
        a2a: list = [None] * P
        ag: list = [None] * P

        tabs = [self._tables(piece, buf, layer_stats) for piece in pieces]

        def encode(k: int) -> None:
            piece = pieces[k]
            if checks.error is None:
                try:
                    if tabs[k]:
                        self._table_encode(lay, piece, tabs[k], buf, base)
                    for g in piece.dense:
                        if tabs[k] and _table_group(g):
                            continue
                        e2, n2 = self._encode_group(piece, g, buf, base, layer_stats)
                        acc = stats.setdefault(id(g.base), [g.base, 0.0, 0.0])
                        acc[1] = acc[1] + e2
                        acc[2] = acc[2] + n2
                    if piece.topk:
                        self._encode_topk(lay, piece, buf, base, layer_stats)
                except Exception as e:  # noqa: BLE001 - forwarded to every rank in the headers
                    checks.error = e
            for j in range(W):
                self._write_header(piece.send[piece.send_starts[j]:], checks.error)
            a2a[k] = self._all_to_all(piece, async_op=True)

        def reduce(k: int) -> None:
            piece = pieces[k]
            self.wait(a2a[k])
            checks.add_headers("encoding", [piece.recv[j * piece.my_chunk:] for j in range(W)])
            if checks.error is None:
                try:
                    self._reduce_own_chunks(piece, base, tabs[k], divisor)
                except Exception as e:  # noqa: BLE001
                    checks.error = e
            self._write_header(piece.gsend, checks.error)
            ag[k] = self._all_gather(piece, async_op=True)

        def decode(k: int) -> None:
            piece = pieces[k]
            self.wait(ag[k])
            checks.add_headers("reduction", [piece.grecv[j * piece.gather_size:] for j in range(W)])
            if checks.error is None and checks.decode_error is None:
                try:
                    self._decode(lay, piece, buf, finite, tabs[k], divisor)
                except Exception as e:  # noqa: BLE001 - after the piece's last collective
                    checks.decode_error = e

        encode(0)
        if before is not None:
            before()
        for k in range(P):
            if k + 1 < P:
                encode(k + 1)
            reduce(k)
            if k > 0:
                decode(k - 1)

        def tail() -> None:
            decode(P - 1)
            if finite:
                checks.add_finite(torch.stack(finite).all())
            for g, e2, n2 in stats.values():
                self._record_error(g, e2, n2, layer_stats)
            self.bytes_uncompressed += 2.0 * (W - 1) / W * baseline_elem_size * lay.total_numel

        return tail

    # -- segment tables (Triton): one launch per stage and piece for the quantized layers -----------------
    def _tables(self, piece, buf: torch.Tensor, layer_stats: bool) -> dict | None:
        if layer_stats or not isinstance(piece, _Piece):
            return None  # (the per-layer error is measured chunk by chunk)
        use = self.segment_tables
        if use is None:
            from fastml_strategy import kernels

            use = buf.is_cuda and kernels.resolve_backend(buf, None) == "triton"
        if not use:
            return None
        if piece.tables is None:
            by: dict[tuple, list[_DenseGroup]] = {}
            for g in piece.dense:
                if _table_group(g):
                    c = g.cfg
                    by.setdefault((c.bits, c.block_size, c.stochastic, c.uses_residual), []).append(g)
            piece.tables = {key: _SegmentTables(piece, gs, self.world_size, self.rank, buf.device)
                            for key, gs in by.items()}
        return piece.tables or None

    def _table_encode(self, lay: BucketLayout, piece: _Piece, tables: dict, buf: torch.Tensor,
                      base: int) -> None:
        from fastml_strategy.kernels import quantize_triton as qt

        for t in tables.values():
            if t.stochastic:
                t._set_seeds(t.enc, t.enc_counts, [self._seed(base, 0, g, j) for g, j in t.enc_chunks])
            res, res_out = (lay.res_flat[0], lay.res_flat[1]) if t.ef else (None, None)
            qt.quantize_segments(buf, piece.send, t.enc, t.g, t.bits, t.block_size, t.stochastic, res, res_out)

    def _table_reduce(self, piece: _Piece, tables: dict, base: int, divisor: float) -> None:
        from fastml_strategy.kernels import quantize_triton as qt

        W = self.world_size
        for t in tables.values():
            qt.dequantize_segments(piece.recv, piece.acc_flat, t.red, t.g, t.bits, t.block_size,
                                   sources=W, src_stride=piece.my_chunk)
        piece.acc_flat[: piece.acc_table].div_(divisor)
        for t in tables.values():
            if t.stochastic:
                t._set_seeds(t.reenc, t.reenc_counts, [self._seed(base, 1, g) for g in t.groups])
            qt.quantize_segments(piece.acc_flat, piece.gsend, t.reenc, t.g, t.bits, t.block_size, t.stochastic)

    @staticmethod
    def commit(lay: BucketLayout) -> None:
        """Make the residuals computed by the last :meth:`run` of ``lay`` the current ones."""
        for g in lay.dense:
            if g.ef and g.res_next is not None:
                g.res_cur, g.res_next = g.res_next, g.res_cur
        if getattr(lay, "res_flat", None):
            lay.res_flat.reverse()
        for t in lay.topk:
            if t.cfg.uses_residual and t.pending is not None:
                if t.residual.dtype == t.pending.dtype:
                    t.residual, t.pending = t.pending, None  # v was a fresh tensor: no copy
                else:
                    t.residual.copy_(t.pending)
                    t.pending = None

    def _encode_topk(self, lay: BucketLayout, piece: _Piece, buf: torch.Tensor, base: int,
                     layer_stats: bool) -> None:
        for t in piece.topk:
            p = t.param
            g = buf[p.boff: p.boff + p.numel]
            res = t.residual if t.cfg.uses_residual else None
            vn = None
            if layer_stats:
                vn = (g.float() + res).norm() if res is not None else g.float().norm()
            out = piece.gsend[t.gather_off: t.gather_off + t.nbytes]
            # rest: a fresh fp32 tensor, the new residual; committed with the rest of the step
            rest, _ = codecs.encode_topk_ef(g, t.cfg, out, res, seed=_mix(base, 2, zlib.crc32(p.name.encode())))
            if layer_stats:
                self.layer_error[p.name] = torch.where(vn > 0, rest.norm() / vn, torch.zeros_like(vn))
            t.pending = rest if res is not None else None

    def _decode(self, lay: BucketLayout, piece: _Piece, buf: torch.Tensor,
                checks: list[torch.Tensor], tables: dict | None = None,
                divisor: float | None = None) -> None:
        """Decode one piece's all-gathered message into ``buf``, adding its finiteness checks."""
        W = self.world_size
        grecv = piece.grecv.view(W, piece.gather_size)
        if tables:
            from fastml_strategy.kernels import quantize_triton as qt

            for t in tables.values():
                checks.append(qt.dequantize_segments(piece.grecv, buf, t.dec, t.g, t.bits, t.block_size))
        for g in piece.dense:
            if tables and _table_group(g):
                continue
            for j in range(W):
                a, b = g.bounds[j], g.bounds[j + 1]
                off = g.gather_off[j]
                chunk = grecv[j, off: off + g.nbytes[j]]
                codecs.decode_chunk(chunk, b - a, g.cfg, g.chunk(buf, j))
                checks.append(codecs.chunk_finite(chunk, b - a, g.cfg))
            if not g.direct:
                g.scatter(buf)
        for t in piece.topk:
            p = t.param
            acc = lay.topk_acc[p.name]
            acc.zero_()
            for j in range(W):
                msg = grecv[j, t.gather_off: t.gather_off + t.nbytes]
                codecs.decode_chunk(msg, p.numel, t.cfg, acc, accumulate=True)
                checks.append(codecs.chunk_finite(msg, p.numel, t.cfg))
            acc.div_(W if divisor is None else divisor)
            buf[p.boff: p.boff + p.numel].copy_(acc)

    # -- the reduce-scatter of an FSDP unit --------------------------------------------------------------
    @torch.no_grad()
    def reduce_scatter(self, lay: ShardLayout, inp: torch.Tensor, out: torch.Tensor, step: int,
                       scale: float = 1.0, layer_stats: bool = False) -> bool:
        """Write ``scale`` x the sum over ranks of row ``rank`` of ``inp`` (compressed as the plan
        says, with error feedback) into ``out``. Returns whether this rank's result is finite."""
        if inp.numel() != lay.input_numel or out.numel() != lay.row_numel:
            raise CompressionError(
                f"FastML: reduce-scatter of {inp.numel()} -> {out.numel()} elements does not match "
                f"the layout of {', '.join(lay.names[:4])}{', ...' if len(lay.names) > 4 else ''} "
                f"({lay.input_numel} -> {lay.row_numel})")
        transient = lay.acquire()
        try:
            return self._reduce_scatter(lay, inp, out, step, scale, layer_stats)
        finally:
            if transient:
                lay.release()

    def _reduce_scatter(self, lay: ShardLayout, inp: torch.Tensor, out: torch.Tensor, step: int,
                        scale: float, layer_stats: bool) -> bool:
        r = self.rank
        base = _mix(self.plan.seed, step, r)
        self._scatter_reduce(lay, inp, base, layer_stats)
        self._sum_own_chunks(lay)
        checks: list[torch.Tensor] = []
        for g in lay.dense:
            if scale != 1.0:
                g.acc.mul_(scale)
            # the sum itself: a NaN/inf of any rank's chunk reaches it (and so does an overflow)
            checks.append(torch.isfinite(g.acc).all())
            for ooff, aoff, n in g.out_pieces:
                out[ooff: ooff + n].copy_(g.acc[aoff: aoff + n])
        for off, n in lay.padding:
            out[off: off + n].zero_()
        self.bytes_uncompressed += lay.baseline_bytes
        return bool(_host(torch.stack(checks).all())) if checks else True

    # -- statistics ---------------------------------------------------------------------------------------
    def layer_stats(self) -> dict[str, dict]:
        # The per-layer errors stay on the device until asked for: one host read for all of them.
        pending = [(n, v) for n, v in self.layer_error.items() if isinstance(v, torch.Tensor)]
        if pending:
            dev = pending[0][1].device
            vals = _host(torch.stack([v.reshape(()).to(dev, torch.float64) for _, v in pending])).tolist()
            for (n, _), v in zip(pending, vals):
                self.layer_error[n] = v
        out = {}
        for lay in self.layouts.values():
            for name, (cfg, numel, nbytes) in lay.layer_rows(self.world_size, self.rank).items():
                out[name] = {
                    "codec": cfg.describe(),
                    "numel": numel,
                    "bytes": nbytes,
                    "rel_error": self.layer_error.get(name, float("nan")),
                }
        return out
