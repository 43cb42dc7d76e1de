"""The halving schedule's shape and the choice between it and the ring, without tensors.

Recursive halving and doubling (:mod:`fastml_strategy.comm._halving` runs it) over a bucket piece's W
chunk messages: N ranks fold onto the P = 2^k of a hypercube (:func:`fold`), each halving round
gives half of the chunks it still holds to its partner (:func:`chunk_ranges`), the doubling rounds
send the reduced chunks back, and the fold is undone. :func:`halving_messages` lists what each rank
sends; :func:`halving_rounds` the largest message of each round (what a round costs on the wire).
:func:`choose_schedule` picks ring, halving or plain per bucket from alpha-beta terms on the same
message sizes: the runtime and the autotuner's cost model call this one function.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

__all__ = ["DEFAULT_LATENCY_US", "DEFAULT_GBPS", "CODEC_BPS", "Fold", "fold", "real_rank",
           "chunk_ranges", "ring_piece_seconds", "halving_rounds", "halving_piece_seconds", "halving_bytes_sent",
           "halving_messages", "halving_node_bytes", "ring_bytes", "halving_codec_seconds", "choose_schedule",
           "may_halve", "link_hint"]

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
    and its all_gather (:class:`fastml_strategy.wire.PieceWire`)."""
    W = len(split_sizes)
    return sum(split_sizes) * (W - 1) / W + (W - 1) * gather_size


def choose_schedule(schedule: str, W: int, pieces: Sequence[tuple[Sequence[int], int]], topk: bool,
                    uncompressed: bool, latency_s: float, bandwidth_Bps: float) -> str:
    """The schedule of one bucket at ``W`` ranks: ``"ring"``, ``"halving"`` or ``"plain"`` (nothing
    compressed: DDP's own all-reduce). ``pieces``: per pipeline piece, (its chunk messages' sizes,
    headers included, its all_gather message size), as :class:`fastml_strategy.wire.PieceWire`
    and the runtime's pieces hold them; ``topk``: the bucket has a top-k layer (always the ring).
    The runtime (:meth:`fastml_strategy.collective.CompressedAllReduce.schedule_of`) and the cost
    model call this one function."""
    from fastml_strategy.config import SCHEDULES  # (imports torch: only where a schedule is chosen)

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
