"""The halving schedule's shape and the choice between schedules, without processes
(fastml_strategy.comm._halving; the runs on real ranks are tests/test_halving_dist.py)."""

from __future__ import annotations

import math

import pytest

from fastml_strategy import Plan
from fastml_strategy.comm._halving import (chunk_ranges, choose_schedule, fold, halving_bytes_sent,
                                           halving_messages, halving_rounds, may_halve, real_rank, ring_bytes)


@pytest.mark.parametrize("W", range(2, 18))
def test_fold_and_ranges_cover_every_chunk_once(W):
    P = 1 << (W.bit_length() - 1)
    folds = [fold(W, r) for r in range(W)]
    assert sorted(f.vrank for f in folds if not f.folded) == list(range(P))
    for r, f in enumerate(folds):
        if f.partner >= 0:
            assert folds[f.partner].partner == r and f.folded != folds[f.partner].folded
        if not f.folded:
            assert real_rank(W, f.vrank) == r
    owned = []
    for v in range(P):
        ranges = chunk_ranges(W, P, v)
        assert len(ranges) == int(math.log2(P))
        for t, (keep, give) in enumerate(ranges):
            peer = v ^ (P >> (t + 1))
            assert chunk_ranges(W, P, peer)[t] == (give, keep)  # partners split the same range
        owned += list(range(*ranges[-1][0])) if ranges else list(range(W))
    assert sorted(owned) == list(range(W))
    # every message one rank sends is one the peer receives, of the same size
    sizes = [100 + 7 * j for j in range(W)]
    sent = {(r, p, b) for r in range(W) for p, b in halving_messages(sizes, r)}
    assert len(sent) == sum(len(halving_messages(sizes, r)) for r in range(W))


@pytest.mark.parametrize("W", [2, 4, 8, 16])
def test_power_of_two_keeps_the_ring_bandwidth_in_log_rounds(W):
    sizes = [1000] * W
    assert len(halving_rounds(sizes)) == 2 * int(math.log2(W))
    for r in range(W):  # 2(W-1)/W of the piece from every rank, as the ring
        assert halving_bytes_sent(sizes, r) == 2 * (W - 1) * 1000
    assert halving_bytes_sent(sizes) == ring_bytes(sizes, 1000)


def test_non_power_of_two_folds_in():
    sizes = [1000] * 6  # P = 4, ranks 0 and 2 fold into 1 and 3
    assert len(halving_rounds(sizes)) == 2 + 2 * 2
    assert halving_bytes_sent(sizes, 0) == 6000  # its whole piece, once
    assert halving_bytes_sent(sizes, 1) > halving_bytes_sent(sizes, 5)  # the partner also unfolds


