"""Issue 36: torch's PowerSGD hook as a baseline of the autotuner's check.

The cost model's pricing of ``powerSGD_hook`` (costmodel.powersgd) against what the hook hands to
``torch.distributed.all_reduce`` on two gloo ranks, and the check training it beside the tuned plan
on the tiny workload (its runs are a few hundred milliseconds).
"""

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from fastml_strategy.autotune.catalog import HardwareOption
from fastml_strategy.autotune.costmodel import CANDIDATES, LayerProfile, Profile
from fastml_strategy.autotune.costmodel.powersgd import (calibration_start_iter, one_bucket_mb, powersgd_bucket,
                                                         powersgd_bytes_per_rank, powersgd_step_time)

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
from _dist import run_workers  # noqa: E402


def test_pricing_follows_torchs_compression_rule():
    # (128, 32) at rank 4: (128 + 32) * 4 * 2 = 1280 < 4096, compressed (P 512, Q 128); a bias never
    # is; (4, 128): r' = 4, 132 * 4 * 2 = 1056 >= 512, sent whole (at rank 1: 264 < 512, compressed);
    # a 4-D (8, 3, 3, 3) is viewed as (8, 27): compressed at rank 1 (70 < 216), not at 4 (280 >= 216)
    shapes = [((128, 32), 4096), ((128,), 128), ((4, 128), 512), ((8, 3, 3, 3), 216)]
    b4 = powersgd_bucket(shapes, 4)
    assert (b4.uncompressed, b4.p, b4.q) == (128 + 512 + 216, 512, 128)
    b1 = powersgd_bucket(shapes, 1)
    assert (b1.uncompressed, b1.p, b1.q) == (128, 128 + 4 + 8, 32 + 128 + 27)
    assert b1.flops == 4096 + 512 + 216
    # torch's default start (1000) never compresses in a 60-step run: 10% of it, at least 2
    assert calibration_start_iter(60) == 6 and calibration_start_iter(10) == 2


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(48, 96), torch.nn.ReLU(), torch.nn.Linear(96, 96),
                               torch.nn.ReLU(), torch.nn.Linear(96, 6))


def _profile(model, bwd=0.02) -> Profile:
    layers = []
    for i, (n, p) in enumerate(model.named_parameters()):
        lp = LayerProfile(name=n, numel=p.numel(), index=i, ready_s=bwd, grad_sq=1.0,
                          tunable=p.numel() >= 1024, shape=list(p.shape))
        for o in CANDIDATES:
            lp.rel_error[o] = 0.0 if o == "none" else 0.1
            lp.codec_s[o] = 0.0
        layers.append(lp)
    return Profile(layers=layers, forward_s=0.01, backward_s=bwd, optimizer_s=0.004, world_size=2,
                   min_numel=1024, options=list(CANDIDATES))


