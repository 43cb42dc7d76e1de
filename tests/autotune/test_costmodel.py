"""Unit tests of the cost model: each formula against a hand computation on a synthetic profile."""

import math
import sys
from pathlib import Path

import pytest
import torch

from fastml_strategy.autotune.catalog import HardwareOption
from fastml_strategy.autotune.costmodel import (
    BUCKET_BYTES, CANDIDATES, FIRST_BUCKET_BYTES, Convergence, LayerProfile, Profile, ddp_buckets,
    evaluate, fit_alpha_beta, fit_codec_scale, fit_convergence, pareto_front, plan_error, step_time)
from fastml_strategy.comm._status import HEADER
from fastml_strategy.codecs import wire_bytes

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _dist import run_workers  # noqa: E402


def make_profile(numels=(1 << 18, 1 << 16), ready=None, world_size=2, fwd=0.01, bwd=0.02, opt=0.005,
                 errors=None, codec_s=1e-3):
    """Layers in registration order; by default every gradient is ready at the end of backward."""
    layers = []
    for i, n in enumerate(numels):
        lp = LayerProfile(name=f"l{i}.weight", numel=n, index=i,
                          ready_s=bwd if ready is None else ready[i], grad_sq=1.0, tunable=True)
        for o in CANDIDATES:
            lp.rel_error[o] = 0.0 if o == "none" else (errors or {}).get(o, 0.1)
            lp.codec_s[o] = 0.0 if o == "none" else codec_s
        layers.append(lp)
    return Profile(layers=layers, forward_s=fwd, backward_s=bwd, optimizer_s=opt, world_size=world_size,
                   min_numel=4096, options=list(CANDIDATES))


def option(nodes=2, gbps=1.0, latency_us=0.0, price=1.0, speed=1.0, per_node=1):
    return HardwareOption(name="x", nodes=nodes, accelerators_per_node=per_node, price_per_hour=price,
                          bandwidth_gbps=gbps, latency_us=latency_us, compute_speed=speed)


def test_alpha_beta_fit_recovers_the_link():
    alpha, bw = 80e-6, 117e6
    samples = [(r, b, r * alpha + b / bw) for r in (2, 1) for b in (1e4, 1e5, 1e6, 4e6)]
    link = fit_alpha_beta(samples)
    assert link.latency_s == pytest.approx(alpha, rel=1e-6)
    assert link.bandwidth_Bps == pytest.approx(bw, rel=1e-6)


def test_alpha_beta_fit_rejects_a_link_that_does_not_slow_down():
    with pytest.raises(ValueError, match="--link"):
        fit_alpha_beta([(2, 1e3, 1.0), (2, 1e6, 0.5)])


def test_plain_ddp_without_overlap_is_compute_plus_wire():
    prof = make_profile()  # every gradient ready at the end of backward: nothing overlaps
    opt = option(gbps=1.0, latency_us=50)
    br = step_time(prof, {}, opt, hook=False)
    nbytes = sum(wire_bytes(lp.numel, CANDIDATES["none"], 2) for lp in prof.layers)
    buckets = ddp_buckets(prof)
    wire = nbytes / 125e6 + len(buckets) * 2 * (2 - 1) * 50e-6
    assert br.bytes_per_rank == nbytes
    assert br.codec_s == 0.0
    assert br.step_s == pytest.approx(prof.compute_s + wire, rel=1e-9)


def test_overlap_hides_early_buckets_but_never_the_last():
    n = FIRST_BUCKET_BYTES // 4  # exactly one first bucket each
    # last layer (first bucket) ready at 10% of backward, first layer at the end
    prof = make_profile(numels=(n, n), ready=(0.02, 0.002), bwd=0.02)
    opt = option(gbps=10.0)
    br = step_time(prof, {}, opt, hook=False)
    per_bucket = wire_bytes(n, CANDIDATES["none"], 2) / 1.25e9
    assert len(ddp_buckets(prof)) == 2
    # the early bucket's transfer (0.84 ms) ends long before backward does; only the last is exposed
    assert br.exposed_s == pytest.approx(per_bucket, rel=1e-9)
    late = make_profile(numels=(n, n), bwd=0.02)
    assert step_time(late, {}, opt, hook=False).exposed_s == pytest.approx(2 * per_bucket, rel=1e-9)


