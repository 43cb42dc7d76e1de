"""One DDP bucket on the wire, and the hierarchical hook's parts of it, without tensors.

:func:`bucket_wire` is the layout of a bucket's compressed all-reduce: which parameters travel
together (:func:`bucket_groups`), where each group is cut into W chunks (:func:`chunk_bounds`, on
the codec's chunk unit, so a quantization block never mixes two ranks' scales), how long groups are
sliced for the pipeline (:func:`piece_slices`) and the slices packed into pieces
(:func:`pack_pieces`), and every message's size and offsets (:func:`message_offsets`, a
:data:`HEADER` per message). The runtime's :class:`fastml_strategy.comm._layouts.BucketLayout` builds its
tensor views from this result; the autotuner's cost model prices the same result. Neither restates
the arithmetic.

Codec sizes come from ``codecs``, the first argument of every function that needs one: the codec
registry, :mod:`fastml_strategy.codecs` (its ``codec_for``, ``effective_config`` and
``wire_config``). This module never imports it: the codecs import torch, and their low-rank codec
reaches the runtime that builds from this module.
"""

from __future__ import annotations

import functools
import math
import operator
from dataclasses import dataclass
from typing import Any, Sequence

from fastml_strategy.wire.messages import PIECE_NUMEL, chunk_bounds, itemsize, message_offsets

__all__ = ["bucket_groups", "lowrank_sections", "piece_slices", "pack_pieces", "part_bounds_of",
           "GroupWire", "SegmentWire", "PieceWire", "BucketWire", "bucket_wire", "HierParts", "hier_parts"]

CodecConfig = Any  # a fastml_strategy.config.CodecConfig (not imported here: see the module docstring)


def bucket_groups(codecs: Any, numels: Sequence[int], planned: Sequence[CodecConfig], world_size: int,
                  dtype: Any = "fp32", shapes: Sequence | None = None
                  ) -> tuple[list[CodecConfig], list[tuple[CodecConfig, list[int]]], list[int], bool, list[int]]:
    """How a bucket's parameters (``numels``, in bucket order, each with the codec its plan names,
    ``planned``, and its shape where ``shapes`` gives them) travel at ``world_size``: ``(wire codec per
    parameter, dense groups as (codec, parameter indices), top-k parameter indices, uncompressed,
    low-rank parameter indices)``. Each compressed layer is a group of its own; the uncompressed ones
    (fp32 in the plan, or a top-k or low-rank layer's fp32 fall-back) share one batched group per wire
    codec; low-rank layers are the bucket's low-rank sections (:func:`lowrank_sections`);
    ``uncompressed``: nothing is lossy, so one plain all-reduce does the bucket."""
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
        codec = codecs.codec_for(cfg)
        if codec.lowrank:
            lowrank.append(i)
        elif codec.sparse:
            topk.append(i)
        elif not eff.lossy:
            dense.setdefault(("batch", cfg), []).append(i)  # uncompressed: one batched segment
        else:
            dense.setdefault((i, cfg), []).append(i)  # one segment per compressed layer
    return configs, [(cfg, idx) for (_, cfg), idx in dense.items()], topk, uncompressed, lowrank


def lowrank_sections(codecs: Any, configs: Sequence[CodecConfig], lowrank: Sequence[int], shapes: Sequence
                     ) -> list[tuple[CodecConfig | None, list[int], int, int]]:
    """The low-rank sections of a bucket: ``(factor codec or None for fp32, parameter indices, P
    elements, Q elements)`` per factor codec and warm-up length (``start``: a section's layers begin
    their approximation at the same step), in bucket order; each is one P round and one Q round."""
    by: dict = {}
    for i in lowrank:
        codec = codecs.codec_for(configs[i])
        sec = by.setdefault((codec.factor, configs[i].start), [codec.factor, [], 0, 0])
        pm, qm = codec.factor_numels(shapes[i])
        sec[1].append(i)
        sec[2] += pm
        sec[3] += qm
    return [tuple(v) for v in by.values()]


def piece_slices(length: int, unit: int, piece_numel: int) -> list[tuple[int, int]]:
    """``(start, end)`` of the slices a group of ``length`` elements is cut into for the pipeline:
    the whole group if it is at most ``piece_numel`` long, else near-equal parts on ``unit``
    boundaries (the codec's chunk unit), about ``piece_numel`` each. A slice starts on a multiple of
    the unit from the group's start, so every quantization block holds the same elements as when the
    group is cut into W chunks only: deterministic codecs give the same values either way."""
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


