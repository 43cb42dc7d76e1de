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
   first stage (:meth:`~fastml_strategy._exchange.ChunkExchange._encode_group`): the residual is
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
(:mod:`fastml_strategy._reduce_scatter`) is one all_to_all and stays so.

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

Errors travel in the headers as in the ring schedule (:mod:`fastml_strategy._status`), with one
difference: a rank receives the headers of its partners only, so each rank keeps a merged status (the
lowest failing rank it has heard of) and writes it into every header it sends; halving and doubling
each sweep every dimension of the hypercube, so at the end every rank holds the same status and
raises the same :class:`~fastml_strategy.CompressionError`. A rank that dies or stalls blocks only its
partners: the DDP hook therefore waits through a :class:`~fastml_strategy._peers.FailureChannel`
(CPU) whenever the plan may run this schedule, so every other rank hears of the first failure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from fastml_strategy import codecs
from fastml_strategy._status import HEADER, write_header
from fastml_strategy.config import SCHEDULES

__all__ = ["SCHEDULES", "DEFAULT_LATENCY_US", "DEFAULT_GBPS", "Fold", "fold", "chunk_ranges",
           "ring_piece_seconds", "halving_rounds", "halving_piece_seconds", "halving_bytes_sent", "halving_messages", "halving_node_bytes",
           "ring_bytes", "halving_codec_seconds", "choose_schedule", "may_halve", "link_hint", "HalvingRun"]

# The link "auto" assumes when the plan names none: a data-centre TCP link (gloo's per-message cost on
# a 1-10 Gbit/s Ethernet is tens of microseconds). It matters only for N not a power of two (above 2
# halving has fewer rounds for the same bytes whatever the link; at 2 both are the same).
DEFAULT_LATENCY_US = 50.0
DEFAULT_GBPS = 10.0
# Encoded bytes a second of halving's serial re-encode and decode work, in the choice only. The CPU's
# figure on every device, so one choice serves the runtime and the cost model alike and errs towards
# the ring: int4 encode + error feedback ran at 0.58-0.76 GB/s of fp32 input on an AVX2 EPYC
# (DESIGN.md), 0.07-0.1 GB/s of encoded int4. Without this term "auto" chose halving at 4 and 8
# emulated machines on 1 Gbit/s + 0.5 ms, where it took 766-874 ms against the ring's 461 (N = 4) and
# 1443 against 942 (N = 8) (benchmarks/RESULTS.md, bench_scale).
CODEC_BPS = 1e8


# -- the schedule's shape (tensor-free: the cost model uses it too) ---------------------------------------
@dataclass(frozen=True)
class Fold:
    """How N ranks map onto the ``P`` (a power of two) ranks of the halving: ``vrank`` (-1: an even
    rank folded into ``partner``), ``partner`` (the folded rank of an odd rank below ``2E``, else
    -1)."""

    P: int
    vrank: int
    partner: int

    @property
    def folded(self) -> bool:
        return self.vrank < 0