def test_buckets_follow_ddp_caps():
    small = FIRST_BUCKET_BYTES // 4 // 4
    prof = make_profile(numels=(BUCKET_BYTES // 4,) + (small,) * 6)
    buckets = [[lp.name for lp in b] for b in ddp_buckets(prof)]
    # reverse order; the first bucket closes once it holds >= 1 MiB (4 quarter-MiB layers)
    assert buckets[0] == ["l6.weight", "l5.weight", "l4.weight", "l3.weight"]
    assert buckets[1] == ["l2.weight", "l1.weight", "l0.weight"]


def test_compression_cuts_wire_time_and_adds_codec_time():
    prof = make_profile(codec_s=2e-3)
    opt = option(gbps=1.0)
    none = step_time(prof, {}, opt, hook=False)
    int4 = step_time(prof, {lp.name: "int4" for lp in prof.layers}, opt)
    expect_bytes = sum(wire_bytes(lp.numel, CANDIDATES["int4"], 2) for lp in prof.layers)
    # one bucket of one piece: its all_to_all and its all_gather each send the other rank a header
    assert len(ddp_buckets(prof)) == 1
    assert int4.bytes_per_rank == expect_bytes + 2 * (2 - 1) * HEADER
    assert int4.bytes_per_rank < none.bytes_per_rank / 7
    # codec time follows the profiled round trip (twice as slow codecs: twice the time); a dense codec's
    # scatter-reduce-allgather costs more than one round trip per layer and under two
    slow = step_time(make_profile(codec_s=4e-3), {lp.name: "int4" for lp in prof.layers}, opt)
    assert slow.codec_s == pytest.approx(2 * int4.codec_s)
    assert 2 * 2e-3 < int4.codec_s < 2 * 2 * 2e-3


def test_compute_scales_with_ranks_and_speed():
    prof = make_profile(world_size=2)
    base = step_time(prof, {}, option(nodes=2), hook=False).compute_s
    assert step_time(prof, {}, option(nodes=4), hook=False).compute_s == pytest.approx(base / 2)
    assert step_time(prof, {}, option(nodes=2, speed=4.0), hook=False).compute_s == pytest.approx(base / 4)
    assert step_time(prof, {}, option(nodes=1, per_node=4), hook=False).compute_s == pytest.approx(base / 2)
    # one node: no network traffic at all; the ring runs on the intra-node link (PCIe class by default)
    one = step_time(prof, {}, option(nodes=1, per_node=4), hook=False)
    assert one.node_net_bytes == 0 and one.topology == "flat"
    assert one.wire_s == pytest.approx(2 * 3 * 5e-6 + one.bytes_per_rank / 25e9)


def test_plan_error_is_gradient_energy_weighted():
    prof = make_profile(numels=(1 << 16, 1 << 16), errors={"int4": 0.2, "int2": 0.6})
    prof.layers[0].grad_sq, prof.layers[1].grad_sq = 3.0, 1.0
    e = plan_error(prof, {"l0.weight": "int4", "l1.weight": "int2"})
    assert e == pytest.approx(math.sqrt((3 * 0.2 ** 2 + 1 * 0.6 ** 2) / 4))
    assert plan_error(prof, {}) == 0.0


def test_evaluate_cost_is_time_nodes_price():
    prof = make_profile()
    opt = option(nodes=4, price=2.5)
    conv = Convergence(k=2.0, gamma=1.0, e_max=0.5)
    r = evaluate(prof, {lp.name: "int4" for lp in prof.layers}, opt, conv, target_steps=1000)
    assert r["g"] == pytest.approx(1 + 2.0 * r["error"])
    assert r["steps"] == pytest.approx(1000 * r["g"])
    assert r["tta_s"] == pytest.approx(r["steps"] * r["step_s"])
    assert r["cost_usd"] == pytest.approx(r["tta_s"] * 4 * 2.5 / 3600)
    assert r["feasible"] is True
    assert evaluate(prof, {lp.name: "int4" for lp in prof.layers}, opt,
                    Convergence(2.0, 1.0, e_max=0.01), 1000)["feasible"] is False


def test_convergence_fit_recovers_g_and_the_feasible_limit():
    k, gamma = 3.0, 1.5
    pts = [{"error": e, "ratio": 1 + k * e ** gamma, "accuracy_loss": 0.002 if e < 0.3 else 0.05,
            "censored": False} for e in (0.01, 0.05, 0.1, 0.2, 0.4, 0.6)]
    conv = fit_convergence(pts, max_accuracy_loss=0.01)
    assert conv.gamma == pytest.approx(gamma, abs=0.05)
    assert conv.k == pytest.approx(k, rel=0.1)
    assert conv.e_max == pytest.approx(0.2)  # 0.4 lost 5 points: it and everything above is out


def test_convergence_envelope_stops_at_the_first_failure_and_pruned_trials():
    pts = [{"error": 0.1, "ratio": 1.0, "accuracy_loss": 0.0, "censored": False},
           {"error": 0.2, "ratio": 3.0, "accuracy_loss": float("inf"), "censored": True, "pruned": True},
           {"error": 0.3, "ratio": 1.1, "accuracy_loss": 0.0, "censored": False}]
    assert fit_convergence(pts, 0.01).e_max == pytest.approx(0.1)


def test_pareto_front():
    pts = [(1.0, 5.0), (2.0, 3.0), (3.0, 4.0), (4.0, 1.0), (2.5, 3.0)]
    assert pareto_front(pts) == [0, 1, 3]


def test_codec_scale_fit_recovers_a_known_multiplier():
    prof = make_profile(codec_s=3e-3)
    opt = option(gbps=1.0)
    choice = {lp.name: "int4" for lp in prof.layers}
    prof.codec_scale = {"quantize": 2.5}
    measured = step_time(prof, choice, opt).step_s
    prof.codec_scale = {}
    fitted = fit_codec_scale(prof, opt, {"int4": measured})
    assert fitted["quantize"] == pytest.approx(2.5, rel=1e-3)
    assert prof.codec_scale == {}  # the fit does not leave its trial values behind


@pytest.mark.parametrize("name", ["none", "fp16", "int8", "int3", "topk10", "topk1-int4"])
def test_bits_per_element_is_what_the_codec_sends(name):
    """The report's bits per element are the encoded message's, alignment included (odd size)."""
    import torch

    from fastml_strategy.autotune.report import bits_per_element
    from fastml_strategy.codecs import roundtrip

    n = 1001
    _, nbytes = roundtrip(torch.randn(n, generator=torch.Generator().manual_seed(0)), CANDIDATES[name])
    assert bits_per_element(CANDIDATES[name], n) == pytest.approx(8 * nbytes / n, rel=0, abs=1e-12)


def test_a_codec_that_is_no_candidate_is_an_error():
    """A top-k layer's dense fall-back is timed as the candidate it equals; no silent stand-in."""
    from fastml_strategy.autotune.costmodel import _candidate_name
    from fastml_strategy.config import Codec, CodecConfig

    assert _candidate_name(CANDIDATES["int8"]) == "int8"
    with pytest.raises(ValueError, match="none of the autotuner's candidates"):
        _candidate_name(CodecConfig(codec=Codec.QUANTIZE, bits=5))


def test_ddp_on_several_ranks_per_machine_is_priced_as_the_hook_runs_it():
    from fastml_strategy.autotune.costmodel import ddp_node_net_bytes, ddp_topology

    n = 1 << 20
    prof = make_profile(numels=(n,))
    int4 = {"l0.weight": "int4"}
    cfg = CANDIDATES["int4"]
    for A in (2, 4):
        opt = option(nodes=2, per_node=A, gbps=1.0)
        W = 2 * A
        hier = step_time(prof, int4, opt)
        flat = step_time(prof, int4, opt, topology="flat", schedule="ring")  # the ring measured (DESIGN.md)
        assert (hier.topology, flat.topology) == ("hierarchical", "flat")
        # across machines: A parts of n/A elements, each 2(N-1)/N of its encoding = 1.00 x S_c per
        # machine, plus the headers of the part's all_to_all and all_gather (one piece each)
        assert hier.node_net_bytes == A * (wire_bytes(n // A, cfg, 2) + 2 * HEADER)
        assert hier.node_net_bytes == pytest.approx(wire_bytes(n, cfg, 2), rel=0.01)
        # flat: the all_to_all half goes straight to each chunk's owner (A (W-A)/W x S_c leave the
        # machine), the ring all_gather half crosses once ((W-1)/W x S_c): 1.75 x S_c at A = 2 and
        # 2.875 at A = 4, as measured on two emulated machines (DESIGN.md: 1.76 and 2.89)
        s_c = hier.node_net_bytes
        assert flat.node_net_bytes / s_c == pytest.approx({2: 1.75, 4: 2.875}[A], rel=0.01)
        # the slow link sets the pace: the hierarchy is faster; its intra-node stage is priced, not free
        assert hier.wire_s < flat.wire_s
        inner = 2 * (A - 1) / A * 4 * n
        assert hier.bytes_per_rank == pytest.approx(inner + hier.node_net_bytes / A, rel=1e-6)
        assert hier.codec_s == pytest.approx(step_time(prof, int4, option(nodes=2)).codec_s / A, rel=1e-6)
        assert ddp_node_net_bytes(prof, int4, opt) == hier.node_net_bytes
        # plain DDP: gloo's ring over all W ranks crosses each machine's link with 2(W-1)/W x S
        ddp = step_time(prof, {}, opt, hook=False)
        assert ddp.node_net_bytes == wire_bytes(n, CANDIDATES["none"], W) and ddp.topology == "flat"
    # flat where the runtime is flat: one machine, or one rank per machine
    assert ddp_topology(1, 8) == ddp_topology(4, 1) == ddp_topology(4, 8, "flat") == "flat"
    assert step_time(prof, int4, option(nodes=1, per_node=4)).node_net_bytes == 0
    with pytest.raises(ValueError, match="topology='ring'"):
        ddp_topology(2, 2, "ring")


def test_hierarchical_parts_are_the_runtimes():
    """The cost model cuts each layer into the runtime's parts (hierarchical.part_bounds, on the codec's
    part unit), not into ceil(numel / A): on odd sizes the rows differ, and so do the bytes."""
    from fastml_strategy.autotune._state import _plan_from_choice
    from fastml_strategy.autotune.costmodel import hier_bucket_wire
    from fastml_strategy.comm.hierarchical import part_bounds

    prof = make_profile(numels=(1000003, 70001, 4099))
    choice = {"l0.weight": "int4", "l1.weight": "topk1", "l2.weight": "int8"}
    plan, _ = _plan_from_choice(prof, choice, "t")
    for A in (2, 3, 4, 8):
        hw = hier_bucket_wire(prof.layers, choice, 2, A)
        for i, lp in enumerate(prof.layers):
            b = part_bounds(plan, lp.name, lp.numel, A)
            assert [hw.parts[l][i] for l in range(A)] == [b[l + 1] - b[l] for l in range(A)], (A, lp.name)
        assert hw.row_numel == max(sum(row) for row in hw.parts)
    # blocks of 256 (int4's part unit) cannot be cut into 8 parts of ceil(1000003 / 8) elements
    hw = hier_bucket_wire(prof.layers[:1], choice, 2, 8)
    assert hw.parts[0][0] % 256 == 0 and hw.parts[0][0] != -(-1000003 // 8)


def test_intra_node_bf16_halves_the_hop_inside_the_machine():
    """Plan.intra_node = bf16 (or fp16): the reduce-scatter and all-gather inside the machine send 2
    bytes per element, the bytes across machines stay, and the intra-node wire time drops; a flat
    schedule (one rank per machine) has no such hop and is unchanged."""
    from fastml_strategy.autotune.catalog import Link
    from fastml_strategy.autotune.costmodel import hier_bucket_wire, intra_node_error

    n, A = 1 << 20, 4
    prof = make_profile(numels=(n,))
    int4 = {"l0.weight": "int4"}
    slow_intra = HardwareOption(name="x", nodes=2, accelerators_per_node=A, price_per_hour=1.0, bandwidth_gbps=10.0,
                                latency_us=0.0, compute_speed=1.0, intra_link=Link(1e9 / 8, 0.0, "given"))
    exact = step_time(prof, int4, slow_intra)
    half = step_time(prof, int4, slow_intra, intra_node="bf16")
    fp16 = step_time(prof, int4, slow_intra, intra_node="fp16")
    assert step_time(prof, int4, slow_intra, intra_node="none") == exact
    assert half.node_net_bytes == exact.node_net_bytes == fp16.node_net_bytes > 0
    hw = hier_bucket_wire(prof.layers, int4, 2, A)
    intra32, intra16 = hw.intra_bytes(4), hw.intra_bytes(2)
    assert intra32 == 2 * (A - 1) * (n // A) * 4 == 2 * intra16
    assert exact.bytes_per_rank - half.bytes_per_rank == intra32 - intra16
    assert half.bytes_per_rank == fp16.bytes_per_rank
    # the hop's wire time halves (1 Gbit/s inside, 10 Gbit/s across: it dominated)
    assert exact.wire_s - half.wire_s == pytest.approx(intra16 / (1e9 / 8), rel=1e-9)
    assert half.step_s < exact.step_s
    # the rounding is priced as error: in quadrature with the plan's
    e = plan_error(prof, int4)
    assert plan_error(prof, int4, "bf16") == pytest.approx(math.hypot(e, 2 ** -8))
    assert plan_error(prof, int4, "none") == e and intra_node_error(prof, None) == 0.0
    with pytest.raises(ValueError, match="intra_node 'int8'"):
        plan_error(prof, int4, "int8")
    # one rank per machine (flat): nothing to halve
    flat = option(nodes=8, per_node=1)
    assert step_time(prof, int4, flat, intra_node="bf16") == step_time(prof, int4, flat)


def test_intra_node_choices_where_the_hop_exists():
    """The search offers none/bf16 only on several machines of several ranks (DDP), and fp16 too only
    where the profile measured the fp16 cast within twice its unit roundoff (no range loss)."""
    from fastml_strategy.autotune.costmodel import Sharding, intra_node_choices, intra_node_error

    prof = make_profile()
    assert intra_node_choices(prof, option(nodes=4, per_node=1)) == ()
    assert intra_node_choices(prof, option(nodes=1, per_node=8)) == ()
    assert intra_node_choices(prof, option(nodes=2, per_node=4), Sharding("hsdp")) == ()
    assert intra_node_choices(prof, option(nodes=2, per_node=4)) == ("none", "bf16")  # fp16 measured 0.1
    fine = make_profile(errors={"fp16": 3e-4})
    assert intra_node_choices(fine, option(nodes=2, per_node=4)) == ("none", "bf16", "fp16")
    assert intra_node_error(fine, "fp16") == 2 ** -11  # the larger of the roundoff and the measured
    assert intra_node_error(prof, "fp16") == pytest.approx(0.1)


# -- against a real run ------------------------------------------------------------------------------
def _mlp(widths):
    torch.manual_seed(0)
    layers = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def _mlp_profile(widths, min_numel=4096) -> Profile:
    layers = []
    for i, (n, p) in enumerate(_mlp(widths).named_parameters()):
        lp = LayerProfile(name=n, numel=p.numel(), index=i, ready_s=0.01, grad_sq=1.0,
                          tunable=p.numel() >= min_numel, shape=list(p.shape))
        for o in CANDIDATES:
            lp.rel_error[o] = 0.0 if o == "none" else 0.1
            lp.codec_s[o] = 0.0
        layers.append(lp)
    return Profile(layers=layers, forward_s=0.01, backward_s=0.02, optimizer_s=0.004, world_size=2,
                   min_numel=min_numel, options=list(CANDIDATES))


def _hook_bytes(rank, world_size, widths, plans, bucket_mb, piece_numel):
    """Per plan: the bytes this rank's hook counted in its third step (DDP's buckets rebuilt after
    the first), the buckets that step all-reduced (parameter names) and their pieces."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import fastml_strategy as fm

    out = []
    for plan in plans:
        model = _mlp(widths)
        ddp = DDP(model, bucket_cap_mb=bucket_mb)
        state = fm.register_hook(ddp, plan=plan)
        eng = state._engine
        if piece_numel is not None:
            eng.piece_numel = piece_numel
        used = []
        layout_for = eng.layout_for

        def recording(*a, **k):
            lay = layout_for(*a, **k)
            used.append((lay.names, len(lay.pieces)))
            return lay

        eng.layout_for = recording
        gen = torch.Generator().manual_seed(rank)
        before = 0
        for _ in range(3):
            used.clear()
            before = eng.bytes_sent
            ddp(torch.randn(4, widths[0], generator=gen)).square().mean().backward()
        out.append({"bytes": eng.bytes_sent - before, "buckets": [n for n, _ in used],
                    "pieces": [p for _, p in used]})
        state.close()
    return out


# (widths, plans by name, DDP bucket cap MiB, piece size: None = the runtime's own PIECE_NUMEL)
_REAL_CASES = {
    # small pieces: the 60000-element layer is cut into slices, small layers share a piece
    "pieces": ((64, 300, 200, 100, 10), ["fp32", "int4", "topk1", "mix"], 0.1, 8192),
    # a layer larger than the runtime's own piece (4196352 > PIECE_NUMEL elements)
    "default": ((2048, 2049, 10), ["int4"], 25, None),
    # the low-rank codec: its factor rounds (fp32 and int8 factors) beside the pieces, a matrix too
    # small to gain at rank 8 falling back to fp32, and mixed with quantized layers
    "lowrank": ((64, 300, 200, 100, 10), ["lowrank2", "lowrank8", "mixlr"], 0.1, 8192),
}
_MIX = {"0.weight": "int2", "2.weight": "topk1", "4.weight": "fp16"}
_MIXES = {"mix": _MIX, "mixlr": {"0.weight": "lowrank4", "2.weight": "int4", "4.weight": "lowrank1",
                                 "6.weight": "lowrank8"}}


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", sorted(_REAL_CASES))
def test_ddp_bytes_match_what_the_hook_sends(case):
    """The cost model's bytes per rank and step (every message's header, the pipeline pieces, the
    all_gather padded to its largest chunk, the plain all-reduce of an fp32 bucket) are exactly what
    the hook counts on two gloo ranks, for fp32, int4, top-k and a mix."""
    from fastml_strategy.autotune._state import _plan_from_choice
    from fastml_strategy.autotune.costmodel import bucket_wire_of, ddp_bytes_per_rank
    from fastml_strategy.comm._layouts import PIECE_NUMEL

    widths, names, bucket_mb, piece = _REAL_CASES[case]
    prof = _mlp_profile(widths)
    choices = [_MIXES[n] if n in _MIXES else {lp.name: ("none" if n == "fp32" else n) for lp in prof.layers}
               for n in names]
    plans = [_plan_from_choice(prof, c, n)[0] for c, n in zip(choices, names)]
    results = run_workers(_hook_bytes, 2, widths, plans, bucket_mb, piece, timeout=200)
    piece = piece or PIECE_NUMEL
    for i, (name, choice) in enumerate(zip(names, choices)):
        model_buckets = [tuple(lp.name for lp in b) for b in ddp_buckets(prof, bucket_mb)]
        for rank in range(2):
            got = results[rank][i]
            assert got["buckets"] == model_buckets, (name, got["buckets"])
            want = ddp_bytes_per_rank(prof, choice, 2, rank, bucket_mb=bucket_mb, piece_numel=piece)
            assert got["bytes"] == want, (name, rank, got["bytes"], want)
            for names_b, pieces in zip(got["buckets"], got["pieces"]):
                wire = bucket_wire_of([prof.layer(n) for n in names_b], choice, 2, piece_numel=piece)
                assert pieces == len(wire.pieces), (name, names_b)
        if name in ("int4", "mix"):  # (top-k layers travel in the all_gather of one piece)
            assert max(results[0][i]["pieces"]) >= 2, "a bucket must be pipelined"
        br = step_time(prof, choice, option(nodes=2), bucket_mb=bucket_mb, piece_numel=piece)
        mean = sum(r[i]["bytes"] for r in results) / 2
        assert abs(br.bytes_per_rank - mean) <= len(model_buckets) / 2, (name, br.bytes_per_rank, mean)


def test_bucket_wire_is_the_layout_the_hook_builds():
    """The tensor-free pricing of a bucket gives the message sizes of every piece of the runtime's
    BucketLayout, for every rank, on odd sizes, several world sizes, fp32 and bf16 buckets."""
    import random

    from fastml_strategy import Plan
    from fastml_strategy.comm._layouts import BucketLayout, bucket_wire
    from fastml_strategy.config import RECIPES

    rng = random.Random(0)
    recipes = ["int4", "int2", "fp16", "topk1", "none", "int8", "topk1-int4"]
    for _ in range(25):
        W, k = rng.choice([2, 3, 5]), rng.randint(1, 6)
        numels = [rng.choice([3, 37, 5000, 50000, 123457]) for _ in range(k)]
        names = [f"l{i}" for i in range(k)]
        plan = Plan(default=RECIPES["none"], layers={n: RECIPES[rng.choice(recipes)] for n in names})
        dtype, piece = rng.choice([torch.float32, torch.bfloat16]), rng.choice([8192, 30000, 1 << 30])
        wire = bucket_wire(tuple(numels), tuple(plan.for_parameter(n, m) for n, m in zip(names, numels)), W,
                           dtype, piece)
        for r in range(W):
            lay = BucketLayout(names, [sum(numels[:i]) for i in range(k)], numels, plan, W, r,
                               torch.device("cpu"), dtype, persistent=False, piece_numel=piece)
            assert lay.uncompressed == wire.uncompressed
            if not lay.uncompressed:
                assert [tuple(p.split_sizes) for p in lay.pieces] == [p.split_sizes for p in wire.pieces]
                assert [p.gather_size for p in lay.pieces] == [p.gather_size for p in wire.pieces]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ddp_bytes_match_the_halving_schedule():
    """At 4 ranks on a far link (5 ms, 100 Mbit/s, the plan's hint) the runtime's "auto" schedule runs
    int4 buckets through recursive halving: the cost model's bytes per rank (the same choice,
    fastml_strategy.wire.schedule.choose_schedule, on the same message sizes) are exactly what the hook
    counts, as for the forced ring and for `none` forced through halving."""
    import dataclasses

    from fastml_strategy.autotune._state import _plan_from_choice
    from fastml_strategy.autotune.catalog import Link
    from fastml_strategy.autotune.costmodel import ddp_bytes_per_rank

    far = Link(0.1e9 / 8, 5e-3, "given")

    widths, bucket_mb, piece = (64, 300, 200, 10), 0.1, 8192
    prof = _mlp_profile(widths)
    cases = [("int4", "auto"), ("int4", "ring"), ("none", "halving")]
    choices = [{lp.name: name for lp in prof.layers} for name, _ in cases]
    plans = [dataclasses.replace(_plan_from_choice(prof, c, n)[0], schedule=sched, link_latency_us=5000.0,
                                 link_gbps=0.1) for c, (n, sched) in zip(choices, cases)]
    results = run_workers(_hook_bytes, 4, widths, plans, bucket_mb, piece, timeout=280)
    for i, ((name, sched), choice) in enumerate(zip(cases, choices)):
        for rank in range(4):
            want = ddp_bytes_per_rank(prof, choice, 4, rank, bucket_mb=bucket_mb, piece_numel=piece,
                                      schedule=sched, link=far)
            assert results[rank][i]["bytes"] == want, (name, sched, rank, results[rank][i]["bytes"], want)
    # the halving and the ring runs of int4 differ (a schedule really changed), by the all_gather padding
    assert results[0][0]["bytes"] != results[0][1]["bytes"]