def part_bounds_of(codecs: Any, cfg: CodecConfig, numel: int, parts: int) -> list[int]:
    """The ``parts + 1`` boundaries of a parameter of ``numel`` elements whose plan names ``cfg``, cut
    into the hierarchical all-reduce's parts (part j: local rank j's) on the codec's
    :meth:`~fastml_strategy.codecs.WireCodec.part_unit`."""
    return chunk_bounds(numel, codecs.codec_for(cfg).part_unit(), parts)


@dataclass(frozen=True)
class GroupWire:
    """One dense group of a bucket: a compressed layer, or the batched uncompressed tensors.
    ``params``: its parameters (bucket indices), at ``offsets`` in the group's flat vector of
    ``length`` elements, which is cut into W chunks at ``bounds`` of ``nbytes`` encoded bytes each."""

    config: CodecConfig
    params: tuple[int, ...]
    offsets: tuple[int, ...]
    length: int
    bounds: tuple[int, ...]
    nbytes: tuple[int, ...]


@dataclass(frozen=True)
class SegmentWire:
    """One pipeline segment: group ``group`` itself (``whole``) or a slice of it, cut into W chunks
    at ``bounds`` (positions in the group's flat vector) of ``nbytes`` encoded bytes each."""

    group: int
    bounds: tuple[int, ...]
    nbytes: tuple[int, ...]
    whole: bool

    @property
    def length(self) -> int:
        return self.bounds[-1] - self.bounds[0]


