"""A compressed all-reduce whose latency grows as log N: recursive halving, then recursive doubling, on
the chunks of :mod:`fastml_strategy.collective`'s layouts, and the alpha-beta choice between it and
the ring schedule (the same function for the runtime and the autotuner's cost model).

Why
---
The ring schedule of :class:`~fastml_strategy.collective.CompressedAllReduce` (an ``all_to_all`` of
the encoded chunks, then an ``all_gather`` of the re-encoded sums) sends ``2(N-1)/N`` of the
compressed size ``S_c`` per rank, the bandwidth optimum, but the cost model charges it ``2(N-1)``
latency rounds per pipeline piece: 30 ms per piece at N = 16 on a 1 ms link. NCCL switches from ring
to tree algorithms for the same reason. Recursive halving/doubling (Rabenseifner's all-reduce) keeps
the bandwidth term and needs ``2 log2 N`` rounds.

Algorithm (one pipeline piece; ``P``: the largest power of two <= N, ``E = N - P``)
----------------------------------------------------------------------------------
0. Every rank encodes every chunk of the piece with error feedback, exactly as the ring schedule's
   first stage (:meth:`~fastml_strategy.comm._exchange.ChunkExchange._encode_group`): the residual is
   ``input - decode(own encoding)``, so the error-feedback invariant is the ring's.
1. Fold-in (only when N is not a power of two): of ranks ``0 .. 2E-1``, each even rank sends its whole
   encoded piece to the odd rank above it and takes no further part until step 5; the odd rank decodes
   both (its own first, then the partner's) and sums them in fp32. The ``P`` remaining ranks get the
   virtual ranks ``0 .. P-1``.
2. Recursive halving, ``log2 P`` rounds. Each virtual rank holds a range of the piece's N chunks (at
   first all of them). In round ``t`` it pairs with ``v XOR P/2^(t+1)``; the range is halved, the lower
   virtual rank keeping the lower half; each sends the half it gives up and receives the partner's
   version of the half it keeps, decodes it and adds it, in fp32, to its own partial sum (kept in the
   bucket buffer itself, or the group's fp32 staging vector). What travels is always an encoding: in
   round 0 a rank's own first-stage bytes (it decodes its own kept half, so its contribution is exactly
   what its error feedback accounts for); afterwards the partial sums, *re-encoded* with the chunk's
   codec. Chunk c keeps the ring's message layout ``[header | group 0 chunk c | group 1 chunk c |
   ...]``, so a range of chunks is one contiguous slice of the piece's send buffer.
3. The owner of a final range divides its sums by N (or the caller's divisor), re-encodes them (as
   the ring schedule's owner does) and decodes its own re-encoding back into the buffer: the owner
   uses the decoded version, like every other rank.
4. Recursive doubling, the rounds of 2 in reverse: each rank sends the re-encoded chunks of its range
   and receives the partner's, unchanged, into the same offsets of its buffer (which ends holding the
   piece's whole re-encoded message), and decodes them. Every rank decodes the same bytes for every
   chunk, so replicas stay bit-identical.
5. Unfold: the odd ranks of step 1 send the whole re-encoded piece to their even partner, which
   decodes it.

Traffic and rounds: a rank of the ``P`` sends ``(P-1)/P`` of the piece in each of the two phases, the
ring schedule's ``2(N-1)/N`` when N is a power of two (chunks are the ring's, so a range's bytes are
exact sums of the ring's chunk messages; with N not a power of two the ``N`` chunks split unevenly
over ``P`` owners). The fold adds one piece each way on ``E`` links: ``2 + 2 log2 P`` rounds and about
``(2 + 2(P-1)/P) S_c`` on the busiest link. Headers: one per chunk message, as in the ring schedule.

Error: the intermediate re-encodes
----------------------------------
The ring schedule quantizes each chunk twice: every rank's input (error feedback corrects it over
steps) and the owner's mean (uncorrected, one rounding of scale/2 per block of the mean). Here the
first and the last are the same, and each chunk also passes ``log2 P - 1`` intermediate re-encodes of
a partial sum of ``2, 4, ..., P/2`` ranks' contributions (plus one of 2 contributions on a folded
rank), which no residual sees: deterministic rounding adds at most scale/2 per block of each partial
sum (a partial sum of k ranks has about k x the range of one, so the added error is about
``(2 + 4 + ... + P/2) / P < 1`` times the final rounding's in relative terms, summed over the rounds:
at most twice the ring schedule's uncorrected error); stochastic rounding keeps each unbiased.
fp32/fp16/bf16 casts re-round the partial sums in their own precision; fp32 is exact up to the order
of summation (``none`` forced through it equals DDP to about 1e-7 relative).

Where it does not apply
-----------------------
A bucket with a top-k layer keeps the ring schedule (top-k messages are all-gathered, not reduced;
re-sparsifying partial sums would change what top-k means). A bucket with nothing to compress keeps
DDP's own plain all-reduce (gloo's algorithm) unless the plan forces ``"halving"``, which then runs
its fp32 (or 16-bit) values through these rounds. The FSDP reduce-scatter
(:mod:`fastml_strategy.comm._reduce_scatter`) is one all_to_all and stays so.

The choice (:func:`choose_schedule`)
------------------------------------
Per bucket, from alpha-beta terms: ring ``2(N-1) a + bytes / B`` per piece (the cost model's ring
price, :mod:`fastml_strategy.autotune.costmodel.ddp`), halving ``a + max message / B`` per round
(:func:`halving_rounds`). ``Plan.schedule``: ``"auto"`` (default) picks the cheaper, ``"ring"`` or
``"halving"`` force one. ``a`` and ``B`` come from ``Plan.link_latency_us`` and ``Plan.link_gbps``
(defaults :data:`DEFAULT_LATENCY_US`, :data:`DEFAULT_GBPS`). N = 2 always runs the ring under
``"auto"`` (the two are the same two rounds). Halving's codec work (about ``2 - 1/(2P)`` round trips
of the piece, serial with its rounds, where the ring pipelines its pieces' codec work under their
messages) is charged in the choice at :data:`CODEC_BPS` (:func:`halving_codec_seconds`), so halving
runs only where the latency rounds it saves outweigh its serial re-encodes. For a bucket of 1M int4
elements that is from 128 ranks at the default hint (50 us, 10 Gbit/s), from 16 at 0.5 ms and
1 Gbit/s, from 8 at 5 ms and 100 Mbit/s (bench_scale measured the ring faster at 4 and 8 machines
on 1 Gbit/s + 0.5 ms, and the two even at 16: benchmarks/RESULTS.md). The plan is agreed across ranks (its digest covers the
schedule and the hint), so every rank makes the same choice; the cost model calls this function on
the same message sizes, and the autotuner writes the option's link into the plans it makes.

Errors travel in the headers as in the ring schedule (:mod:`fastml_strategy.comm._status`), with one
difference: a rank receives the headers of its partners only, so each rank keeps a merged status (the
lowest failing rank it has heard of) and writes it into every header it sends; halving and doubling
each sweep every dimension of the hypercube, so at the end every rank holds the same status and
raises the same :class:`~fastml_strategy.CompressionError`. A rank that dies or stalls blocks only its
partners: the DDP hook therefore waits through a :class:`~fastml_strategy.comm._peers.FailureChannel`
(CPU) whenever the plan may run this schedule, so every other rank hears of the first failure.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fastml_strategy import codecs
from fastml_strategy.comm._status import HEADER, write_header
from fastml_strategy.config import SCHEDULES
# The schedule's shape and the choice (tensor-free: the cost model prices the same functions)
from fastml_strategy.wire.schedule import (CODEC_BPS, DEFAULT_GBPS, DEFAULT_LATENCY_US,  # noqa: F401
                                           Fold, _starts, choose_schedule, chunk_ranges, fold,
                                           halving_bytes_sent, halving_codec_seconds, halving_messages,
                                           halving_node_bytes, halving_piece_seconds, halving_rounds, link_hint,
                                           may_halve, real_rank, ring_bytes, ring_piece_seconds)

__all__ = ["SCHEDULES", "DEFAULT_LATENCY_US", "DEFAULT_GBPS", "Fold", "fold", "chunk_ranges",
           "ring_piece_seconds", "halving_rounds", "halving_piece_seconds", "halving_bytes_sent", "halving_messages", "halving_node_bytes",
           "ring_bytes", "halving_codec_seconds", "choose_schedule", "may_halve", "link_hint", "HalvingRun"]

# -- the runtime ----------------------------------------------------------------------------------------
def _merge(state: torch.Tensor, headers: torch.Tensor) -> None:
    """Keep in ``state`` (one header) the lowest failing rank among it and ``headers`` (k x HEADER),
    on the device (no host read)."""
    cand = torch.cat([state.view(1, HEADER), headers])
    words = cand[:, :8].contiguous().view(torch.int32)
    bad = words[:, 0] != 0
    key = torch.where(bad, words[:, 1].to(torch.int64), torch.full_like(words[:, 1], 2 ** 31 - 1).to(torch.int64))
    state.copy_(cand.index_select(0, key.argmin().view(1))[0])


class HalvingRun:
    """One bucket through recursive halving/doubling (module docstring), on the engine's group and
    with its layouts, residual store, seeds, waits and statistics (``eng``: a
    :class:`~fastml_strategy.collective.CompressedAllReduce`). Every rank issues the same
    point-to-point messages in the same order; nothing is read on the host."""

    def __init__(self, eng, lay, buf: torch.Tensor, step: int, layer_stats: bool, checks,
                 baseline_elem_size: int, divisor: float | None) -> None:
        from fastml_strategy.comm._exchange import mix

        self.eng, self.lay, self.buf, self.checks = eng, lay, buf, checks
        self.layer_stats, self.baseline_elem_size = layer_stats, baseline_elem_size
        self.div = eng.world_size if divisor is None else divisor
        self.base = mix(eng.plan.seed, step, eng.rank)
        self.fold = fold(eng.world_size, eng.rank)
        self.state = torch.zeros(HEADER, dtype=torch.uint8, device=buf.device)
        self.finite: list[torch.Tensor] = []
        self.stats: dict[int, list] = {}

    # -- messages --------------------------------------------------------------------------------------
    def _peer_op(self, op, tensor: torch.Tensor, peer: int):
        return op(tensor, group=self.eng.group, group_dst=peer) if op is dist.isend else \
            op(tensor, group=self.eng.group, group_src=peer)

    def _exchange(self, piece, peer: int, send: tuple[int, int] | None, recv: tuple[int, int] | None,
                  into: torch.Tensor) -> None:
        """Send chunks ``send`` of ``piece.send`` to ``peer`` and receive chunks ``recv`` from it into
        the same offsets of ``into``; the headers sent carry the merged status, those received are
        merged into it."""
        st, eng = piece.hstarts, self.eng
        works = []
        if recv is not None:
            works.append(self._peer_op(dist.irecv, into[st[recv[0]]: st[recv[1]]], peer))
        if send is not None:
            self._stamp(piece, send)
            works.append(self._peer_op(dist.isend, piece.send[st[send[0]]: st[send[1]]], peer))
            eng.bytes_sent += st[send[1]] - st[send[0]]
        for w in works:
            eng.wait(w)
        if recv is not None:
            _merge(self.state, torch.stack([into[st[c]: st[c] + HEADER] for c in range(*recv)]))

    def _stamp(self, piece, chunks: tuple[int, int]) -> None:
        if self.checks.error is not None:
            own = torch.zeros(HEADER, dtype=torch.uint8, device=self.state.device)
            write_header(own, self.checks.error, self.eng.report_rank)
            _merge(self.state, own.view(1, HEADER))
        for c in range(*chunks):
            at = piece.hstarts[c]
            piece.send[at: at + HEADER].copy_(self.state)

    # -- codec work ------------------------------------------------------------------------------------
    def _guard(self, fn, *args) -> None:
        if self.checks.error is None:
            try:
                fn(*args)
            except Exception as e:  # noqa: BLE001 - forwarded to every rank in the headers
                self.checks.error = e

    def _encode(self, piece) -> None:
        eng = self.eng
        for g in piece.dense:
            e2, n2 = eng._encode_group(piece, g, self.buf, self.base, self.layer_stats)
            acc = self.stats.setdefault(id(g.base), [g.base, 0.0, 0.0])
            acc[1] = acc[1] + e2
            acc[2] = acc[2] + n2

    def _decode(self, piece, src: torch.Tensor, chunks: tuple[int, int], accumulate: bool,
                finite: bool = False) -> None:
        """Decode chunks ``[a, b)`` of message buffer ``src`` (the piece's chunk layout) into the
        partial sums (``+=`` with ``accumulate``)."""
        for g in piece.dense:
            for c in range(*chunks):
                n = g.bounds[c + 1] - g.bounds[c]
                enc = src[g.send_off[c]: g.send_off[c] + g.nbytes[c]]
                codecs.decode_chunk(enc, n, g.cfg, g.chunk(self.buf, c), accumulate=accumulate)
                if finite:
                    self.finite.append(codecs.chunk_finite(enc, n, g.cfg))

    def _reencode(self, piece, chunks: tuple[int, int], stage: int, divide: bool = False) -> None:
        from fastml_strategy.comm._exchange import mix

        for g in piece.dense:
            for c in range(*chunks):
                x = g.chunk(self.buf, c)
                if divide and self.div != 1:
                    x.div_(self.div)
                out = piece.send[g.send_off[c]: g.send_off[c] + g.nbytes[c]]
                codecs.encode_chunk(x, g.cfg, out, seed=mix(self.eng._seed(self.base, 3, g, c), stage))

    # -- the schedule ----------------------------------------------------------------------------------
    def run_piece(self, piece, before=None) -> None:
        W, f = self.eng.world_size, self.fold
        if not hasattr(piece, "hstarts"):
            piece.hstarts = _starts(piece.split_sizes)
        whole = (0, W)
        self._guard(self._encode, piece)
        if f.folded:  # 1. and 5.: send everything to the partner, receive the result
            self._exchange(piece, f.partner, whole, None, piece.send)
            if before is not None:
                before()
            self._exchange(piece, f.partner, None, whole, piece.send)
            self._finish_decode(piece, whole)
            return
        fresh = True  # piece.send holds this rank's own first-stage encodings (nothing summed yet)
        scratch = self._scratch(piece)
        if f.partner >= 0:
            self._exchange(piece, f.partner, None, whole, scratch)
            self._guard(self._decode, piece, piece.send, whole, False)
            self._guard(self._decode, piece, scratch, whole, True)
            fresh = False
        ranges = chunk_ranges(W, f.P, f.vrank)
        for t, (keep, give) in enumerate(ranges):  # 2. recursive halving
            peer = real_rank(W, f.vrank ^ (f.P >> (t + 1)))
            if not fresh:
                self._guard(self._reencode, piece, give, t)
            self._exchange(piece, peer, give, keep, scratch)
            if t == 0 and before is not None:
                before()
            if fresh:
                self._guard(self._decode, piece, piece.send, keep, False)
                fresh = False
            self._guard(self._decode, piece, scratch, keep, True)
        mine = ranges[-1][0] if ranges else whole
        self._guard(self._reencode, piece, mine, len(ranges), True)  # 3. the owner's mean
        self._decode_final(piece, mine)
        for t in reversed(range(len(ranges))):  # 4. recursive doubling
            keep, give = ranges[t]
            peer = real_rank(W, f.vrank ^ (f.P >> (t + 1)))
            self._exchange(piece, peer, keep, give, piece.send)
            self._decode_final(piece, give)
        if f.partner >= 0:  # 5. unfold
            self._exchange(piece, f.partner, whole, None, piece.send)
        self._finish_groups(piece)

    def _decode_final(self, piece, chunks: tuple[int, int]) -> None:
        if self.checks.error is None and self.checks.decode_error is None:
            try:
                self._decode(piece, piece.send, chunks, False, finite=True)
            except Exception as e:  # noqa: BLE001 - this rank's alone
                self.checks.decode_error = e

    def _finish_decode(self, piece, chunks) -> None:
        self._decode_final(piece, chunks)
        self._finish_groups(piece)

    def _finish_groups(self, piece) -> None:
        if self.checks.error is None and self.checks.decode_error is None:
            for g in piece.dense:
                if not g.direct:
                    g.scatter(self.buf)

    def _scratch(self, piece) -> torch.Tensor:
        t = getattr(piece, "hrecv", None)
        if t is None or t.numel() != piece.send_size or t.device != piece.send.device:
            t = piece.hrecv = torch.zeros(piece.send_size, dtype=torch.uint8, device=piece.send.device)
        return t

    def run(self, before=None) -> None:
        eng, W = self.eng, self.eng.world_size
        for k, piece in enumerate(self.lay.pieces):
            self.run_piece(piece, before if k == 0 else None)
        # every rank holds the same merged status: one entry of W copies, as resolve() reads them
        self.checks.add_headers("encoding", [self.state] * W)
        if self.finite:
            self.checks.add_finite(torch.stack(self.finite).all())
        for g, e2, n2 in self.stats.values():
            eng._record_error(g, e2, n2, self.layer_stats)
        eng.bytes_uncompressed += 2.0 * (W - 1) / W * self.baseline_elem_size * self.lay.total_numel