def fold(W: int, rank: int) -> Fold:
    P = 1 << (W.bit_length() - 1)
    E = W - P
    if rank < 2 * E:
        if rank % 2 == 0:
            return Fold(P, -1, rank + 1)
        return Fold(P, rank // 2, rank - 1)
    return Fold(P, rank - E, -1)


def real_rank(W: int, v: int) -> int:
    """The rank of virtual rank ``v``."""
    P = 1 << (W.bit_length() - 1)
    E = W - P
    return 2 * v + 1 if v < E else v + E


def chunk_ranges(W: int, P: int, v: int) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Per halving round of virtual rank ``v``: (the range of chunks it keeps, the range it gives
    up), chunk indices ``[a, b)`` of the piece's ``W`` chunks."""
    lo, hi = 0, W
    out = []
    mask = P >> 1
    while mask:
        mid = lo + (hi - lo) // 2
        low, high = (lo, mid), (mid, hi)
        keep, give = (low, high) if not v & mask else (high, low)
        out.append((keep, give))
        lo, hi = keep
        mask >>= 1
    return out


def _starts(split_sizes: Sequence[int]) -> list[int]:
    s = [0]
    for n in split_sizes:
        s.append(s[-1] + n)
    return s


def halving_rounds(split_sizes: Sequence[int]) -> list[int]:
    """The bytes of the largest message of each round of one piece whose chunk messages are
    ``split_sizes`` (headers included), in order: the fold-in (if any), the halving rounds, the
    doubling rounds, the unfold. A round costs one latency plus its largest message."""
    W = len(split_sizes)
    if W <= 1:
        return []
    st = _starts(split_sizes)
    size = lambda r: st[r[1]] - st[r[0]]  # noqa: E731
    P = 1 << (W.bit_length() - 1)
    per_v = [chunk_ranges(W, P, v) for v in range(P)]
    L = len(per_v[0])
    halve = [max(size(per_v[v][t][1]) for v in range(P)) for t in range(L)]
    # doubling round t (reverse order): each sends the range it kept in halving round t
    double = [max(size(per_v[v][t][0]) for v in range(P)) for t in reversed(range(L))]
    edge = [st[-1]] if W != P else []
    return edge + halve + double + edge


def halving_bytes_sent(split_sizes: Sequence[int], rank: int | None = None) -> float:
    """Bytes ``rank`` sends for one piece (None: the mean over ranks), as the runtime counts them."""
    W = len(split_sizes)
    if rank is None:
        return sum(halving_bytes_sent(split_sizes, r) for r in range(W)) / W if W > 1 else 0
    return sum(b for _, b in halving_messages(split_sizes, rank))


def halving_messages(split_sizes: Sequence[int], rank: int) -> list[tuple[int, int]]:
    """(peer, bytes) of every message ``rank`` sends for one piece, in order."""
    W = len(split_sizes)
    st = _starts(split_sizes)
    f = fold(W, rank)
    if W <= 1:
        return []
    if f.folded:
        return [(f.partner, st[-1])]
    ranges = chunk_ranges(W, f.P, f.vrank)
    peers = [real_rank(W, f.vrank ^ (f.P >> (t + 1))) for t in range(len(ranges))]
    out = [(p, st[g[1]] - st[g[0]]) for p, (_, g) in zip(peers, ranges)]
    out += [(p, st[k[1]] - st[k[0]]) for p, (k, _) in reversed(list(zip(peers, ranges)))]
    if f.partner >= 0:
        out.append((f.partner, st[-1]))
    return out


def halving_node_bytes(split_sizes: Sequence[int], ranks_per_node: int) -> float:
    """Bytes leaving each machine (the mean over machines) for one piece when machines hold
    ``ranks_per_node`` consecutive ranks (the flat schedule on several ranks per machine)."""
    W, A = len(split_sizes), ranks_per_node
    out = sum(b for r in range(W) for p, b in halving_messages(split_sizes, r) if p // A != r // A)
    return out / max(1, W // A)


def ring_piece_seconds(W: int, nbytes: float, latency_s: float, bandwidth_Bps: float) -> float:
    """One piece of the ring schedule (all_to_all + all_gather): the cost model's ``2(N-1)`` latency
    rounds plus its bytes."""
    return 2 * (W - 1) * latency_s + nbytes / bandwidth_Bps


def halving_piece_seconds(split_sizes: Sequence[int], latency_s: float, bandwidth_Bps: float) -> float:
    """One piece of the halving schedule: per round, one latency plus its largest message."""
    rounds = halving_rounds(split_sizes)
    return len(rounds) * latency_s + sum(rounds) / bandwidth_Bps


def link_hint(plan) -> tuple[float, float]:
    """(latency seconds, bandwidth bytes/s) the plan's ``"auto"`` schedule assumes."""
    lat = getattr(plan, "link_latency_us", None)
    gbps = getattr(plan, "link_gbps", None)
    return ((DEFAULT_LATENCY_US if lat is None else lat) * 1e-6,
            (DEFAULT_GBPS if gbps is None else gbps) * 1e9 / 8)


def ring_bytes(split_sizes: Sequence[int], gather_size: int) -> float:
    """Bytes one rank sends (the mean over ranks) for one piece of the ring schedule: its all_to_all
    and its all_gather (:class:`fastml_strategy._layouts.PieceWire`)."""
    W = len(split_sizes)
    return sum(split_sizes) * (W - 1) / W + (W - 1) * gather_size


def choose_schedule(schedule: str, W: int, pieces: Sequence[tuple[Sequence[int], int]], topk: bool,
                    uncompressed: bool, latency_s: float, bandwidth_Bps: float) -> str:
    """The schedule of one bucket at ``W`` ranks: ``"ring"``, ``"halving"`` or ``"plain"`` (nothing
    compressed: DDP's own all-reduce). ``pieces``: per pipeline piece, (its chunk messages' sizes,
    headers included, its all_gather message size), as :class:`fastml_strategy._layouts.PieceWire`
    and the runtime's pieces hold them; ``topk``: the bucket has a top-k layer (always the ring).
    The runtime (:meth:`fastml_strategy.collective.CompressedAllReduce.schedule_of`) and the cost
    model call this one function."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule {schedule!r}; use one of {list(SCHEDULES)}")
    if uncompressed:
        return "halving" if schedule == "halving" and W > 1 else "plain"
    if W <= 1 or topk or schedule == "ring":
        return "ring"
    if schedule == "halving":
        return "halving"
    if W == 2:
        return "ring"
    ring = sum(ring_piece_seconds(W, ring_bytes(s, g), latency_s, bandwidth_Bps) for s, g in pieces)
    halv = sum(halving_piece_seconds(s, latency_s, bandwidth_Bps) + halving_codec_seconds(s) for s, _ in pieces)
    return "halving" if halv < ring else "ring"


def halving_codec_seconds(split_sizes: Sequence[int], codec_Bps: float = CODEC_BPS) -> float:
    """The codec work of one halving piece that the ring schedule hides and halving does not: about
    ``2 - 1/(2P)`` encodes and decodes of the piece's encoded bytes, serial with its rounds (the ring
    pipelines its pieces' codec work under their messages), at ``codec_Bps`` encoded bytes a second."""
    P = 1 << (len(split_sizes).bit_length() - 1)
    return (2 - 1 / (2 * P)) * sum(split_sizes) / codec_Bps


def may_halve(plan, world_size: int) -> bool:
    """Whether a plan can run the halving schedule at ``world_size`` (a forced ``"halving"``; or
    ``"auto"`` above 3 ranks: at 2 and 3 the ring never costs more)."""
    sched = getattr(plan, "schedule", "auto")
    return (sched == "halving" and world_size > 1) or (sched == "auto" and world_size > 3)


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
        from fastml_strategy._exchange import mix

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
        from fastml_strategy._exchange import mix

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
