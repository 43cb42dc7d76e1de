"""FastML's compressed all-reduce of one DDP bucket: scatter-reduce-allgather for dense codecs,
all_gather for top-k, two collectives per pipeline piece in a fixed order.

Algorithm (per bucket, on every rank; W ranks, this one ``r``)
--------------------------------------------------------------
1. Split the bucket by parameter (:class:`~fastml_strategy.comm._layouts.BucketLayout`). Each compressed
   layer (fp16 / bf16 / quantize) is a segment of its own, encoded straight from the bucket buffer and
   decoded straight back into it (no gather or scatter copies when the buffer is fp32), cut into W
   chunks on its codec's unit (a quantization block never mixes two layers' scales). Small tensors
   (under ``plan.min_numel``) and fp32 layers are gathered into one fp32 segment: one message part
   for all of them.
2. Error feedback: the quantizer reads ``grad + residual`` and writes the new residual into a second
   buffer; the two are swapped only when the result is finite (:mod:`fastml_strategy.comm._residuals`). The
   hook commits a whole step at once: a NaN/inf in any bucket, which makes GradScaler skip the step,
   leaves every residual untouched. Residuals are keyed by parameter name and move to the new layout
   when DDP rebuilds its buckets after the first iteration.
3. ``all_to_all_single``: rank j receives every rank's encoded chunk j (the stage this module shares
   with the reduce-scatter, :mod:`fastml_strategy.comm._exchange`). Each rank decodes the W copies of its
   chunk in rank order, sums them in fp32, divides by W, and re-encodes the mean.
4. ``all_gather`` of [the re-encoded mean chunk | this rank's top-k values and indices]. Every rank,
   the chunk's owner included, decodes the same bytes in the same order, so replicas stay
   bit-identical. Top-k messages are scatter-added in rank order, then divided by W.

Pipelining (:class:`~fastml_strategy.comm._layouts.BucketLayout` ``pieces``): steps 3 and 4 run per piece
of about :data:`PIECE_NUMEL` elements, not per bucket. A group longer than that is cut into slices on
codec-unit boundaries, each slice into W chunks of its own; small groups share a piece. Every rank
issues the pieces' collectives asynchronously in one fixed order (all_to_all 0, all_to_all 1,
all_gather 0, all_to_all 2, all_gather 1, ...), so that while piece k is on the wire, piece k+1 is
encoded and piece k-1 decoded. Every block holds the same elements as without pieces, and each
element is summed over the ranks in the same order, so a deterministic codec gives bit for bit the
result of one piece (stochastic rounding draws other, equally distributed numbers for a slice).
Across buckets (:meth:`CompressedAllReduce.start`): the DDP hook holds a bucket's tail (the wait for
its last all_gather and that piece's decode, no collective) until the next queued bucket's first
all_to_all is on the wire, so the wire does not idle while one bucket is decoded and the next encoded.

Segment tables (:class:`_SegmentTables`, on CUDA with the Triton backend; ``segment_tables``): the
layers of a piece whose codec has segment tables (quantize) and that read from and decode into an
fp32 bucket buffer are encoded (with error feedback), summed (the W copies of this rank's chunks),
re-encoded and decoded by one launch per stage and codec config, each program reading one row of a
table built once per layout (offsets from the codec's chunk layout), instead of one launch per chunk
and layer. Their residuals are views of two flat buffers of the layout (swapped together at commit),
their chunk sums of one buffer per piece. Same bytes as the per-chunk path
(tests/test_segment_tables_dist.py).

Per-rank traffic of a dense codec is 2(W-1)/W of its encoded size, as for a ring all-reduce; a top-k
layer costs (W-1) messages, which is why :func:`fastml_strategy.codecs.effective_config` falls back to
a dense codec past the world size where that stops paying.

Errors and host reads: every message starts with a 64-byte status header, and the step's checks stay
on the device until one host read at its end (:mod:`fastml_strategy.comm._status`). In a pipelined bucket a
failing rank sends error headers for the rest of the step and every rank completes every collective
of the bucket before raising, so none is left pending.

The compressed reduce-scatter of an FSDP unit (step 3 alone) is
:class:`fastml_strategy.comm._reduce_scatter.CompressedReduceScatter`.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from fastml_strategy import codecs
from fastml_strategy.comm._exchange import ChunkExchange, mix
from fastml_strategy.comm._halving import HalvingRun, choose_schedule, link_hint
from fastml_strategy.comm._layouts import PIECE_NUMEL, BucketLayout, _DenseGroup, _Piece, _table_group, layer_key
from fastml_strategy.comm._status import StepChecks, all_finite, host, resolve
from fastml_strategy.config import Plan

# The errors and the header size users and callers know from here (defined with the header protocol).
from fastml_strategy.comm._status import HEADER, CompressionError, DecodeError, host_reads  # noqa: F401

__all__ = ["BucketLayout", "CompressedAllReduce", "CompressionError", "DecodeError", "StepChecks", "host_reads",
           "PIECE_NUMEL", "HEADER"]


def _finite(t: torch.Tensor) -> bool:
    """Whether every element of ``t`` is finite, read on the host."""
    return bool(host(all_finite(t)))


class _SegmentTables:
    """The segment tables of one piece and one codec config (for quantize: bits, block size, rounding,
    error feedback): one launch per stage for all its layers' chunks instead of one per chunk
    (:meth:`fastml_strategy.codecs.QuantizeCodec.encode_table` and the methods beside it). Offsets
    are fixed for the layout's life; only stochastic rounding's seeds change per step."""

    def __init__(self, piece: _Piece, groups: list[_DenseGroup], W: int, r: int, device) -> None:
        codec = groups[0].codec
        self.codec, self.groups = codec, groups
        self.stochastic, self.ef = codec.cfg.stochastic, codec.cfg.uses_residual
        enc, red, dec = [], [], []
        self.enc_chunks: list[tuple[_DenseGroup, int]] = []  # (group, j) per encode-table chunk
        for g in groups:
            base = g.base
            for j in range(W):
                a, b = g.bounds[j], g.bounds[j + 1]
                roff = base.res_off + a if self.ef else 0
                enc.append((g.chunk_base[j], roff, roff, g.send_off[j], b - a))
                self.enc_chunks.append((g, j))
                dec.append((j * piece.gather_size + g.gather_off[j], g.chunk_base[j], b - a))
            red.append((g.recv_off, g.acc_off, g.bounds[r + 1] - g.bounds[r]))
        reenc = [(g.acc_off, 0, 0, g.gather_off[r], g.bounds[r + 1] - g.bounds[r]) for g in groups]
        self.enc, self.reenc = codec.encode_table(enc, device), codec.encode_table(reenc, device)
        self.enc_numels, self.reenc_numels = [c[-1] for c in enc], [c[-1] for c in reenc]
        self.red, self.dec = codec.decode_table(red, device), codec.decode_table(dec, device)


class CompressedAllReduce(ChunkExchange):
    """Runs FastML's compressed all-reduce of DDP buckets (:class:`BucketLayout`) on one process group
    (call from one thread only): :meth:`run`, or :meth:`start` and the tail it returns, then
    :meth:`finish` and :meth:`commit` per step."""

    def __init__(self, plan: Plan, group, rank: int, world_size: int,
                 piece_numel: int = PIECE_NUMEL) -> None:
        super().__init__(plan, group, rank, world_size)
        self.piece_numel = piece_numel  # elements per pipeline piece of a bucket (PIECE_NUMEL)
        # Triton segment tables for the quantized layers of fp32 buckets: one kernel launch per stage
        # and piece instead of one per chunk and layer. None: on CUDA when the Triton backend is used;
        # True: also for CPU tensors (the tests, through Triton's interpreter); False: never.
        self.segment_tables: bool | None = None
        # -- statistics: the buckets and pieces each schedule ran ("plain", "ring", "halving";
        # fastml_strategy.wire.schedule.choose_schedule), cumulative
        self.schedules: dict[str, dict[str, int]] = {}

    def layout_for(self, names, offsets, numels, device, dtype=torch.float32,
                   double_buffer: bool = True, persistent: bool = True,
                   plan_numels: Sequence[int] | None = None) -> BucketLayout:
        """The layout of a bucket of these parameters (built once per bucket shape; adopts residuals)."""
        key = (tuple(names), tuple(offsets), tuple(numels), dtype)
        lay = self.store.get(key)
        if lay is not None:
            return lay
        shapes = [self.shapes.get(n) for n in names] if self.shapes else None
        lay = BucketLayout(names, offsets, numels, self.plan, self.world_size, self.rank, device, dtype,
                           double_buffer=double_buffer, persistent=persistent, plan_numels=plan_numels,
                           piece_numel=self.piece_numel, shapes=shapes, q_store=self.lowrank_q)
        return self.store.adopt(key, lay)

    def _all_gather(self, lay: _Piece, async_op: bool = False):
        outs = list(lay.grecv.view(self.world_size, lay.gather_size).unbind(0))
        work = dist.all_gather(outs, lay.gsend, group=self.group, async_op=async_op)
        self.bytes_sent += (self.world_size - 1) * lay.gather_size
        return work

    # -- one bucket ----------------------------------------------------------------------------------------
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
        schedule = self.schedule_of(lay)
        self._count_schedule(lay, schedule)
        if schedule == "plain":
            if before is not None:
                before()
            self._plain_all_reduce(lay, buf, baseline_elem_size, checks, divisor)
            return None
        transient = lay.acquire()
        try:
            if lay.lowrank:  # the low-rank sections' factor rounds first (fastml_strategy.comm._lowrank)
                before = self._run_lowrank(lay, buf, step, layer_stats, checks, divisor, before)
            if schedule == "halving":
                HalvingRun(self, lay, buf, step, layer_stats, checks, baseline_elem_size, divisor).run(before)
                tail = None
            else:
                tail = _BucketRun(self, lay, buf, step, layer_stats, checks, baseline_elem_size, divisor).start(before)
        except BaseException:
            if transient:
                lay.release()
            raise
        if tail is None:
            if transient:
                lay.release()
            return None

        @torch.no_grad()
        def complete() -> None:
            try:
                tail()
            finally:
                if transient:
                    lay.release()

        return complete

    def _run_lowrank(self, lay: BucketLayout, buf: torch.Tensor, step: int, layer_stats: bool,
                     checks: StepChecks, divisor: float | None, before):
        """Run the bucket's low-rank sections (their P and Q rounds); returns ``before`` if it has not
        run yet (no section sent anything), else None."""
        for sec in lay.lowrank:
            sec.run(self, buf, step, checks, lay.q_store, self.plan.seed, divisor, before, layer_stats)
            before = None
        return before

    def use_channel(self, channel) -> None:
        """Wait for every collective through ``channel`` (:class:`fastml_strategy.comm._peers.FailureChannel`):
        in the halving schedule a rank meets only its partners, so a rank that died or stalled blocks
        the others until they hear of the first failure there (the hook sets one on CPU)."""
        self.wait = channel.wait

    def schedule_counts(self) -> dict[str, dict[str, int]]:
        """The buckets and pieces each schedule ran, cumulative (``stats()["schedules"]``)."""
        return {k: dict(v) for k, v in sorted(self.schedules.items())}

    def schedule_of(self, lay: BucketLayout) -> str:
        """The schedule of this bucket's all-reduce (:func:`fastml_strategy.wire.schedule.choose_schedule`:
        ``"plain"``, ``"ring"`` or ``"halving"``), from the plan's ``schedule`` and link hint and the
        layout's message sizes, which every rank shares; kept on the layout."""
        sched = getattr(lay, "schedule", None)
        if sched is None:
            pieces = [(p.split_sizes, p.gather_size) for p in lay.pieces]
            sched = lay.schedule = choose_schedule(getattr(self.plan, "schedule", "auto"), self.world_size, pieces,
                                                   bool(lay.topk), lay.uncompressed, *link_hint(self.plan))
        return sched

    def _count_schedule(self, lay: BucketLayout, schedule: str) -> None:
        row = self.schedules.setdefault(schedule, {"buckets": 0, "pieces": 0})
        row["buckets"] += 1
        row["pieces"] += 1 if schedule == "plain" else len(lay.pieces)

    @torch.no_grad()
    def finish(self, checks: StepChecks, device: torch.device | None = None, exchange: bool = False,
               stage: str = "decoding", plain: bool = True) -> bool:
        """Resolve what ``checks`` gathered (:func:`fastml_strategy.comm._status.resolve`: one host read;
        with ``exchange``, a 64-byte all_gather of each rank's decoding status first). The results of
        plain all-reduces are checked only with ``plain`` (the hook passes it when the step has
        compressed buckets, whose residuals a NaN holds back)."""
        return resolve(checks, self.group, self.world_size, self.report_rank, device, exchange, stage, plain,
                       wait=self.wait)

    def _plain_all_reduce(self, lay: BucketLayout, buf: torch.Tensor, baseline_elem_size: int,
                          checks: StepChecks, divisor: float | None = None) -> None:
        """A bucket with nothing to compress: exactly what DDP's own hook does (divide, then one
        all-reduce in the gradients' dtype), so ``none`` is DDP's result for every dtype (float64 too)
        and costs one collective; its finiteness is left to :meth:`finish` (``plain``). Waited for
        with :meth:`wait`, as every collective of the compressed path, so that a caller's failure
        channel (the hierarchical path, LocalSGD islands, HSDP on CPU) also stops this wait when a
        rank of another group fails."""
        W = self.world_size
        div = W if divisor is None else divisor
        if div != 1:
            buf.div_(div)
        if W > 1:
            self.wait(dist.all_reduce(buf, group=self.group, async_op=True))
        self.count_plain(lay.total_numel, buf, baseline_elem_size)
        checks.plain.append(buf)

    def count_plain(self, numel: int, buf: torch.Tensor, baseline_elem_size: int = 4) -> None:
        """Add a plain (ring) all-reduce of ``buf`` to the statistics, against ``numel`` elements of
        ``baseline_elem_size`` bytes."""
        W = self.world_size
        nbytes = buf.numel() * buf.element_size()
        sent = int(round(2.0 * (W - 1) / W * nbytes))
        self.bytes_sent += sent
        # the baseline scaled from the bytes counted as sent, so that a plain all-reduce against its
        # own dtype is a ratio of exactly 1 (no rounding below it)
        self.bytes_uncompressed += sent * (baseline_elem_size * numel) / nbytes if nbytes else 0.0

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
        them and returns None). Waited for with :meth:`wait` (a failure channel's, where one is set)."""
        W = self.world_size
        self.count_sparse(buf)
        if W > 1:
            self.wait(dist.all_reduce(buf, group=self.group, async_op=True))
            buf.div_(W)
        ok = all_finite(buf._values())
        if checks is None:
            return bool(host(ok))
        checks.add_finite(ok)
        return None

    def exchange_status(self, error: BaseException | None, stage: str, device: torch.device) -> None:
        """Every rank tells every other whether ``error`` happened on it (a 64-byte all_gather); if it
        did on any rank, every rank raises the same :class:`CompressionError`, naming the lowest."""
        checks = StepChecks()
        checks.decode_error = error
        self.finish(checks, device, exchange=True, stage=stage)


    def _reduce_own_chunks(self, piece: _Piece, base: int, tables: dict | None = None,
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

    def _decode_piece(self, lay: BucketLayout, piece: _Piece, buf: torch.Tensor,
                      checks: list[torch.Tensor], tables: dict | None = None,
                      divisor: float | None = None) -> None:
        """Decode one piece's all-gathered message into ``buf``, adding its finiteness checks."""
        W = self.world_size
        grecv = piece.grecv.view(W, piece.gather_size)
        if tables:
            for t in tables.values():
                checks.append(t.codec.decode_segments(piece.grecv, buf, t.dec))
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

    # -- segment tables: one launch per stage and piece for the layers whose codec has them -------------
    def _segment_tables_of(self, piece: _Piece, buf: torch.Tensor, layer_stats: bool) -> dict | None:
        if layer_stats:
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
                    by.setdefault(g.codec.table_key(), []).append(g)
            piece.tables = {key: _SegmentTables(piece, gs, self.world_size, self.rank, buf.device)
                            for key, gs in by.items()}
        return piece.tables or None

    def _table_encode(self, lay: BucketLayout, piece: _Piece, tables: dict, buf: torch.Tensor,
                      base: int) -> None:
        for t in tables.values():
            if t.stochastic:
                t.codec.set_table_seeds(t.enc[0], t.enc_numels, [self._seed(base, 0, g, j) for g, j in t.enc_chunks])
            res, res_out = (lay.res_flat[0], lay.res_flat[1]) if t.ef else (None, None)
            t.codec.encode_segments(buf, piece.send, t.enc, res, res_out)

    def _table_reduce(self, piece: _Piece, tables: dict, base: int, divisor: float) -> None:
        for t in tables.values():
            t.codec.decode_segments(piece.recv, piece.acc_flat, t.red, sources=self.world_size,
                                    src_stride=piece.my_chunk)
        piece.acc_flat[: piece.acc_table].div_(divisor)
        for t in tables.values():
            if t.stochastic:
                t.codec.set_table_seeds(t.reenc[0], t.reenc_numels, [self._seed(base, 1, g) for g in t.groups])
            t.codec.encode_segments(piece.acc_flat, piece.gsend, t.reenc)

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
            rest, _ = codecs.encode_topk_ef(g, t.cfg, out, res, seed=mix(base, 2, layer_key(p.name)))
            if layer_stats:
                self.layer_error[p.name] = torch.where(vn > 0, rest.norm() / vn, torch.zeros_like(vn))
            t.pending = rest if res is not None else None


class _BucketRun:
    """The pipeline of one bucket over its P pieces (:meth:`CompressedAllReduce.start`). Every rank
    issues the same collectives in the same order, whatever fails where: a2a 0, a2a 1, ag 0, a2a 2,
    ag 1, ..., ag P-1, so that

    - piece k+1 is encoded while piece k's all_to_all is on the wire,
    - piece k is reduced (decode W copies, sum, re-encode) and its all_gather issued,
    - piece k-1's all_gather is awaited and decoded into ``buf`` while pieces k and k+1 travel.

    Nothing here is read on the host. Errors travel in the headers: a rank whose encoding (or
    reduction) raised sends error headers from then on (for the rest of the step) and skips its work;
    the other ranks cannot know before the step's one host read (:meth:`CompressedAllReduce.finish`),
    so they decode and sum whatever the failing rank sent, which must be harmless (top-k indices are
    clamped, see :meth:`fastml_strategy.codecs.TopkCodec.add_to`). The headers each rank reads, in
    the same order on every rank, go to ``checks``, with the finiteness of the decoded chunks.
    Decoding into ``buf`` follows the last collective of its piece: an error there is this rank's
    alone (``checks.decode_error``; the ranks exchange it at the end of the step)."""

    def __init__(self, eng: CompressedAllReduce, lay: BucketLayout, buf: torch.Tensor, step: int,
                 layer_stats: bool, checks: StepChecks, baseline_elem_size: int, divisor: float | None) -> None:
        self.eng, self.lay, self.buf, self.checks = eng, lay, buf, checks
        self.layer_stats, self.baseline_elem_size, self.divisor = layer_stats, baseline_elem_size, divisor
        self.base = mix(eng.plan.seed, step, eng.rank)
        P = len(lay.pieces)
        self.finite: list[torch.Tensor] = []  # reduced to one check per bucket
        self.stats: dict[int, list] = {}  # id(group) -> [group, err2, nrm2] (a group's slices add up)
        self.a2a: list = [None] * P
        self.ag: list = [None] * P
        self.tables = [eng._segment_tables_of(piece, buf, layer_stats) for piece in lay.pieces]

    def start(self, before=None):
        """Issue the bucket's collectives; returns its tail (the last piece's decode and the bucket's
        bookkeeping). ``before`` runs once piece 0's all_to_all is issued."""
        P = len(self.lay.pieces)
        self.encode(0)
        if before is not None:
            before()
        for k in range(P):
            if k + 1 < P:
                self.encode(k + 1)
            self.reduce(k)
            if k > 0:
                self.decode(k - 1)
        return self.tail

    def encode(self, k: int) -> None:
        eng, piece, checks, tables = self.eng, self.lay.pieces[k], self.checks, self.tables[k]
        if checks.error is None:
            try:
                if tables:
                    eng._table_encode(self.lay, piece, tables, self.buf, self.base)
                for g in piece.dense:
                    if tables and _table_group(g):
                        continue
                    e2, n2 = eng._encode_group(piece, g, self.buf, self.base, self.layer_stats)
                    acc = self.stats.setdefault(id(g.base), [g.base, 0.0, 0.0])
                    acc[1] = acc[1] + e2
                    acc[2] = acc[2] + n2
                if piece.topk:
                    eng._encode_topk(self.lay, piece, self.buf, self.base, self.layer_stats)
            except Exception as e:  # noqa: BLE001 - forwarded to every rank in the headers
                checks.error = e
        for j in range(eng.world_size):
            eng._write_header(piece.send[piece.send_starts[j]:], checks.error)
        self.a2a[k] = eng._all_to_all(piece, async_op=True)

    def reduce(self, k: int) -> None:
        eng, piece, checks = self.eng, self.lay.pieces[k], self.checks
        eng.wait(self.a2a[k])
        checks.add_headers("encoding", [piece.recv[j * piece.my_chunk:] for j in range(eng.world_size)])
        if checks.error is None:
            try:
                eng._reduce_own_chunks(piece, self.base, self.tables[k], self.divisor)
            except Exception as e:  # noqa: BLE001
                checks.error = e
        eng._write_header(piece.gsend, checks.error)
        self.ag[k] = eng._all_gather(piece, async_op=True)

    def decode(self, k: int) -> None:
        eng, piece, checks = self.eng, self.lay.pieces[k], self.checks
        eng.wait(self.ag[k])
        checks.add_headers("reduction", [piece.grecv[j * piece.gather_size:] for j in range(eng.world_size)])
        if checks.error is None and checks.decode_error is None:
            try:
                eng._decode_piece(self.lay, piece, self.buf, self.finite, self.tables[k], self.divisor)
            except Exception as e:  # noqa: BLE001 - after the piece's last collective
                checks.decode_error = e

    def tail(self) -> None:
        eng, W = self.eng, self.eng.world_size
        self.decode(len(self.lay.pieces) - 1)
        if self.finite:
            self.checks.add_finite(torch.stack(self.finite).all())
        for g, e2, n2 in self.stats.values():
            eng._record_error(g, e2, n2, self.layer_stats)
        eng.bytes_uncompressed += 2.0 * (W - 1) / W * self.baseline_elem_size * self.lay.total_numel