@dataclass(frozen=True)
class PieceWire:
    """What one pipeline piece puts on the wire: its all_to_all message to each destination
    (``split_sizes``, headers included) and its all_gather message (``gather_size``: the header, the
    largest reduced chunk, then the bucket's top-k messages in the last piece), and which gradient
    elements it carries (``parts``: (dense group index, elements); ``topk``: parameter indices).
    ``segments``: its segments (indices into :attr:`BucketWire.segments`), whose chunk j lies at
    ``offsets[s][j]`` in message j (:func:`message_offsets`), in the all_to_all and the all_gather
    alike; ``topk_offsets``: where each top-k message lies in the all_gather message."""

    split_sizes: tuple[int, ...]
    gather_size: int
    parts: tuple[tuple[int, int], ...]
    topk: tuple[int, ...] = ()
    segments: tuple[int, ...] = ()
    offsets: tuple[tuple[int, ...], ...] = ()
    topk_offsets: tuple[int, ...] = ()

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
    this order. ``groups``: the parameter indices of each dense group (``dense``: the groups' chunks);
    ``segments``: the pipeline segments; ``configs``: each parameter's wire codec; ``topk``: the top-k
    parameters (``topk_nbytes``: each one's message)."""

    world_size: int
    numel: int
    elem_size: int
    uncompressed: bool
    configs: tuple[CodecConfig, ...]
    groups: tuple[tuple[int, ...], ...]
    pieces: tuple[PieceWire, ...]
    # the low-rank sections: (factor codec or None for fp32, P elements, Q elements), each two rounds
    lowrank: tuple[tuple[CodecConfig | None, int, int], ...] = ()
    dense: tuple[GroupWire, ...] = ()
    segments: tuple[SegmentWire, ...] = ()
    topk: tuple[int, ...] = ()
    topk_nbytes: tuple[int, ...] = ()
    lowrank_params: tuple[tuple[int, ...], ...] = ()
    # per low-rank section, its P and Q rounds with a compressed factor (None: fp32 all-reduces)
    lowrank_rounds: tuple[tuple["BucketWire", "BucketWire"] | None, ...] = ()
    # per low-rank section, its warm-up: (start, the wire of its gradients as one int8 tensor or None
    # when start is 0); steps before ``start`` send that instead of the factor rounds
    lowrank_start: tuple[tuple[int, "BucketWire | None"], ...] = ()

    def lowrank_bytes(self, rank: int | None = None, step: int | None = None) -> int:
        """Bytes ``rank`` sends in the bucket's factor rounds (two per low-rank section): a plain fp32
        all-reduce of each factor, or the compressed all-reduce of one tensor in the factor codec, as
        :class:`fastml_strategy.comm._lowrank.LowRankSection` counts them. ``step``: at a step before a
        section's ``start``, its warm-up's bytes instead (None: the steady state, after every start)."""
        W = self.world_size
        if W <= 1:
            return 0
        total = 0
        starts = self.lowrank_start or ((0, None),) * len(self.lowrank)
        for (f, pn, qn), rounds, (start, warm) in zip(self.lowrank, self.lowrank_rounds, starts):
            if step is not None and step < start:
                total += warm.bytes_sent(rank)
            elif rounds is None:
                total += sum(int(round(2.0 * (W - 1) / W * n * 4)) for n in (pn, qn))
            else:
                total += sum(w.bytes_sent(rank) for w in rounds)
        return total

    def rounds(self) -> int:
        """The bucket's collectives that wait for each other (latency rounds): two per piece (one
        for a plain bucket), plus two per low-rank section (four with compressed factors)."""
        if self.uncompressed:
            return 1
        return 2 * len(self.pieces) + sum(2 if f is None else 4 for f, _, _ in self.lowrank)

    def bytes_sent(self, rank: int | None = None, step: int | None = None) -> int:
        """Bytes ``rank`` sends for this bucket per step, headers included, as
        :attr:`fastml_strategy.collective.CompressedAllReduce.bytes_sent` counts them (None: the
        mean over ranks, rounded); ``step``: at that step (a low-rank section's warm-up differs),
        None: the steady state."""
        W = self.world_size
        if W <= 1:
            return 0
        if self.uncompressed:
            return int(round(2.0 * (W - 1) / W * self.numel * self.elem_size))
        return int(round(sum(p.bytes_sent(rank) for p in self.pieces))) + self.lowrank_bytes(rank, step)


def _dense_groups(codecs: Any, numels, groups, W: int) -> list[GroupWire]:
    out = []
    for cfg, idx in groups:
        offsets = [0]
        for i in idx:
            offsets.append(offsets[-1] + numels[i])
        length = offsets.pop()
        bounds = chunk_bounds(length, codecs.codec_for(cfg).chunk_unit(), W)
        out.append(GroupWire(cfg, tuple(idx), tuple(offsets), length, tuple(bounds),
                             tuple(codecs.chunk_nbytes(b - a, cfg) for a, b in zip(bounds[:-1], bounds[1:]))))
    return out


def _segments(codecs: Any, dense: Sequence[GroupWire], W: int, piece_numel: int) -> list[SegmentWire]:
    """Each group's pipeline segments (:func:`piece_slices`), in bucket order, each cut into W chunks."""
    segs = []
    for gi, g in enumerate(dense):
        codec = codecs.codec_for(g.config)
        unit = codec.chunk_unit()
        slices = piece_slices(g.length, unit, piece_numel)
        if len(slices) == 1:
            segs.append(SegmentWire(gi, g.bounds, g.nbytes, True))
            continue
        sizes: dict[int, int] = {}  # chunks of a slice take one or two sizes: size each once
        for lo, hi in slices:
            b = [lo + x for x in chunk_bounds(hi - lo, unit, W)]
            nb = tuple(sizes[n] if n in sizes else sizes.setdefault(n, codec.nbytes(n))
                       for n in map(operator.sub, b[1:], b[:-1]))
            segs.append(SegmentWire(gi, tuple(b), nb, False))
    return segs


def _pieces(segs: Sequence[SegmentWire], topk: Sequence[int], topk_nbytes: Sequence[int], W: int,
            piece_numel: int) -> list[PieceWire]:
    """The segments packed into pieces (:func:`pack_pieces`), each with its messages; the bucket's
    top-k messages travel in the last piece's all_gather, after the largest reduced chunk."""
    runs = pack_pieces([s.length for s in segs], piece_numel)
    pieces = []
    for k, run in enumerate(runs):
        sizes, offsets = message_offsets([segs[i].nbytes for i in run], W)
        top = tuple(topk) if k == len(runs) - 1 else ()
        pos = max(sizes)
        top_off = []
        for i in top:
            top_off.append(pos)
            pos += topk_nbytes[topk.index(i)]
        pieces.append(PieceWire(tuple(sizes), pos, tuple((segs[i].group, segs[i].length) for i in run), top,
                                tuple(run), tuple(map(tuple, offsets)), tuple(top_off)))
    return pieces


@functools.lru_cache(maxsize=65536)
def bucket_wire(codecs: Any, numels: tuple[int, ...], planned: tuple[CodecConfig, ...], world_size: int,
                dtype: Any = "fp32", piece_numel: int = PIECE_NUMEL, shapes: tuple | None = None) -> BucketWire:
    """The layout of a bucket of parameters of ``numels`` elements (bucket order) whose plan names
    ``planned``, at ``world_size`` ranks, for gradients of ``dtype`` (a torch dtype, handed to
    ``codecs.wire_config`` as it is; the default ``"fp32"`` sends uncompressed tensors as they are): the groups (:func:`bucket_groups`), their chunks and pipeline segments, the
    pieces and every message's size and offsets, headers included. The runtime's
    :class:`~fastml_strategy.comm._layouts.BucketLayout` is built from it; the cost model prices it (cached:
    a search asks for the same buckets again). ``shapes``: the parameters' shapes (what a low-rank
    layer's factors are sized by; None: flat)."""
    W = world_size
    cfgs, groups, topk, uncompressed, lowrank = bucket_groups(codecs, numels, planned, W, dtype, shapes)
    piece_numel = max(1, int(piece_numel))
    dense = _dense_groups(codecs, numels, groups, W)
    segs = _segments(codecs, dense, W, piece_numel)
    topk_nbytes = tuple(codecs.chunk_nbytes(numels[i], cfgs[i]) for i in topk)
    pieces = _pieces(segs, topk, topk_nbytes, W, piece_numel)
    sections = lowrank_sections(codecs, cfgs, lowrank, shapes) if lowrank else []
    rounds = tuple(None if f is None else tuple(bucket_wire(codecs, (n,), (f,), W) for n in (pn, qn))
                   for f, _, pn, qn in sections)
    starts = tuple(_section_start(codecs, cfgs, idx, numels, W) for _, idx, _, _ in sections)
    return BucketWire(W, int(sum(numels)), itemsize(dtype), uncompressed, tuple(cfgs),
                      tuple(tuple(idx) for _, idx in groups), tuple(pieces),
                      tuple((f, pn, qn) for f, _, pn, qn in sections), tuple(dense), tuple(segs), tuple(topk),
                      topk_nbytes, tuple(tuple(idx) for _, idx, _, _ in sections), rounds, starts)


def _section_start(codecs: Any, cfgs: Sequence[CodecConfig], idx: Sequence[int], numels: Sequence[int], W: int):
    """A low-rank section's warm-up: (start, the wire of its layers' gradients as one tensor in the
    codec's warm-up codec, or None at start 0)."""
    start = cfgs[idx[0]].start
    if not start:
        return 0, None
    return start, bucket_wire(codecs, (int(sum(numels[i] for i in idx)),), (codecs.codec_for(cfgs[idx[0]]).start_cfg,), W)


@dataclass(frozen=True)
class HierParts:
    """A bucket cut for the hierarchical all-reduce (:mod:`fastml_strategy.hierarchical`) over
    ``ranks_per_node`` ranks of a machine: ``bounds[i]``, parameter i's part boundaries (part l:
    local rank l's, :func:`part_bounds_of`); local rank l's *row* is its part of every parameter, in
    bucket order, empty parts left out (``copies``: (row, offset in the row, parameter index,
    offset in the parameter, elements)); rows are padded to ``row_numel`` for the all_to_all and
    the all-gather inside the machine."""

    ranks_per_node: int
    bounds: tuple[tuple[int, ...], ...]
    copies: tuple[tuple[int, int, int, int, int], ...]
    row_len: tuple[int, ...]

    @property
    def row_numel(self) -> int:
        return max(1, max(self.row_len))

    @property
    def parts(self) -> tuple[tuple[int, ...], ...]:
        """``parts[l][i]``: the elements of parameter i in local rank l's row (0: none)."""
        return tuple(tuple(b[l + 1] - b[l] for b in self.bounds) for l in range(self.ranks_per_node))

    def row(self, local_rank: int) -> list[tuple[int, int, int]]:
        """Local rank ``local_rank``'s row: (parameter index, offset in the row, elements)."""
        return [(i, roff, n) for j, roff, i, _, n in self.copies if j == local_rank]


def hier_parts(codecs: Any, planned: Sequence[CodecConfig], numels: Sequence[int], ranks_per_node: int) -> HierParts:
    """The parts and rows of a bucket of parameters of ``numels`` elements whose plan names
    ``planned`` (each looked up for the whole parameter) over ``ranks_per_node`` ranks."""
    R = ranks_per_node
    row_len = [0] * R
    bounds, copies = [], []
    for i, (cfg, n) in enumerate(zip(planned, numels)):
        b = part_bounds_of(codecs, cfg, int(n), R)
        bounds.append(tuple(b))
        for j in range(R):
            m = b[j + 1] - b[j]
            if m > 0:
                copies.append((j, row_len[j], i, b[j], m))
                row_len[j] += m
    return HierParts(R, tuple(bounds), tuple(copies), tuple(row_len))