def test_choose_schedule():
    piece = lambda W, n=1000: ([n] * W, n)  # noqa: E731
    lat, bw = 50e-6, 1.25e9
    # forced, or where nothing else applies
    assert choose_schedule("ring", 16, [piece(16)], False, False, lat, bw) == "ring"
    assert choose_schedule("halving", 3, [piece(3)], False, False, lat, bw) == "halving"
    assert choose_schedule("halving", 8, [piece(8)], True, False, lat, bw) == "ring"  # top-k: all-gathered
    assert choose_schedule("auto", 8, [piece(8)], False, True, lat, bw) == "plain"  # DDP's own all-reduce
    assert choose_schedule("halving", 8, [piece(8)], False, True, lat, bw) == "halving"
    # auto: N = 2 and 3 always the ring
    for W in (2, 3):
        assert choose_schedule("auto", W, [piece(W, 10)], False, False, 1.0, bw) == "ring"
    # a power of two above 2: the same bytes in fewer rounds, so halving where the rounds it saves
    # outweigh its serial re-encodes (halving_codec_seconds), the ring where they do not
    for W in (4, 8, 16):
        assert choose_schedule("auto", W, [piece(W, 1000)], False, False, 1e-3, bw) == "halving"
        assert choose_schedule("auto", W, [piece(W, 10 ** 6)], False, False, 50e-6, bw) == "ring"
    saved = (2 * 15 - 8) * 50e-6  # latency rounds the halving saves at 16 ranks on the default hint
    big = int(saved * 1e8 / (2 - 1 / 32) / 16)  # bytes a message where its re-encodes cost as much
    assert choose_schedule("auto", 16, [piece(16, big // 2)], False, False, 50e-6, bw) == "halving"
    assert choose_schedule("auto", 16, [piece(16, big * 2)], False, False, 50e-6, bw) == "ring"
    # N = 6: halving (6 rounds, about 3.5 pieces) only where latency dominates the ring's 10 rounds
    assert choose_schedule("auto", 6, [piece(6, 100)], False, False, 1e-3, bw) == "halving"
    assert choose_schedule("auto", 6, [piece(6, 10 ** 7)], False, False, 50e-6, bw) == "ring"
    with pytest.raises(ValueError, match="schedule 'tree'"):
        choose_schedule("tree", 4, [piece(4)], False, False, lat, bw)
    assert may_halve(Plan.from_recipe("int4"), 4) and not may_halve(Plan.from_recipe("int4"), 3)
    assert may_halve(Plan.from_recipe("int4", schedule="halving"), 2)
    assert not may_halve(Plan.from_recipe("int4", schedule="ring"), 16)


def test_plan_schedule_round_trips_and_is_agreed():
    old = Plan.from_recipe("int4")
    d = old.to_dict()
    assert "schedule" not in d and "link_latency_us" not in d  # old files and digests unchanged
    assert Plan.from_dict(d) == old and Plan.from_dict(d).schedule == "auto"
    p = Plan.from_recipe("int4", schedule="halving", link_latency_us=500, link_gbps=0.1)
    assert Plan.from_dict(p.to_dict()) == p
    # the digest every rank compares at registration covers the schedule and the hint
    assert len({old.digest(), p.digest(), Plan.from_recipe("int4", schedule="ring").digest(),
                Plan.from_recipe("int4", link_gbps=1.0).digest()}) == 4
    with pytest.raises(ValueError, match="plan.schedule is 'tree'"):
        Plan.from_recipe("int4", schedule="tree")
    with pytest.raises(ValueError, match="plan.link_gbps is 0"):
        Plan.from_recipe("int4", link_gbps=0)
    with pytest.raises(ValueError, match="link_latency_us"):
        Plan.from_dict({**d, "link_latency_us": "fast"})


def test_cost_model_prices_the_schedule_the_runtime_picks():
    """At 16 nodes on a 1 ms link the model prices halving (2 log2 16 rounds, the runtime's own
    choice) and says so; forced ring costs 2(N-1) rounds per piece; the bytes are the runtime's."""
    from fastml_strategy.autotune.catalog import HardwareOption
    from fastml_strategy.autotune.costmodel import CANDIDATES, LayerProfile, Profile, step_time
    from fastml_strategy.autotune.costmodel.ddp import ddp_bytes_per_rank

    lp = LayerProfile(name="w", numel=1 << 16, index=0, ready_s=0.0, grad_sq=1.0, tunable=True)
    for o in CANDIDATES:
        lp.rel_error[o], lp.codec_s[o] = 0.1, 0.0
    prof = Profile(layers=[lp], forward_s=0.0, backward_s=0.0, optimizer_s=0.0, world_size=2, min_numel=1,
                   options=list(CANDIDATES))
    opt = HardwareOption(name="x", nodes=16, accelerators_per_node=1, price_per_hour=1.0, bandwidth_gbps=1.0,
                         latency_us=1000, compute_speed=1.0)
    choice = {"w": "int4"}
    auto, ring = step_time(prof, choice, opt), step_time(prof, choice, opt, schedule="ring")
    assert (auto.schedules, ring.schedules) == ("halving", "ring")
    assert ring.wire_s - auto.wire_s == pytest.approx((30 - 8) * 1e-3, rel=0.05)
    assert auto.bytes_per_rank == ddp_bytes_per_rank(prof, choice, 16, link=opt.link)
    assert step_time(prof, choice, HardwareOption(name="y", nodes=2, accelerators_per_node=1, price_per_hour=1.0,
                                                  bandwidth_gbps=1.0, latency_us=1000,
                                                  compute_speed=1.0)).schedules == "ring"