def _hook_bytes(rank, world_size, ranks, start, steps):
    """Per PowerSGD rank: the bytes (and calls) torch's hook handed to all_reduce in each step."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from _bench import CollectiveBytes

    out = {}
    for r in ranks:
        model = _model()
        ddp = DDP(model, bucket_cap_mb=one_bucket_mb(sum(p.numel() for p in model.parameters())))
        ddp.register_comm_hook(PowerSGDState(process_group=None, matrix_approximation_rank=r,
                                             start_powerSGD_iter=start), powerSGD_hook)
        gen = torch.Generator().manual_seed(rank)
        per_step = []
        for _ in range(steps):
            with CollectiveBytes() as c:
                ddp(torch.randn(8, 48, generator=gen)).square().mean().backward()
            per_step.append((c.bytes, c.calls))
        out[r] = per_step
    return out


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_predicted_bytes_equal_what_torchs_hook_all_reduces():
    """On two gloo ranks: plain fp32 for ``start_powerSGD_iter`` steps, then per bucket three
    all-reduces (uncompressed tensors batched, P, Q) of exactly the priced size; the ring sends
    2(W-1)/W = 1 of them per rank."""
    model = _model()
    prof = _profile(model)
    cap = one_bucket_mb(sum(p.numel() for p in model.parameters()))
    got = run_workers(_hook_bytes, 2, (1, 4), 2, 4, timeout=150)
    for r in (1, 4):
        want_plain = powersgd_bytes_per_rank(prof, r, 2, cap, compressing=False)
        want = powersgd_bytes_per_rank(prof, r, 2, cap)
        assert want < want_plain / 5
        for rank in range(2):
            steps = got[rank][r]
            assert steps[:2] == [(want_plain, 1)] * 2, (r, steps)
            assert steps[2:] == [(want, 3)] * 2, (r, steps, want)
        opt = HardwareOption(name="x", nodes=2, accelerators_per_node=1, price_per_hour=1.0,
                             bandwidth_gbps=0.05, latency_us=0.0, compute_speed=1.0)
        st = powersgd_step_time(prof, opt, r, codec_s=0.003, start=2, steps=4, bucket_mb=cap)
        assert st.bytes_per_rank == want and st.plain_bytes_per_rank == want_plain
        # one bucket, ready at the end of backward: compute, codec and the wire in a row
        assert st.step_s == pytest.approx(0.01 + 0.02 + 0.003 + want / (0.05e9 / 8) + 0.004)
        assert st.mean_step_s == pytest.approx((st.plain_step_s + st.step_s) / 2)


def _check_inputs(tmp_path, tuned_step_s, limit):
    """_check's inputs on the tiny workload: its reference run as the tuned plan's curve (already a
    calibration run), no uniform alternative (so only torch's PowerSGD is trained)."""
    from tiny_workload import workload

    from fastml_strategy.autotune import calibrate
    from fastml_strategy.autotune._state import _Calibrated, _OptionSearch
    from fastml_strategy.autotune.calibrate import stretch_noise
    from fastml_strategy.autotune.costmodel import AccuracyRule, Convergence

    wl = workload()
    steps = 40
    refs = {0: dict(zip(("losses", "metric"), calibrate.train_curve(wl, None, steps, 0))),
            1: dict(zip(("losses", "metric"), calibrate.train_curve(wl, None, steps, 1)))}
    model = wl.fresh_model()
    prof = _profile(model)
    names = [lp.name for lp in prof.layers if lp.tunable]
    groups = {"g": names}
    tuned = {"g": "int8"}
    points = [{"choice": tuned, "seed": 0, "losses": refs[0]["losses"], "metric": refs[0]["metric"],
               "pruned": False}]
    best = {"x": {"option": "x", "choice": tuned, "step_s": tuned_step_s, "objective": 1.0, "use_hook": True}}
    found = _OptionSearch(rows=[], best=best, baseline={}, local_best={"x": None})
    ref = {**refs[0], "references": refs, "noise": stretch_noise(refs), "paired": True}
    cal = _Calibrated(plans=[], ref=ref, points=points, rule=AccuracyRule(limit=limit), run_s=1.0)
    s = SimpleNamespace(calibration_steps=steps, seed=0, max_accuracy_loss=limit, target_steps=1000.0,
                        sharding=SimpleNamespace(sharded=False), storage=f"sqlite:///{tmp_path / 'db'}",
                        workload=wl)
    opt = HardwareOption(name="x", nodes=2, accelerators_per_node=1, price_per_hour=1.0,
                         bandwidth_gbps=0.05, latency_us=100.0, compute_speed=1.0)
    return s, prof, groups, [opt], found, cal, Convergence(k=0.0, gamma=1.0, e_max=1.0)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_check_trains_torch_powersgd_beside_the_tuned_plan(tmp_path):
    from fastml_strategy.autotune.report import words as report
    from fastml_strategy.autotune._check import POWERSGD_RANKS, _check
    from fastml_strategy.autotune._state import _Progress
    from fastml_strategy.autotune.costmodel.powersgd import TORCH_START_ITER

    # a tuned plan predicted 100 s per step: PowerSGD (milliseconds) is sooner, but it only reports
    s, prof, groups, opts, found, cal, conv = _check_inputs(tmp_path, tuned_step_s=100.0, limit=1.0)
    before = dict(found.best["x"])
    rec = _check(s, prof, groups, opts, "x", found, cal, conv, "c", _Progress(False), None, [])
    rows = rec["powersgd"]
    assert [e["rank"] for e in rows] == list(POWERSGD_RANKS)
    cap = one_bucket_mb(sum(lp.numel for lp in prof.layers))
    for e in rows:
        assert e["start_powerSGD_iter"] == calibration_start_iter(40) < TORCH_START_ITER
        assert e["bytes_per_rank"] == powersgd_bytes_per_rank(prof, e["rank"], 2, cap)
        # the cost model's step with the hook's compute as timed in its run
        st = powersgd_step_time(prof, opts[0], e["rank"], e["hook_s"], start=e["start_powerSGD_iter"], steps=40,
                                bucket_mb=cap)
        assert e["hook_s"] > 0 and e["step_s"] == st.step_s and e["mean_step_s"] == st.mean_step_s
        assert e["levels"] > 0 and e["sooner"] and e["within_limit"]
    assert rec["powersgd_faster"].startswith("torch PowerSGD rank ") and "was faster" in rec["powersgd_faster"]
    assert found.best["x"] == before and rec["replaced"] is None  # another hook: plan.json keeps the plan
    assert rec["powersgd_against"] == "the tuned plan"
    text = report._check_text(SimpleNamespace(check=rec))
    assert "torch PowerSGD rank 4" in text and "was faster" in text
    # torch's own hook trained the runs: rank 4 differs from rank 1 (the curves are not the reference's)
    from fastml_strategy.autotune._check import _powersgd_curve

    l1, _, _ = _powersgd_curve(s, 1, calibration_start_iter(40), "c")  # read back from the storage
    assert l1[:calibration_start_iter(40)] == cal.ref["losses"][:calibration_start_iter(40)]
    assert l1 != cal.ref["losses"]

    # a tuned plan predicted at a microsecond per step: no PowerSGD rank is sooner, nothing is claimed
    s, prof, groups, opts, found, cal, conv = _check_inputs(tmp_path, tuned_step_s=1e-6, limit=1.0)
    rec = _check(s, prof, groups, opts, "x", found, cal, conv, "c", _Progress(False), None, [])
    assert len(rec["powersgd"]) == 3 and not any(e["sooner"] for e in rec["powersgd"])
    assert "powersgd_faster" not in rec
    assert "No torch PowerSGD rank reached" in report._check_text(SimpleNamespace(check=rec))


def test_bench_summary_keeps_powersgd_apart_from_the_uniform_recipes(tmp_path):
    # bench_autotune's --summary: the best uniform FastML recipe and the best torch PowerSGD setting,
    # each against the tuned plan (before, a PowerSGD row would have counted as a uniform recipe)
    import csv

    sys.path.insert(0, str(HERE.parents[1] / "benchmarks"))
    import bench_autotune

    rows = [("tuned", "40", "20.0"), ("int4", "45", "30.0"), ("powersgd-r4-s2", "75", "25.0"),
            ("powersgd-r1-s2", "", ""), ("ddp-fp32", "45", "160.0")]
    path = tmp_path / "bench_autotune_gpt2_50mbit_seed0_x_cpu.csv"
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, ["workload", "link", "seed", "target", "plan", "steps_to_target",
                               "seconds_to_target", "ms_per_step"])
        w.writeheader()
        for plan, steps, secs in rows:
            w.writerow({"workload": "gpt2", "link": "50mbit", "seed": 0, "target": 1.3, "plan": plan,
                        "steps_to_target": steps, "seconds_to_target": secs, "ms_per_step": 1})
    (got,) = bench_autotune.summary(tmp_path)
    assert got["best_uniform"] == "int4" and got["tuned_over_best_uniform"] == pytest.approx(20 / 30, abs=1e-3)
    assert got["best_powersgd"] == "powersgd-r4-s2"
    assert got["tuned_over_best_powersgd"] == pytest.approx(0.8)
    assert [bench_autotune._method(p) for p, _, _ in rows] == [
        "tuned plan", "fastml recipe", "torch powersgd", "torch powersgd", "ddp"]
