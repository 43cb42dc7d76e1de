"""The pure parts of benchmarks/bench_scale.py: the physical bound, a CSV row, the cost model's
prediction of each method, and the link and delay parsing (the benchmark itself needs root and runs
by hand, never in CI)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import _netns  # noqa: E402
import bench_scale as bs  # noqa: E402

from fastml_strategy.autotune.costmodel import CANDIDATES, LayerProfile, Profile  # noqa: E402


def _profile(numels=(2048 * 2048, 2048, 2048 * 10, 10), world=16) -> Profile:
    layers = [LayerProfile(name=f"p{i}", numel=n, index=i, ready_s=0.01 * (len(numels) - i), grad_sq=1.0,
                           tunable=n >= 4096, rel_error={o: 0.1 for o in CANDIDATES},
                           codec_s={o: (0.004 if n >= 4096 else 0.0) for o in CANDIDATES})
              for i, n in enumerate(numels)]
    return Profile(layers=layers, forward_s=0.01, backward_s=0.02, optimizer_s=0.005, world_size=world,
                   min_numel=4096, options=list(CANDIDATES))


def test_physical_bound_is_the_larger_of_cores_and_wire():
    # wire: 12.5 MB at 100 Mbit/s = 1 s, plus 8 rounds of 5 ms
    assert bs.physical_bound(0.2, 0.1, 12.5e6, 100e6, 8, 0.005) == pytest.approx(1.04)
    # cores: 0.9 + 0.5 s beat 1.25 MB at 100 Mbit/s (0.1 s) and 30 rounds of 0.5 ms
    assert bs.physical_bound(0.9, 0.5, 1.25e6, 100e6, 30, 0.0005) == pytest.approx(1.4)


def test_build_row_errors_and_bound():
    pred = {"step_s": 0.55, "node_bytes": 1.05e6, "codec_s": 0.1, "compute_s": 0.2, "rounds": 10.0}
    measured = {"ms": 500.0, "node_bytes": 1.0e6, "loss": 2.0, "schedule": "ring"}
    row = bs.build_row((16, 1), "1gbit:0.5ms", "int4", measured, pred, 1e9, 0.0005)
    assert row["step_error_pct"] == 10.0 and row["bytes_error_pct"] == 5.0
    assert row["wire_ms"] == 8.0 and row["bound_ms"] == 300.0  # max(200 + 100, 8 + 10 x 0.5) ms
    assert row["x_bound"] == round(500 / 300, 2)
    assert (row["machines"], row["ranks_per_machine"], row["world"]) == (16, 1, 16)


def test_predict_prices_each_method_as_it_runs():
    prof = _profile()
    opt = bs.option_for(16, 1, 1e9, 0.0005)
    ddp, fp16 = bs.predict(prof, "ddp", opt), bs.predict(prof, "fp16-hook", opt)
    int4, none = bs.predict(prof, "int4", opt), bs.predict(prof, "none", opt)
    grad = 4 * sum(lp.numel for lp in prof.layers)
    assert ddp["node_bytes"] == pytest.approx(2 * 15 / 16 * grad, rel=1e-6)
    assert fp16["node_bytes"] == pytest.approx(ddp["node_bytes"] / 2, rel=1e-6)  # the ring of fp16
    assert none["node_bytes"] == ddp["node_bytes"] and none["codec_s"] == 0.0
    assert int4["node_bytes"] < ddp["node_bytes"] / 6 and int4["codec_s"] > 0.0
    # one bucket (the model is under DDP's first 1 MiB + 25 MiB), a ring all-reduce: 2 (N-1) rounds
    assert ddp["rounds"] == pytest.approx(2 * 15 * len(bs_buckets(prof)), rel=1e-6)
    assert bs.predict(prof, "ddp", bs.option_for(16, 1, 1e9, 0.0))["rounds"] == 0.0


def bs_buckets(prof):
    from fastml_strategy.autotune.costmodel import ddp_buckets

    return ddp_buckets(prof)


def test_combined_profile_takes_the_median_over_ranks():
    dicts = []
    for k in (1.0, 3.0, 2.0):
        p = _profile()
        p.backward_s *= k
        p.layers[0].codec_s = {o: v * k for o, v in p.layers[0].codec_s.items()}
        dicts.append(p.to_dict())
    prof = bs.combined_profile(dicts)
    assert prof.backward_s == pytest.approx(0.04)
    assert prof.layers[0].codec_s["int4"] == pytest.approx(0.008)


def test_parsing():
    assert _netns.delay_us("0.5ms") == 500 and _netns.delay_us("5ms") == 5000 and _netns.delay_us("200us") == 200
    assert bs._link("100mbit:5ms")[2:] == (100e6, 0.005)
    assert bs._shape("16x1") == (16, 1)
    with pytest.raises(ValueError, match="netem's form"):
        _netns.delay_us("5 parsecs")
    with pytest.raises(SystemExit, match="MACHINESxRANKS"):
        bs._shape("16")
    assert _netns.burst_bytes(100e6) == 128 * 1024 and _netns.burst_bytes(10e9) == int(10e9 / 8e3)


def test_predict_counts_fewer_latency_rounds_for_halving_at_16():
    prof = _profile()
    opt = bs.option_for(16, 1, 100e6, 0.005)
    ring, halving = bs.predict(prof, "int4-ring", opt), bs.predict(prof, "int4-halving", opt)
    assert ring["schedules"] == "ring" and halving["schedules"] == "halving"
    assert halving["rounds"] < ring["rounds"]
    assert bs.predict(prof, "int4", opt)["schedules"] in ("ring", "halving")  # the auto choice, named


def test_tcp_payload_link_and_fp16_ring_bytes():
    from fastml_strategy.autotune.costmodel import step_time, tcp_payload_link

    link = tcp_payload_link(100e6, 0.005)
    assert link.bandwidth_Bps == pytest.approx(12.5e6 * 1448 / 1514) and link.latency_s == 0.005
    assert tcp_payload_link(1e9, 0.0, mtu=9000).bandwidth_Bps == pytest.approx(125e6 * 8948 / 9014)
    with pytest.raises(ValueError, match="MTU"):
        tcp_payload_link(1e9, 0.0, mtu=40)
    prof, opt = _profile(), bs.option_for(4, 1, 1e9, 0.0005)
    fp32 = step_time(prof, {}, opt, hook=False)
    fp16 = step_time(prof, {}, opt, hook=False, ring_element_bytes=2)
    assert fp16.node_net_bytes == pytest.approx(fp32.node_net_bytes / 2, abs=2) and fp16.step_s < fp32.step_s


def test_the_floor_is_priced_as_compute_alone():
    # the no-communication method: nothing on the wire, the profile's compute (10 + 20 + 5 ms)
    floor = bs.predict(_profile(), "floor", bs.option_for(16, 1, 1e9, 0.0005))
    assert floor["node_bytes"] == 0.0 and floor["rounds"] == 0.0 and floor["codec_s"] == 0.0
    assert floor["step_s"] == pytest.approx(0.035) and floor["compute_s"] == pytest.approx(0.035)
